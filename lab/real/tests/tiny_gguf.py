"""A tiny Qwen2 GGUF written with gguf's own writer: the architecture keys of the real model, random
weights, a byte-level BPE vocabulary (256 byte tokens, a few merges, the chat specials)."""

from __future__ import annotations

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("d", "e"), ("de", "f"), ("Ġ", "x"), ("i", "n"), ("in", "t")]


def byte_tokens():
    """GPT-2's printable stand-ins for the 256 bytes (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def config(**kw):
    c = dict(layers=2, hidden=64, ff=96, heads=4, heads_kv=2, ctx=512, theta=10000.0, eps=1e-6, tied=False)
    c.update(kw)
    return c


def weights(c, vocab, seed=0):
    """{gguf name: float32 array in transformers' [out, in] orientation}."""
    rng = np.random.default_rng(seed)
    hd = c["hidden"] // c["heads"]
    kv = c["heads_kv"] * hd
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    w = {"token_embd.weight": r(vocab, c["hidden"]), "output_norm.weight": 1 + r(c["hidden"])}
    if not c["tied"]:
        w["output.weight"] = r(vocab, c["hidden"])
    for i in range(c["layers"]):
        p = f"blk.{i}."
        w.update({p + "attn_norm.weight": 1 + r(c["hidden"]), p + "ffn_norm.weight": 1 + r(c["hidden"]),
                  p + "attn_q.weight": r(c["hidden"], c["hidden"]), p + "attn_q.bias": r(c["hidden"]),
                  p + "attn_k.weight": r(kv, c["hidden"]), p + "attn_k.bias": r(kv),
                  p + "attn_v.weight": r(kv, c["hidden"]), p + "attn_v.bias": r(kv),
                  p + "attn_output.weight": r(c["hidden"], c["hidden"]),
                  p + "ffn_gate.weight": r(c["ff"], c["hidden"]), p + "ffn_up.weight": r(c["ff"], c["hidden"]),
                  p + "ffn_down.weight": r(c["hidden"], c["ff"])})
    return w


def write(path, c=None, drop=(), arch="qwen2", q8=("blk.0.ffn_up.weight",), seed=0):
    """Writes the GGUF; returns (config, {gguf name: the float32 array written})."""
    import gguf

    c = c or config()
    tokens = byte_tokens() + ["".join(m) for m in MERGES] + SPECIALS
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    w = weights(c, len(tokens), seed)
    wr = gguf.GGUFWriter(path, arch)
    wr.add_block_count(c["layers"])
    wr.add_context_length(c["ctx"])
    wr.add_embedding_length(c["hidden"])
    wr.add_feed_forward_length(c["ff"])
    wr.add_head_count(c["heads"])
    wr.add_head_count_kv(c["heads_kv"])
    wr.add_rope_freq_base(c["theta"])
    wr.add_layer_norm_rms_eps(c["eps"])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("qwen2")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges([" ".join(m) for m in MERGES])
    wr.add_bos_token_id(len(tokens) - 3)
    wr.add_eos_token_id(len(tokens) - 1)
    for name, a in w.items():
        if name in drop:
            continue
        if name in q8:
            qa = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            wr.add_tensor(name, qa, raw_shape=qa.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            wr.add_tensor(name, a)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return c, w
