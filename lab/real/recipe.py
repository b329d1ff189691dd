#!/usr/bin/env python3
"""The inference recipe on Qwen2.5-Coder-1.5B at 32K (issue #66 part 3): which skip rule, at which
setting, makes the whole-model prefill fastest while needle retrieval and perplexity hold.

Arms (--arms, separated by spaces; the dense arm runs first whether named or not):

    sdpa_cudnn          dense: torch SDPA; timed restricted to cuDNN (qwen_e2e's backend context);
                        perplexity and needles with SDPA's own choice (qwen_eval's dense)
    mala:tau=T          MALA at tau T in every layer, prefill and decode (qwen_eval.eval_attention)
    mala_layers:SPEC    MALA with a per-layer tau (mala.layer_tau): SPEC is a comma list of I=T
                        (layer I), firstK=T (layers 0 .. K-1) and default=T (the rest; required),
                        e.g. 0=0,default=4 (layer 0 exact, the others tau 4)
    fi_skip:sf=X        FlashInfer's skip-softmax at scale factor X in the prefill
                        (lab/suite/fi_system.py's adapter, GQA native); decode steps dense SDPA (no
                        skip-softmax decode on sm_90).  Unsupported (recorded, with the reason) off
                        CUDA, without flashinfer, or at a head size the suite's kernels lack.

Per arm, on the same inputs at N tokens (default 32768):
  prefill_ms    whole-model prefill (qwen_e2e.prefill_logits: every layer, the last position's
                logits), median of --reps after a warm-up (qwen_e2e.timed), on the first of the
                perplexity sequences; attention_ms: the attention calls' share of one more prefill
                (events around each call, so only a breakdown)
  retained      MALA: the forward's retained tile fraction (AttentionStats), mean over layers and
                the perplexity sequences; fi_skip: FlashInfer's rule replayed on the model's own
                Q, K of that sequence (fi_system.blasst_critical), mean over layers; dense: 1
  ppl_32k       perplexity over the --sequences sequences of qwen_eval (lab/real/corpus.py), and
                the paired relative difference against dense with its 95% t-interval
  niah_multikey_32k   qwen_niah's multi-key trials (4 needles, --trials of them, seed 31: at
                N = 32768 the trials of qwen_niah.py's 32K multikey cell), accuracy in percent with
                the Wilson 95% interval, and the trials where the arm and dense differ

Selection, for each rule (mala, mala_layers, fi_skip): among its arms whose NIAH accuracy is at most
--niah-points (2) below dense's and whose perplexity is at most --ppl-rel (0.5%) above dense's,
the one with the largest prefill speedup over sdpa_cudnn; null when none qualifies.  Better than
dense always qualifies (the tolerances are one-sided).

    python3 lab/real/recipe.py --gguf /tmp/mala-real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --out $OUT --n 32768 --sequences 8 --trials 50
    python3 lab/real/recipe.py merge OUT/recipe.json bench/results/peers/skip_softmax.json

Writes OUT/recipe.json ({"real": [rows], "selection": {...}, "raw": per arm losses and answers}),
saved after every arm.  `merge` copies its "real" rows, selection and run description into the peers
file, keeping the file's other keys ("synthetic").
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
SUITE = os.path.join(os.path.dirname(HERE), "suite")
if SUITE not in sys.path:
    sys.path.append(SUITE)  # fi_system and systems (after lab/real: no shadowing)

import corpus  # noqa: E402
import qwen_e2e  # noqa: E402
import qwen_eval  # noqa: E402
import qwen_measure as qm  # noqa: E402
import qwen_niah  # noqa: E402

DEFAULT_ARMS = ("sdpa_cudnn", "mala:tau=1", "mala:tau=2", "mala:tau=4", "mala:tau=8", "mala:tau=16",
                "mala:tau=64", "mala_layers:0=0,default=4", "mala_layers:0=0,default=16",
                "mala_layers:first2=0,default=8", "mala_layers:first2=0,default=64",
                "fi_skip:sf=1", "fi_skip:sf=16", "fi_skip:sf=64", "fi_skip:sf=256")
RULES = ("mala", "mala_layers", "fi_skip")
SYSTEM = {"dense": "cudnn", "mala": "mala", "mala_layers": "mala_per_layer", "fi_skip": "flashinfer_skip_softmax"}

ARM = {"fi": None}        # the FlashInfer system while a fi_skip arm runs; None: qwen_eval.eval_attention
TIMES = {"events": None}  # a list while one prefill marks each attention call's start and end


# ---- arms -------------------------------------------------------------------------------------------

def _tau_value(text, where):
    try:
        t = float(text)
    except ValueError:
        raise ValueError(f"{where}: '{text}' is not a number") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"{where}: tau must be finite and >= 0 (got {text})")
    return t


def parse_layer_spec(spec):
    """'0=0,default=4' -> {0: 0.0, 'default': 4.0}; 'first2=0,default=8' -> {0: 0.0, 1: 0.0,
    'default': 8.0}: a mala.layer_tau dict.  A layer named twice, a bad entry or no default raises."""
    out = {}
    for item in spec.split(","):
        key, sep, val = item.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"layer spec '{spec}': entry '{item}' is not KEY=TAU")
        tau = _tau_value(val, f"layer spec '{spec}', {key}")
        if key == "default":
            layers = ["default"]
        elif key.startswith("first") and key[5:].isdigit() and int(key[5:]) > 0:
            layers = list(range(int(key[5:])))
        elif key.isdigit():
            layers = [int(key)]
        else:
            raise ValueError(f"layer spec '{spec}': '{key}' is not a layer index, firstK or default")
        for layer in layers:
            if layer in out:
                raise ValueError(f"layer spec '{spec}': layer {layer} is given twice")
            out[layer] = tau
    if "default" not in out:
        raise ValueError(f"layer spec '{spec}': no default (the tau of the layers not named)")
    return out


def parse_arm(text):
    """An arm's description: {"arm", "rule" (dense | mala | mala_layers | fi_skip), "system", "knob",
    "tau" (qwen_eval.MODE's value: None, a number or a per-layer dict), "sf"}."""
    name, _, arg = text.partition(":")
    arm = {"arm": text, "rule": None, "knob": None, "tau": None, "sf": None}
    if name == "sdpa_cudnn" and not arg:
        arm["rule"] = "dense"
    elif name == "mala" and arg.startswith("tau="):
        arm.update(rule="mala", tau=_tau_value(arg[4:], text))
        arm["knob"] = arm["tau"]
    elif name == "mala_layers" and arg:
        arm.update(rule="mala_layers", tau=parse_layer_spec(arg), knob=arg)
    elif name == "fi_skip" and arg.startswith("sf="):
        arm.update(rule="fi_skip", sf=_tau_value(arg[3:], text))
        arm["knob"] = arm["sf"]
    else:
        raise ValueError(f"arm '{text}': expected sdpa_cudnn, mala:tau=T, mala_layers:SPEC or fi_skip:sf=X")
    arm["system"] = SYSTEM[arm["rule"]]
    return arm


def parse_arms(text):
    """The arms of --arms (space-separated), the dense arm first (added when missing)."""
    arms = [parse_arm(a) for a in text.split()]
    dense = [a for a in arms if a["rule"] == "dense"][:1] or [parse_arm("sdpa_cudnn")]
    return dense + [a for a in arms if a["rule"] != "dense"]


def _suite():
    import fi_system
    import systems

    return fi_system, systems


def fi_system_for(sf, model):
    """The FlashInfer skip-softmax system at scale factor sf for this model, or systems.Unsupported
    with every reason it cannot serve the model's prefill here."""
    fi, S = _suite()
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    s = S.flashinfer_system(sf)
    why = []
    if qm.DEVICE["name"] != "cuda":
        why.append(f"FlashInfer's fmha_v2 runs on CUDA only (this run: {qm.DEVICE['name']})")
    reason = s.available()
    if reason:
        why.append(reason)
    if d != 128 and os.environ.get("MALA_BENCH_FI_KERNELS", "d128") != "all":
        why.append(f"head size {d}: fi_system builds the fmha_v2 kernels of head size 128 only "
                   f"(MALA_BENCH_FI_KERNELS=all builds the rest)")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        why.append(f"{cfg.num_attention_heads} query heads over {cfg.num_key_value_heads} KV heads")
    if why:
        raise S.Unsupported("fi_skip: " + "; ".join(why))
    return s


# ---- the attention of every layer -------------------------------------------------------------------

def _mark():
    if qm.DEVICE["name"] == "cuda":
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def recipe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (query/key/value [B, H, N, d]): a fi_skip arm's prefill through
    FlashInfer (its decode steps through qwen_measure's SDPA), every other arm through
    qwen_eval.eval_attention (MODE['tau']).  While TIMES['events'] is a list, marks each call."""
    ev = TIMES["events"]
    if ev is not None:
        ev.append(_mark())
    fi = ARM["fi"]
    if fi is None:
        out = qwen_eval.eval_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    elif query.shape[2] == key.shape[2]:
        if scaling is not None and abs(scaling * math.sqrt(query.shape[-1]) - 1.0) > 1e-6:
            raise _suite()[1].Unsupported(f"fi_skip: softmax scale {scaling} is not 1/sqrt(d)")
        o = fi.forward(*(t.transpose(1, 2) for t in (query, key, value)))  # [B, N, Hq, d]
        out = o, None
    else:
        out = qm.capture_attention(module, query, key, value, attention_mask, scaling=scaling)
    if ev is not None:
        ev.append(_mark())
    return out


def use_arm(arm, fi=None, stats=None):
    """Sets the attention for the arm: MODE['tau'] and its counters, and the FlashInfer system."""
    qwen_eval.MODE["tau"], qwen_eval.MODE["stats"] = arm["tau"], stats
    ARM["fi"] = fi


@torch.no_grad()
def measure_prefill(model, ids, reps, backend):
    """(median ms of the whole-model prefill, ms of its attention calls, the greedy next token)."""
    with qwen_e2e.sdpa_backend(backend):
        ms = qwen_e2e.timed(lambda: qwen_e2e.prefill_logits(model, ids), reps)
        TIMES["events"] = []
        try:
            nxt = int(qwen_e2e.prefill_logits(model, ids).argmax(-1))
            ev = TIMES["events"]
        finally:
            TIMES["events"] = None
    if qm.DEVICE["name"] == "cuda":
        torch.cuda.synchronize()
        attn = sum(a.elapsed_time(b) for a, b in zip(ev[::2], ev[1::2]))
    else:
        attn = 1e3 * sum(b - a for a, b in zip(ev[::2], ev[1::2]))
    return ms, attn, nxt


@torch.no_grad()
def blasst_retained(model, ids, sfs):
    """{sf: the retained fraction of FlashInfer's rule replayed (fi_system.blasst_critical) on the
    model's own Q, K over ids}, the mean over layers; one dense prefill captures them."""
    fi, _ = _suite()
    use_arm({"tau": None})
    qm.CAPTURE["on"], qm.CAPTURE["layers"] = True, {}
    try:
        qwen_e2e.prefill_logits(model, torch.tensor(ids, device=qm.DEVICE["name"]).view(1, -1))
    finally:
        qm.CAPTURE["on"] = False
    layers, qm.CAPTURE["layers"] = qm.CAPTURE["layers"], {}
    per = {sf: [] for sf in sfs}
    for li in sorted(layers):
        q, k, _ = layers.pop(li)  # [N, H, d]
        crit = fi.blasst_critical(q[None], k[None])
        for sf in sfs:
            per[sf].append(fi.retained_at(crit, sf))
    return {sf: statistics.fmean(v) for sf, v in per.items()}


# ---- selection and the peers file -------------------------------------------------------------------

def select(rows, niah_points=2.0, ppl_rel=0.005, target=1.3):
    """For each rule, the row with the largest prefill speedup over the dense row among those whose
    niah_multikey_32k >= dense's - niah_points and ppl_32k <= dense's * (1 + ppl_rel); None where
    none qualifies (or dense is missing).  "best": the fastest of those, any rule."""
    def complete(r):
        return r.get("status") == "ok" and all(r.get(k) is not None for k in ("prefill_ms", "ppl_32k",
                                                                                "niah_multikey_32k"))

    dense = next((r for r in rows if r.get("rule") == "dense" and complete(r)), None)
    out = {"criteria": {"niah_points": niah_points, "ppl_rel": ppl_rel, "target_speedup": target,
                        "against": dense["arm"] if dense else None}}
    for rule in RULES:
        best = None
        for r in rows:
            if dense is None or r.get("rule") != rule or not complete(r):
                continue
            if r["niah_multikey_32k"] < dense["niah_multikey_32k"] - niah_points:
                continue
            if r["ppl_32k"] > dense["ppl_32k"] * (1.0 + ppl_rel):
                continue
            speedup = dense["prefill_ms"] / r["prefill_ms"]
            if best is None or speedup > best["speedup"]:
                best = {"arm": r["arm"], "system": r["system"], "knob": r["knob"], "speedup": speedup,
                        "prefill_ms": r["prefill_ms"], "retained": r.get("retained"), "ppl_32k": r["ppl_32k"],
                        "niah_multikey_32k": r["niah_multikey_32k"], "meets_target": speedup >= target}
        out[rule] = best
    chosen = [out[r] for r in RULES if out[r]]
    out["best"] = max(chosen, key=lambda b: b["speedup"]) if chosen else None
    return out


def merge(result_path, peers_path):
    """Copies recipe.json's rows ("real"), selection ("real_selection") and run ("real_meta") into the
    peers file (created when absent), keeping its other keys ("synthetic", ...)."""
    with open(result_path) as f:
        doc = json.load(f)
    peers = {}
    if os.path.exists(peers_path):
        with open(peers_path) as f:
            peers = json.load(f)
    peers["real"] = doc["real"]
    peers["real_selection"] = doc["selection"]
    peers["real_meta"] = {k: doc.get(k) for k in ("device", "torch", "date", "N", "sequences", "trials",
                                                  "packages", "timed_package", "notes")}
    peers["real_meta"]["model"] = (doc.get("model") or {}).get("name")
    os.makedirs(os.path.dirname(os.path.abspath(peers_path)), exist_ok=True)
    with open(peers_path, "w") as f:
        json.dump(peers, f, indent=1)
    return peers


# ---- the study --------------------------------------------------------------------------------------

def run_arm(arm, args, model, tok, seqs, trials, ref, replay):
    """The arm's row (and its raw values in ref['raw']); ref holds the dense arm's losses and answers."""
    row = {k: arm[k] for k in ("arm", "rule", "system", "knob")}
    if arm["rule"] == "mala_layers":
        row["tau_per_layer"] = {str(k): v for k, v in arm["tau"].items()}
    fi = None
    if arm["rule"] == "fi_skip":
        ret = replay.get(arm["sf"])
        row.update(retained=ret, retained_source="rule replay (fi_system.blasst_critical)" if ret is not None
                   else replay.get("error"), decode="dense SDPA")
        fi = fi_system_for(arm["sf"], model)  # Unsupported: recorded by the caller
    ids = torch.tensor(seqs[0], device=qm.DEVICE["name"]).view(1, -1)
    use_arm(arm, fi)
    backend = "cudnn" if arm["rule"] == "dense" and qm.DEVICE["name"] == "cuda" else None
    row["prefill_ms"], row["attention_ms"], row["next_token"] = measure_prefill(model, ids, args.reps, backend)
    t = time.time()
    with torch.no_grad():
        losses, slots, retained = qwen_eval.sequence_losses(model, seqs, arm["tau"])
    ARM["fi"] = None
    if arm["rule"] in ("mala", "mala_layers"):
        row.update(retained=statistics.fmean(retained), retained_source="mala AttentionStats",
                   slots_per_query=statistics.fmean(slots), decode="mala.attention_with_kvcache")
    elif arm["rule"] == "dense":
        row.update(retained=1.0, retained_source="dense", decode="SDPA")
    row["ppl_32k"] = math.exp(statistics.fmean(losses))
    raw = {"loss": losses, "ppl_seconds": time.time() - t}
    if ref.get("loss"):
        row["ppl_rel_diff"], row["ppl_rel_diff_ci95"] = qwen_eval.rel_diff(losses, ref["loss"])
    t = time.time()
    use_arm(arm, fi, [])
    correct, outs = qwen_niah.run_trials(model, tok, trials, arm["tau"], args.new_tokens)
    ARM["fi"] = None
    row["niah_multikey_32k"] = 100.0 * sum(correct) / len(correct)
    row["niah_multikey_32k_ci95"] = list(qwen_niah.wilson(sum(correct), len(correct)))
    if ref.get("correct"):
        row["niah_disagreements"] = sum(a != b for a, b in zip(correct, ref["correct"]))
    raw.update(niah_correct=correct, niah_outputs=outs, niah_seconds=time.time() - t)
    row["status"] = "ok"
    return row, raw


def finish(res, args):
    rows = res.data["real"]
    dense = next((r for r in rows if r["rule"] == "dense" and r.get("prefill_ms")), None)
    for r in rows:
        if dense and r.get("prefill_ms"):
            r["speedup_vs_cudnn"] = dense["prefill_ms"] / r["prefill_ms"]
    res.data["selection"] = select(rows, args.niah_points, args.ppl_rel, args.target)
    res.save()


def main():
    ap = qwen_eval.parser(__doc__)
    ap.add_argument("--n", type=int, default=32768, help="tokens: prefill, perplexity and needles")
    ap.add_argument("--sequences", type=int, default=8, help="perplexity sequences (qwen_eval's corpus)")
    ap.add_argument("--trials", type=int, default=50, help="multi-key needle trials")
    ap.add_argument("--arms", default=" ".join(DEFAULT_ARMS), help="space-separated (see above)")
    ap.add_argument("--reps", type=int, default=5, help="timed prefills per arm (median)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=31, help="the needles' seed (qwen_niah's)")
    ap.add_argument("--niah-points", type=float, default=2.0)
    ap.add_argument("--ppl-rel", type=float, default=0.005)
    ap.add_argument("--target", type=float, default=1.3, help="speedup flagged as meeting the target")
    args = ap.parse_args()
    arms = parse_arms(args.arms)  # before loading the model: a bad arm fails at once
    res, tok, _, model = qwen_eval.setup(args, "recipe.json", recipe_attention)
    seqs, manifest = corpus.build(lambda s: tok.encode(s).ids, args.n, args.sequences, allow_fewer=True)
    trials = qwen_niah.make_trials(tok, qwen_niah.haystacks(tok, args.n), args.n, "multikey", args.trials,
                                   args.seed)
    res.data.update(N=args.n, sequences=len(seqs), trials=len(trials),
                    packages=[s["package"] for s in manifest["sequences"]],
                    timed_package=manifest["sequences"][0]["package"], real=[], raw={},
                    niah_trials=[t[2] | {"haystack": t[3]} for t in trials], notes=[
                        "prefill_ms: whole-model prefill, median; sdpa_cudnn timed with SDPA restricted to cuDNN",
                        "ppl_32k and niah_multikey_32k are at N tokens (the N key); dense quality: SDPA's choice",
                        "fi_skip: FlashInfer in the prefill, dense SDPA in decode; retained from its rule replayed",
                        "selection: one-sided tolerances against the dense arm (niah_points, ppl_rel)"])
    sfs = [a["sf"] for a in arms if a["rule"] == "fi_skip"]
    replay = {}
    if sfs:
        try:
            replay = blasst_retained(model, seqs[0], sfs)
        except (RuntimeError, ValueError) as e:
            replay = {"error": f"replay failed: {type(e).__name__}: {e}"[:300]}
    ref = {}
    _, S = _suite()
    for arm in arms:
        t = time.time()
        try:
            row, raw = run_arm(arm, args, model, tok, seqs, trials, ref, replay)
        except S.Unsupported as e:
            row = {k: arm[k] for k in ("arm", "rule", "system", "knob")}
            row.update(status="unsupported", reason=str(e), retained=replay.get(arm["sf"]))
            raw = {}
        except RuntimeError as e:  # a kernel that cannot run here: recorded, the next arm runs
            row = {k: arm[k] for k in ("arm", "rule", "system", "knob")}
            row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:400])
            raw = {}
        finally:
            use_arm({"tau": None})
        if arm["rule"] == "dense" and raw:
            ref.update(loss=raw["loss"], correct=raw["niah_correct"])
        row["seconds"] = time.time() - t
        res.data["real"].append(row)
        res.data["raw"][arm["arm"]] = raw
        finish(res, args)
        ret = row.get("retained")
        qm.log(f"{arm['arm']:32s} " + (f"prefill {row['prefill_ms']:.1f} ms (attention {row['attention_ms']:.1f}), "
                                       f"retained {'n/a' if ret is None else f'{ret:.3f}'}, "
                                       f"ppl {row['ppl_32k']:.4f}, niah {row['niah_multikey_32k']:.0f}%"
                                       if row["status"] == "ok" else f"{row['status']}: {row['reason']}")
               + f" ({row['seconds']:.0f} s)")
    sel = res.data["selection"]
    qm.log("selection: " + ", ".join(f"{r} {sel[r]['arm'] if sel[r] else None}" for r in RULES))
    qm.log("done")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "merge":
        merge(sys.argv[2], sys.argv[3])
        print(f"merged {sys.argv[2]} into {sys.argv[3]}")
    else:
        main()
