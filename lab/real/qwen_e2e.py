#!/usr/bin/env python3
"""Qwen2.5-Coder-1.5B end to end on one GPU: prefill latency and decode throughput, dense against
MALA (issue #31, part 3).

Prefill: the whole model on one sequence of real code (lab/real/corpus.py, the first package that
reaches the length) at each length, as a server runs it: every layer, then the logits of the last
position only.  Configurations: torch SDPA restricted to cuDNN and to flash (PyTorch's two fused
causal kernels on Hopper), MALA at tau = 0 (our dense kernels) and at each tau.  Median of --reps
after one warm-up, CUDA events; MALA's realized forward slots per query (mean over layers and
heads) from one more pass with counters.

Decode: a static KV cache (capacity = context + --new-tokens) and one decode step of the whole
model (embedding, 28 layers with RoPE, the MLPs, the last norm, lm_head, greedy argmax, the length
advanced on the device) captured in one CUDA graph, replayed --new-tokens times.  The cache holds
the model's own K and V of --batch-sized sets of real-code sequences at the context length (a dense
prefill per sequence).  Attention per configuration: mala.attention_with_kvcache appending in place
at tau = 0 (dense split-KV decode), at tau with the seeded split rule and with the per-split rule;
and torch SDPA over the whole static cache with a length mask (transformers' static-cache path, GQA
in SDPA).  Tokens/s = batch x steps / time of the replays.  Per configuration also: the tokens
generated (greedy; agreement with tau = 0 over the steps) and, from one eager step with counters,
the decode's realized slots per query and its retained fraction (mean over layers, heads, batch).

    python3 lab/real/qwen_e2e.py --gguf /tmp/mala-real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --out $OUT --lengths 8192,16384,32768 --context 32768 --batches 1,8

Writes OUT/qwen_e2e.json ("prefill": per length; "decode": per batch).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import corpus  # noqa: E402
import qwen_eval  # noqa: E402
import qwen_measure as qm  # noqa: E402


# ---- prefill ---------------------------------------------------------------------------------------

@torch.no_grad()
def prefill_logits(model, ids):
    """Serving's prefill: every layer over ids [B, N], logits of the last position [B, vocab]."""
    h = model.model(input_ids=ids).last_hidden_state
    return model.lm_head(h[:, -1])


def sdpa_backend(name):
    """A context restricting torch SDPA to one backend ('cudnn', 'flash'), or none."""
    from contextlib import nullcontext

    if name is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[name]])


def elapsed_ms(fn):
    """Milliseconds of one fn() (CUDA events on the GPU, the wall clock on the CPU)."""
    if qm.DEVICE["name"] == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def timed(fn, reps):
    """Median milliseconds of fn() over reps runs after one warm-up."""
    fn()
    return statistics.median(elapsed_ms(fn) for _ in range(reps))


def run_prefill(args, res, tok, model, taus):
    configs = [("sdpa_cudnn", None, "cudnn"), ("sdpa_flash", None, "flash")] if args.device == "cuda" else \
        [("sdpa", None, None)]
    configs += [(f"mala_tau{t:g}", t, None) for t in [0.0] + [t for t in taus if t != 0]]
    out = res.data.setdefault("prefill", {})
    for n in args.lengths:
        seqs, manifest = corpus.build(lambda s: tok.encode(s).ids, n, 1)
        ids = torch.tensor(seqs[0], device=qm.DEVICE["name"]).view(1, -1)
        rec = out.setdefault(str(n), {"package": manifest["sequences"][0]["package"], "ms": {}, "slots_per_query": {}})
        first = {}
        for name, tau, backend in configs:
            qwen_eval.MODE["tau"], qwen_eval.MODE["stats"] = tau, None
            try:
                with sdpa_backend(backend):
                    rec["ms"][name] = timed(lambda: prefill_logits(model, ids), args.reps)
                    first[name] = int(prefill_logits(model, ids).argmax(-1))
            except RuntimeError as e:  # a backend torch cannot run here
                rec["ms"][name] = None
                rec.setdefault("errors", {})[name] = str(e)[:300]
                continue
            if tau is not None:
                qwen_eval.MODE["stats"] = []
                prefill_logits(model, ids)
                rec["slots_per_query"][name] = statistics.fmean(s.mean_fwd_slots for s in qwen_eval.MODE["stats"])
        rec["dense_slots_per_query"] = (n + 1) / 2
        rec["next_token"] = first
        qm.log(f"prefill {n}: ms " + ", ".join(f"{k} {v:.1f}" for k, v in rec["ms"].items() if v)
               + "; slots/query " + ", ".join(f"{k} {v:.0f}" for k, v in rec["slots_per_query"].items()))
        res.save()


# ---- decode ----------------------------------------------------------------------------------------

class StaticDecoder:
    """One greedy decode step of the whole model against a static per-layer KV cache
    [B, capacity, Hkv, d] (the layout of flash_attn_with_kvcache), with the lengths on the device, so
    that the step can be captured in a CUDA graph and replayed.  attention: ('mala', tau, split_rule)
    or ('sdpa', None, None)."""

    def __init__(self, model, caches, lengths, first_ids, attention):
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

        self.rope = apply_rotary_pos_emb
        self.model, self.attention = model, attention
        self.k, self.v = caches
        self.capacity = self.k[0].shape[1]
        dev = self.k[0].device
        self.seqlens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        self.ids = first_ids.clone().view(-1, 1)
        self.positions = torch.arange(self.capacity, device=dev)
        self.stats = None  # a list while one eager step collects counters

    def attend(self, li, q, k, v):
        """q [B, 1, Hq, d], k/v [B, 1, Hkv, d]: append k/v at seqlens, attend over seqlens + 1 keys."""
        import mala

        kind, tau, rule = self.attention
        if kind == "mala":
            if self.stats is not None:
                o, st = mala.attention_with_kvcache(q, self.k[li], self.v[li], self.seqlens, k=k, v=v, tau=tau,
                                                    split_rule=rule, return_stats=True)
                self.stats.append(st)
                return o
            return mala.attention_with_kvcache(q, self.k[li], self.v[li], self.seqlens, k=k, v=v, tau=tau,
                                               split_rule=rule)
        b, _, hkv, d = k.shape
        at = self.seqlens.long().view(b, 1, 1, 1).expand(b, 1, hkv, d)
        self.k[li].scatter_(1, at, k)
        self.v[li].scatter_(1, at, v)
        mask = (self.positions[None, :] <= self.seqlens[:, None]).view(b, 1, 1, self.capacity)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), self.k[li].transpose(1, 2), self.v[li].transpose(1, 2),
                                           attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2)

    @torch.no_grad()
    def step(self):
        m = self.model.model
        h = m.embed_tokens(self.ids)
        b = h.shape[0]
        cos, sin = m.rotary_emb(h, self.seqlens.long().view(b, 1))
        for li, layer in enumerate(m.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            d = a.head_dim
            q = a.q_proj(x).view(b, 1, -1, d).transpose(1, 2)
            k = a.k_proj(x).view(b, 1, -1, d).transpose(1, 2)
            v = a.v_proj(x).view(b, 1, -1, d)
            q, k = self.rope(q, k, cos, sin)
            o = self.attend(li, q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.contiguous())
            h = h + a.o_proj(o.reshape(b, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(m.norm(h))
        self.ids.copy_(logits.argmax(-1))
        self.seqlens.add_(1)
        return logits


@torch.no_grad()
def fill_caches(model, seqs, context, capacity):
    """Per layer K, V [B, capacity, Hkv, d] holding each sequence's first `context` tokens (a dense
    prefill per sequence, qwen_measure's capture), and the greedy next token of each [B]."""
    cfg = model.config
    b = len(seqs)
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    kw = dict(device=qm.DEVICE["name"], dtype=qm.DEVICE["dtype"])
    ks = [torch.zeros(b, capacity, hkv, d, **kw) for _ in range(cfg.num_hidden_layers)]
    vs = [torch.zeros(b, capacity, hkv, d, **kw) for _ in range(cfg.num_hidden_layers)]
    first = []
    qwen_eval.MODE["tau"] = None
    for i, s in enumerate(seqs):
        qm.CAPTURE["on"], qm.CAPTURE["layers"] = True, {}
        logits = prefill_logits(model, torch.tensor(s[:context], device=kw["device"]).view(1, -1))
        qm.CAPTURE["on"] = False
        for li, (_, k, v) in qm.CAPTURE["layers"].items():  # [N, H, d]
            ks[li][i, :context] = k
            vs[li][i, :context] = v
        qm.CAPTURE["layers"] = {}
        first.append(int(logits.argmax(-1)))
    return (ks, vs), torch.tensor(first, device=kw["device"])


def graph_of(fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def decode_config(model, caches, context, first, attention, steps, graphs):
    """Greedy tokens [B, steps] and ms of the `steps` steps (graph replays on CUDA), plus the realized
    decode work of the first step: (tokens, ms, slots per query, retained fraction or None)."""
    dec = StaticDecoder(model, caches, [context] * len(first), first, attention)
    slots = retained = None
    if attention[0] == "mala":  # one eager step with counters, then reset
        dec.stats = []
        dec.step()
        slots = statistics.fmean(s.mean_fwd_slots for s in dec.stats)
        retained = statistics.fmean(s.fwd_retained_fraction for s in dec.stats)
        dec.stats = None
    run = graph_of(dec.step).replay if graphs else dec.step
    tokens = []
    dec.seqlens.fill_(context)
    dec.ids.copy_(first.view(-1, 1))
    for _ in range(steps):
        tokens.append(dec.ids[:, 0].clone())
        run()
    dec.seqlens.fill_(context)
    dec.ids.copy_(first.view(-1, 1))
    if qm.DEVICE["name"] == "cuda":
        torch.cuda.synchronize()

    def all_steps():
        for _ in range(steps):
            run()

    return torch.stack(tokens, 1), elapsed_ms(all_steps), slots, retained


def run_decode(args, res, tok, model, taus):
    seqs, manifest = corpus.build(lambda s: tok.encode(s).ids, args.context, max(args.batches),
                                  allow_fewer=True)
    configs = [("mala_tau0", ("mala", 0.0, "seeded"))]
    for t in taus:
        if t != 0:
            configs += [(f"mala_tau{t:g}_seeded", ("mala", t, "seeded")),
                        (f"mala_tau{t:g}_per_split", ("mala", t, "per_split"))]
    configs.append(("sdpa_static", ("sdpa", None, None)))
    graphs = qm.DEVICE["name"] == "cuda"
    out = res.data.setdefault("decode", {})
    for batch in args.batches:
        chosen = [seqs[i % len(seqs)] for i in range(batch)]
        caches, first = fill_caches(model, chosen, args.context, args.context + args.new_tokens)
        rec = out.setdefault(str(batch), {"context": args.context, "steps": args.new_tokens, "graphs": graphs,
                                          "packages": [manifest["sequences"][i % len(seqs)]["package"]
                                                       for i in range(batch)]})
        ref = None
        for name, attention in configs:
            try:
                tokens, ms, slots, retained = decode_config(model, caches, args.context, first, attention,
                                                            args.new_tokens, graphs)
            except RuntimeError as e:
                rec.setdefault("errors", {})[name] = str(e)[:300]
                continue
            if ref is None:
                ref = tokens
            same = (tokens == ref).all(0).float()
            agree = int(same.numel() if bool(same.all()) else int(same.argmin()))
            rec[name] = {"ms_per_step": ms / args.new_tokens, "tokens_per_s": batch * args.new_tokens / (ms / 1e3),
                         "slots_per_query": slots, "retained": retained,
                         "steps_equal_to_tau0": agree, "tokens": tokens.tolist()}
            qm.log(f"decode batch {batch}, context {args.context}: {name:22s} {ms / args.new_tokens:7.3f} ms/step "
                   f"{rec[name]['tokens_per_s']:8.1f} tok/s" + (f", slots/query {slots:.0f}, retained {retained:.3f}"
                                                                if slots is not None else "")
                   + f", first {agree} steps equal to tau = 0")
            res.save()
        rec["dense_slots_per_query"] = args.context + 1
        del caches
        if qm.DEVICE["name"] == "cuda":
            torch.cuda.empty_cache()


def main():
    ap = qwen_eval.parser(__doc__)
    ap.add_argument("--lengths", default="8192,16384,32768", help="prefill lengths ('' = none)")
    ap.add_argument("--context", type=int, default=32768, help="decode: tokens in the cache")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes ('' = no decode)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps")
    ap.add_argument("--taus", default="1")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.batches = [int(x) for x in args.batches.split(",") if x]
    taus = [float(t) for t in args.taus.split(",")]
    res, tok, _, model = qwen_eval.setup(args, "qwen_e2e.json", qwen_eval.eval_attention)
    if args.lengths:
        run_prefill(args, res, tok, model, taus)
    if args.batches:
        run_decode(args, res, tok, model, taus)
    qm.log("done")


if __name__ == "__main__":
    main()
