#!/usr/bin/env python3
"""Qwen2.5-Coder-1.5B on the GPU: model checks, attention states, MALA's work and fidelity on them,
and speed against our tau = 0 and cuDNN (docs/real.md has the commands and the results).

Steps (each writes into OUT/qwen_raw.json as soon as it ends, so a cut-off run keeps what it did):
  load     GGUF -> transformers Qwen2ForCausalLM (bf16, CUDA); the weights are cached in WORK as a
           torch file so that a second call skips the dequantization
  check    numpy reference forward (lab/real/gguf_qwen2.py, fp32) against the torch model on a short
           prefix; rotary frequencies; greedy continuations
  states   per sequence: one forward at the longest length capturing every layer's Q, K (after RoPE)
           and V (next-token loss from the same pass); at every length (a prefix of those states),
           for every layer: MALA forward + backward at tau and at 0 with a fixed random dO probe ->
           per-head slots, retained tiles, omitted mass, relative errors of O, dQ, dK, dV; at the
           longest length also the tau sweep
  speed    sequence 0, every layer and length: forward and backward of MALA tau, MALA 0 and cuDNN SDPA
           (lab/suite's systems and timer: L2 flushed, median of >= 20)
  decode   the real caches at the longest length, whole model (every layer in one CUDA graph),
           batch 1 and 8: MALA tau, MALA 0, SDPA flash; realized slots and omitted mass
  save     sequence 0's states as float16 .npy (WORK/states/layerLL_{q,k,v}.npy, the layout that
           `mala_bench --real` and `lab/suite/run.py --real` read)

    python3 lab/real/qwen_measure.py --gguf /tmp/mala-real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --out $OUT --work /tmp/mala-real/work
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "lab", "suite"))

import corpus  # noqa: E402
import gguf_qwen2  # noqa: E402
from fidelity import layer_metrics  # noqa: E402

T0 = time.time()
DEVICE = {"name": "cuda", "dtype": torch.bfloat16}  # --device cpu: float32, for the smoke test


def log(msg):
    print(f"[qwen {time.time() - T0:6.1f}s] {msg}", flush=True)


class Results:
    def __init__(self, path):
        self.path = path
        self.data = {}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, separators=(",", ":"))
        os.replace(tmp, self.path)


# ---- the model -------------------------------------------------------------------------------------

CAPTURE = {"on": False, "layers": {}}


def capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: SDPA (causal, bottom-right when Nq < Nk), and while
    CAPTURE['on'] a copy of Q, K after RoPE and V as [N, H, d]."""
    if CAPTURE["on"]:
        CAPTURE["layers"][module.layer_idx] = tuple(t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    nq, nk = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if nq == nk:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    elif nq == 1:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=False, scale=scaling, enable_gqa=gqa)
    else:
        rows = torch.arange(nq, device=query.device)[:, None] + (nk - nq)
        mask = torch.arange(nk, device=query.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def hf_config(cfg: gguf_qwen2.Qwen2Config):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings, use_sliding_window=False,
        hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)


def build_model(cfg, state, device):
    from transformers import AttentionInterface, Qwen2ForCausalLM

    AttentionInterface.register("mala_capture", capture_attention)
    hc = hf_config(cfg)
    hc._attn_implementation = "mala_capture"
    with torch.device("meta"):
        model = Qwen2ForCausalLM(hc)
    model.load_state_dict(state, strict=True, assign=True)
    # The rotary frequencies are a buffer, not a weight: built here (in float64, then float32 as
    # transformers keeps them) since the meta-device construction left them without data.
    rot = model.model.rotary_emb
    d = cfg.head_dim
    inv = torch.from_numpy(gguf_qwen2.rope_inv_freq(cfg.rope_theta, d)).float()
    rot.register_buffer("inv_freq", inv, persistent=False)
    if hasattr(rot, "original_inv_freq"):
        rot.original_inv_freq = inv.clone()
    left = [n for n, b in model.named_buffers() if b.is_meta] + [n for n, p_ in model.named_parameters() if p_.is_meta]
    if left:
        raise RuntimeError(f"build_model: tensors without data: {left[:5]}")
    model = model.to(device=device, dtype=DEVICE["dtype"]).eval()
    # .to(dtype) casts buffers too: a bfloat16 inv_freq is off by up to 2^-9 relative, which turns
    # into radians of phase error thousands of positions apart; transformers keeps it float32.
    rot.inv_freq = inv.to(device)
    if hasattr(rot, "original_inv_freq"):
        rot.original_inv_freq = inv.to(device)
    return model


def load_model(args, res, device):
    cache = os.path.join(args.work, f"qwen_{str(DEVICE['dtype']).split('.')[-1]}.pt")
    ref = None
    t = time.time()
    desc = gguf_qwen2.describe(args.gguf)
    cfg = gguf_qwen2.Qwen2Config(**desc["config"])
    if os.path.exists(cache):
        state = torch.load(cache, map_location="cpu", mmap=True)
        log(f"load: weights from {cache} ({time.time() - t:.1f} s)")
    else:
        cfg, weights = gguf_qwen2.load(args.gguf, threads=os.cpu_count())
        log(f"load: {len(weights)} tensors dequantized from the GGUF ({time.time() - t:.1f} s)")
        ref = gguf_qwen2.ReferenceQwen2(cfg, weights)
        state = {k: torch.from_numpy(v).to(DEVICE["dtype"]) for k, v in weights.items()}
        os.makedirs(args.work, exist_ok=True)
        torch.save(state, cache)
    model = build_model(cfg, state, device)
    del state
    gc.collect()
    res.data["model"] = {"name": desc["name"], "file": os.path.basename(args.gguf), "config": desc["config"],
                         "tensor_count": desc["tensor_count"], "file_type": desc["file_type"],
                         "quantization": sorted({t["type"] for t in desc["tensors"]}),
                         "gguf_bytes": os.path.getsize(args.gguf)}
    log(f"load: model on {device} ({time.time() - t:.1f} s)")
    return cfg, model, ref


# ---- checks ----------------------------------------------------------------------------------------

@torch.no_grad()
def token_losses(model, ids, chunk=2048):
    """Per-position next-token loss (nats) [N - 1] of one sequence, from one forward (capturing)."""
    x = torch.tensor(ids, device=DEVICE["name"]).view(1, -1)
    hidden = model.model(input_ids=x).last_hidden_state[0]
    out = []
    for s in range(0, hidden.shape[0] - 1, chunk):
        e = min(s + chunk, hidden.shape[0] - 1)
        logits = model.lm_head(hidden[s:e]).float()
        out.append(F.cross_entropy(logits, x[0, s + 1:e + 1], reduction="none"))
    return torch.cat(out)


@torch.no_grad()
def greedy(model, tok, ids, n_new):
    x = torch.tensor(ids, device=DEVICE["name"]).view(1, -1)
    y = model.generate(x, max_new_tokens=n_new, do_sample=False, pad_token_id=tok.token_to_id("<|endoftext|>"))
    return tok.decode(y[0, len(ids):].tolist())


def step_check(args, res, cfg, model, ref, tok, seqs):
    chk = {}
    rot = model.model.rotary_emb.inv_freq.double().cpu()
    want = torch.from_numpy(gguf_qwen2.rope_inv_freq(cfg.rope_theta, cfg.head_dim))
    chk["rope_inv_freq_max_rel_err"] = float(((rot - want).abs() / want).max())
    if chk["rope_inv_freq_max_rel_err"] > 1e-6:
        raise RuntimeError(f"check: rotary frequencies off by {chk['rope_inv_freq_max_rel_err']:.3g} (relative)")
    if ref is not None:
        ids = seqs[0][:64]
        lg_ref = ref.logits(ids)
        with torch.no_grad():
            lg = model(input_ids=torch.tensor(ids, device=DEVICE["name"]).view(1, -1)).logits[0].float().cpu().numpy()
        chk["reference_tokens"] = len(ids)
        chk["reference_loss_numpy_fp32"] = gguf_qwen2.next_token_loss(lg_ref, ids)
        chk["reference_loss_torch"] = gguf_qwen2.next_token_loss(lg, ids)
        chk["reference_top1_agreement"] = float(np.mean(lg_ref.argmax(-1) == lg.argmax(-1)))
        chk["reference_logit_corr"] = float(np.corrcoef(lg_ref.ravel(), lg.ravel())[0, 1])
        log(f"check: numpy fp32 loss {chk['reference_loss_numpy_fp32']:.4f}, torch ({DEVICE['dtype']}) "
            f"{chk['reference_loss_torch']:.4f}, top-1 agreement {chk['reference_top1_agreement']:.3f}, "
            f"logit correlation {chk['reference_logit_corr']:.5f}")
    prompts = [("code prompt", tok.encode("# Python 3\ndef fibonacci(n):\n").ids),
               (f"first {args.greedy_context} tokens of sequence 0", seqs[0][:args.greedy_context])]
    chk["greedy"] = []
    for name, p in prompts:
        text = greedy(model, tok, p, args.greedy_tokens)
        chk["greedy"].append({"prompt": name, "prompt_tail": tok.decode(p[-24:]), "continuation": text})
        log(f"check: greedy after {name}: {text!r}")
    res.data["checks"] = chk
    res.save()


# ---- states: work and fidelity per layer -----------------------------------------------------------

def capture(model, ids):
    CAPTURE["layers"] = {}
    CAPTURE["on"] = True
    try:
        losses = token_losses(model, ids)
    finally:
        CAPTURE["on"] = False
    layers = [CAPTURE["layers"][i] for i in range(len(CAPTURE["layers"]))]
    CAPTURE["layers"] = {}
    return layers, losses


def step_states(args, res, model, seqs, mala, keep_for_decode, deadline):
    st = res.data.setdefault("states", {"lengths": {}, "sweep": {}, "loss": {}})
    lengths, nmax = args.lengths, max(args.lengths)
    for s, ids in enumerate(seqs):
        if time.time() > deadline:
            log(f"states: stopped before sequence {s} at the deadline")
            break
        t = time.time()
        layers, losses = capture(model, ids[:nmax])
        lo = losses.double().cpu()
        for n in lengths:
            rec = st["loss"].setdefault(str(n), {"mean": [], "last_half": []})
            rec["mean"].append(float(lo[: n - 1].mean()))
            rec["last_half"].append(float(lo[n // 2 - 1: n - 1].mean()))
        log(f"states: sequence {s} captured ({time.time() - t:.1f} s), loss "
            + ", ".join(f"{n}: {st['loss'][str(n)]['mean'][-1]:.3f}" for n in lengths))
        keep_for_decode.append([(k.clone(), v.clone(), q[-1:].clone()) for q, k, v in layers])
        gen = torch.Generator(device=DEVICE["name"]).manual_seed(1000 + s)
        for n in lengths:
            taus = [args.tau] + ([t_ for t_ in args.sweep if t_ != args.tau] if n == nmax else [])
            rec = st["lengths"].setdefault(str(n), {})
            sweep = st["sweep"].setdefault(str(n), {}) if n == nmax else None
            t = time.time()
            per_tau = {}
            for li, (q, k, v) in enumerate(layers):
                qq, kk, vv = (x[:n].unsqueeze(0) for x in (q, k, v))
                dout = torch.randn(qq.shape, generator=gen, device=DEVICE["name"], dtype=torch.float32).to(qq.dtype)
                m, tiles = layer_metrics(mala, qq, kk, vv, dout, taus)
                for tau, vals in m.items():
                    per_tau.setdefault(tau, {k_: [] for k_ in vals})
                    for k_, x_ in vals.items():
                        per_tau[tau][k_].append(x_)
            st["tiles"] = tiles
            for tau, vals in per_tau.items():  # [sequence][layer][head]; tau also in the sweep
                dsts = ([rec] if tau == args.tau else []) + ([sweep.setdefault(f"{tau:g}", {})] if sweep is not None else [])
                for dst in dsts:
                    for k_, x_ in vals.items():
                        dst.setdefault(k_, []).append(x_)
            fr = np.mean(per_tau[args.tau]["fwd_retained"])
            fs = np.mean(per_tau[args.tau]["fwd_slots"])
            oe = np.mean(per_tau[args.tau]["o_err"])
            de = np.mean(per_tau[args.tau]["dq_err"])
            log(f"states: seq {s} N={n}: fwd retained {fr:.3f}, fwd slots {fs:.0f}, O err {oe:.4f}, "
                f"dQ err {de:.4f} ({time.time() - t:.1f} s, taus {taus})")
        if s == 0:
            args._seq0 = layers  # the speed and save steps use sequence 0's states
        del layers
        st["sequences_done"] = s + 1
        res.save()
        gc.collect()
        torch.cuda.empty_cache()


# ---- speed -----------------------------------------------------------------------------------------

def step_speed(args, res, layers, deadline):
    import systems
    import timing

    syss = [systems.Mala(args.tau), systems.Mala(0.0), systems.SDPA("cudnn"), systems.Mala(args.tau, deterministic=True)]
    for sysm in syss:
        why = sysm.available()  # also imports mala into the suite's registry
        if why:
            raise RuntimeError(f"speed: {sysm.name} unavailable: {why}")
    names = {syss[0].name: "mala_tau1" if args.tau == 1.0 else f"mala_tau{args.tau:g}", syss[1].name: "mala_tau0",
             syss[2].name: "cudnn"}
    names[syss[3].name] = names[syss[0].name] + "_det"  # the backward's deterministic mode
    sp = res.data.setdefault("speed", {})
    gen = torch.Generator(device=DEVICE["name"]).manual_seed(7)
    for n in args.lengths:
        # fwd_ms: inference (no grad); fwd_grad_ms: the forward of a call that will be differentiated
        # (MALA's then records its tile mask for the backward); bwd_ms: the backward alone.
        rec = sp.setdefault(str(n), {v: {"fwd_ms": [], "fwd_grad_ms": [], "bwd_ms": []} for v in names.values()})
        t = time.time()
        for li, (q, k, v) in enumerate(layers):
            if time.time() > deadline:
                log(f"speed: stopped at N={n} layer {li} at the deadline")
                res.save()
                return
            qq, kk, vv = (x[:n].unsqueeze(0) for x in (q, k, v))
            dout = torch.randn(qq.shape, generator=gen, device=DEVICE["name"], dtype=torch.float32).to(qq.dtype)
            for sysm in syss:
                p = sysm.prepare(qq, kk, vv, dout)
                f = timing.measure(p.fwd, min_reps=args.reps, max_reps=args.reps + 10, target_s=0.2)
                fg = timing.measure(p.make_graph, min_reps=args.reps, max_reps=args.reps + 10, target_s=0.2)
                b = timing.measure(p.bwd, setup=p.make_graph, min_reps=args.reps, max_reps=args.reps + 10,
                                   target_s=0.2)
                rec[names[sysm.name]]["fwd_ms"].append(f["ms"])
                rec[names[sysm.name]]["fwd_grad_ms"].append(fg["ms"])
                rec[names[sysm.name]]["bwd_ms"].append(b["ms"])
                del p
            torch.cuda.empty_cache()
        tot = {k_: (sum(v_["fwd_ms"]), sum(v_["fwd_grad_ms"]), sum(v_["bwd_ms"])) for k_, v_ in rec.items()}
        log(f"speed N={n} ({time.time() - t:.1f} s), whole model fwd / fwd with grad / bwd ms: "
            + ", ".join(f"{k_} {a:.2f} / {g:.2f} / {b:.2f}" for k_, (a, g, b) in tot.items()))
        res.save()


# ---- decode ----------------------------------------------------------------------------------------

def graph_time(calls, reps=50):
    """Median ms of one replay of a CUDA graph that makes every call in `calls` once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return float(np.median(times))


def step_decode(args, res, mala, caches):
    """caches[s][layer] = (k [N, Hkv, d], v, q_last [1, Hq, d]) at the longest length."""
    dec = res.data.setdefault("decode", {})
    n_layers = len(caches[0])
    for batch in args.decode_batches:
        seq_of = [b % len(caches) for b in range(batch)]
        per_layer = []
        for li in range(n_layers):
            k = torch.stack([caches[s][li][0] for s in seq_of])
            v = torch.stack([caches[s][li][1] for s in seq_of])
            q = torch.stack([caches[s][li][2] for s in seq_of])  # [B, 1, Hq, d]
            per_layer.append((q, k, v))
        n = per_layer[0][1].shape[1]
        seqlens = torch.full((batch,), n, dtype=torch.int32, device=DEVICE["name"])
        rec = {"batch": batch, "cache_len": n, "sequences": seq_of}
        # realized work and omitted mass at tau, per layer
        slots, retained, omitted, o_err, splits = [], [], [], [], None
        for q, k, v in per_layer:
            o1, lse1, st = mala.attention_with_kvcache(q, k, v, seqlens, tau=args.tau, return_lse=True,
                                                       return_stats=True)
            o0, lse0 = mala.attention_with_kvcache(q, k, v, seqlens, tau=0.0, return_lse=True)
            slots.append(st.mean_fwd_slots)
            retained.append(st.fwd_retained_fraction)
            splits = st.num_splits
            omitted.append(float((1 - torch.exp(lse1.double() - lse0.double())).clamp_min(0).mean()))
            o_err.append(float((o1.float() - o0.float()).norm() / o0.float().norm()))
        rec.update(fwd_slots=slots, fwd_retained=retained, omitted_mean=omitted, o_err=o_err, num_splits=splits,
                   block_k=st.fwd_block_k)
        calls = {
            "mala_tau1": [lambda q=q, k=k, v=v: mala.attention_with_kvcache(q, k, v, seqlens, tau=args.tau,
                                                                             check_inputs=False)
                          for q, k, v in per_layer],
            "mala_tau0": [lambda q=q, k=k, v=v: mala.attention_with_kvcache(q, k, v, seqlens, tau=0.0,
                                                                             check_inputs=False)
                          for q, k, v in per_layer],
        }
        flash = []
        for q, k, v in per_layer:
            qs, ks, vs = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

            def f(qs=qs, ks=ks, vs=vs):
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=False, enable_gqa=True)
            flash.append(f)
        calls["sdpa_flash"] = flash
        rec["whole_model_us"] = {}
        for name, cl in calls.items():
            try:
                rec["whole_model_us"][name] = 1e3 * graph_time(cl)
            except Exception as e:  # noqa: BLE001
                rec["whole_model_us"][name] = None
                rec.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
        dec[str(batch)] = rec
        log(f"decode batch {batch}, cache {n}: whole model (28 layers) us "
            + ", ".join(f"{k_} {v_:.1f}" if v_ else f"{k_} failed" for k_, v_ in rec["whole_model_us"].items())
            + f"; tau={args.tau:g} retained {np.mean(retained):.3f}, slots {np.mean(slots):.0f}, splits {splits}")
        res.save()
        del per_layer
        torch.cuda.empty_cache()


def step_save(args, layers):
    d = os.path.join(args.work, "states")
    os.makedirs(d, exist_ok=True)
    for li, (q, k, v) in enumerate(layers):
        for name, x in (("q", q), ("k", k), ("v", v)):
            a = x.float()
            big = float(a.abs().max())
            if big >= 65504:
                raise ValueError(f"layer {li} {name}: |x| max {big} does not fit float16")
            np.save(os.path.join(d, f"layer{li:02d}_{name}.npy"), a.half().cpu().numpy())
    log(f"save: {len(layers)} layers of sequence 0 as float16 .npy in {d}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/mala-real/work")
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--sweep", default="0.25,0.5,1,2,4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode-batches", default="1,8")
    ap.add_argument("--greedy-tokens", type=int, default=40)
    ap.add_argument("--greedy-context", type=int, default=8192)
    ap.add_argument("--steps", default="load,check,states,speed,decode,save")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="stop starting work after this many seconds")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: float32, no speed or decode")
    ap.add_argument("--mala-commit", default=os.environ.get("MALA_COMMIT", "?"))
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.sweep = [float(x) for x in args.sweep.split(",")]
    args.decode_batches = [int(x) for x in args.decode_batches.split(",")]
    steps = args.steps.split(",")
    deadline = T0 + args.deadline_s
    os.makedirs(args.out, exist_ok=True)
    res = Results(os.path.join(args.out, "qwen_raw.json"))
    import mala

    DEVICE["name"] = args.device
    DEVICE["dtype"] = torch.bfloat16 if args.device == "cuda" else torch.float32
    res.data["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    res.data["torch"] = torch.__version__
    res.data["mala_commit"] = args.mala_commit
    res.data["mala_file"] = mala.__file__
    res.data["date"] = time.strftime("%Y-%m-%d")
    res.data["args"] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    try:
        res.data["cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
        pass
    tok = gguf_qwen2.tokenizer(args.gguf)
    seqs, manifest = corpus.build(lambda s: tok.encode(s).ids, max(args.lengths), args.sequences)
    res.data["text"] = manifest
    log(f"text: {len(seqs)} sequences of {max(args.lengths)} tokens from "
        + ", ".join(m["package"] for m in manifest["sequences"]) + f" (Python {manifest['python']})")
    res.save()
    cfg, model, ref = load_model(args, res, args.device)
    if "check" in steps:
        step_check(args, res, cfg, model, ref, tok, seqs)
    del ref
    gc.collect()
    caches = []
    args._seq0 = None
    if "states" in steps:
        step_states(args, res, model, seqs, mala, caches, deadline)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    timings = res.data.setdefault("step_end_s", {})
    timings["states"] = time.time() - T0
    if args.device == "cpu":
        steps = [x for x in steps if x not in ("speed", "decode")]
    if "speed" in steps and args._seq0 is not None:
        step_speed(args, res, args._seq0, deadline)
        timings["speed"] = time.time() - T0
    if "decode" in steps and caches and time.time() < deadline + 30:
        step_decode(args, res, mala, caches)
        timings["decode"] = time.time() - T0
    if "save" in steps and args._seq0 is not None:
        step_save(args, args._seq0)
    res.save()
    log("done")


if __name__ == "__main__":
    main()
