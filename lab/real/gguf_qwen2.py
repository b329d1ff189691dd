"""Qwen2 from a GGUF file: configuration, weights under transformers' names, tokenizer, and a numpy
reference forward.  Needs only numpy, gguf and tokenizers (pinned in lab/real/requirements.txt),
so CI tests it on a tiny GGUF that the test writes itself (lab/real/tests/test_gguf_qwen2.py).

The `real` regime's model is Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (docs/real.md).  llama.cpp's
converter stores Qwen2's projections unpermuted (it runs Qwen2 with NEOX-style rotary embedding, the
rotate-half form transformers uses), so a GGUF tensor of shape (ne0, ne1) is transformers' weight of
shape [ne1, ne0] as it is: no row permutation, unlike the llama architecture.

    cfg, weights = load("model.gguf")            # weights: {hf_name: float32 ndarray}
    tok = tokenizer("model.gguf")                # tokenizers.Tokenizer (byte-level BPE)
    logits = ReferenceQwen2(cfg, weights).logits(ids)
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import asdict, dataclass

import numpy as np

ARCH = "qwen2"

# The Qwen2 pre-tokenizer split (llama.cpp's "qwen2" pre-tokenizer; transformers' Qwen2Tokenizer).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# GGUF per-block tensor name -> transformers' Qwen2 name (model.layers.{i}.<this>).
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class Qwen2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self):
        return asdict(self)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"GGUF: missing metadata key '{key}'")
        return default
    return f.contents()


def hf_name(gguf_name: str) -> str:
    """transformers' Qwen2 parameter name of a GGUF tensor (KeyError for an unknown one)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}"
    raise KeyError(f"GGUF tensor '{gguf_name}' has no Qwen2 counterpart")


def read_config(reader) -> Qwen2Config:
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise ValueError(f"GGUF: general.architecture is '{arch}', expected '{ARCH}'")
    names = {t.name for t in reader.tensors}
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return Qwen2Config(
        vocab_size=int(emb.shape[1]),
        hidden_size=int(_field(reader, f"{ARCH}.embedding_length")),
        intermediate_size=int(_field(reader, f"{ARCH}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{ARCH}.block_count")),
        num_attention_heads=int(_field(reader, f"{ARCH}.attention.head_count")),
        num_key_value_heads=int(_field(reader, f"{ARCH}.attention.head_count_kv")),
        max_position_embeddings=int(_field(reader, f"{ARCH}.context_length")),
        rope_theta=float(_field(reader, f"{ARCH}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{ARCH}.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
    )


def describe(path: str) -> dict:
    """The header check: architecture keys and the tensor list (name, shape, quantization)."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    cfg = read_config(r)
    tensors = [{"name": t.name, "shape": [int(x) for x in t.shape], "type": t.tensor_type.name,
                "bytes": int(t.n_bytes)} for t in r.tensors]
    return {"config": cfg.to_dict(), "tensor_count": len(tensors), "tensors": tensors,
            "name": str(_field(r, "general.name", "?")), "file_type": int(_field(r, "general.file_type", -1))}


def check_tensors(reader, cfg: Qwen2Config):
    """Every tensor a Qwen2 of this configuration needs is there with transformers' shape."""
    hd, kv = cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    want = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        want["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        want.update({
            p + "input_layernorm.weight": (cfg.hidden_size,),
            p + "post_attention_layernorm.weight": (cfg.hidden_size,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, cfg.hidden_size),
            p + "self_attn.q_proj.bias": (cfg.num_attention_heads * hd,),
            p + "self_attn.k_proj.weight": (kv, cfg.hidden_size),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, cfg.hidden_size),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (cfg.hidden_size, cfg.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
            p + "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size),
        })
    have = {}
    for t in reader.tensors:
        have[hf_name(t.name)] = tuple(int(x) for x in reversed(t.shape))
    missing = sorted(set(want) - set(have))
    if missing:
        raise ValueError(f"GGUF: {len(missing)} tensors missing, first {missing[0]}")
    wrong = [(n, have[n], s) for n, s in want.items() if have[n] != s]
    if wrong:
        n, h, s = wrong[0]
        raise ValueError(f"GGUF: tensor {n} has shape {h}, expected {s}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ValueError(f"GGUF: unexpected tensors, first {extra[0]}")


def load(path: str, threads: int | None = None, dtype=np.float32):
    """(config, {transformers name: ndarray}) with every tensor dequantized (gguf.quants) to dtype."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(path)
    cfg = read_config(r)
    check_tensors(r, cfg)

    def one(t):
        a = dequantize(t.data, t.tensor_type)
        return hf_name(t.name), np.ascontiguousarray(a.reshape([int(x) for x in reversed(t.shape)]), dtype=dtype)

    threads = threads or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        weights = dict(pool.map(one, r.tensors))
    return cfg, weights


def tokenizer(path: str):
    """The GGUF's byte-level BPE vocabulary as a tokenizers.Tokenizer (Qwen2 split, NFC, specials)."""
    from gguf import GGUFReader
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import AddedToken

    r = GGUFReader(path)
    model = _field(r, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF: tokenizer.ggml.model is '{model}', expected 'gpt2' (byte-level BPE)")
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    f = r.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(f.parts[i]).decode("utf-8").split(" ", 1)) for i in f.data]
    types = [int(x) for x in r.fields["tokenizer.ggml.token_type"].contents()]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # GGUF token types: 3 = control, 4 = user-defined: matched whole, never split.
    specials = [AddedToken(t, special=(ty == 3), normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_tokens(specials)
    return tok


# ---- numpy reference forward (fp32): the check of the mapping, and of the torch model -----------

def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_inv_freq(theta, d):
    """The rotary frequencies theta^(-2i/d), i < d/2, in float64 (the one definition: the numpy
    reference, the torch model's buffer and its check all use it)."""
    return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)


def rope(x, positions, theta):
    """NEOX-style rotary embedding (rotate half) of x [N, H, d] at the given positions."""
    d = x.shape[-1]
    inv = rope_inv_freq(theta, d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos = np.cos(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1)).astype(np.float32)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


class ReferenceQwen2:
    """transformers' Qwen2ForCausalLM forward in numpy (fp32), for short inputs."""

    def __init__(self, cfg: Qwen2Config, weights: dict):
        self.cfg, self.w = cfg, weights

    def layer_qkv(self, i, h, positions):
        """Q, K after RoPE and V of layer i from its normed input h [N, hidden]: [N, H, d] each."""
        c, w, p = self.cfg, self.w, f"model.layers.{i}.self_attn."
        n, hd = h.shape[0], c.head_dim
        q = (h @ w[p + "q_proj.weight"].T + w[p + "q_proj.bias"]).reshape(n, c.num_attention_heads, hd)
        k = (h @ w[p + "k_proj.weight"].T + w[p + "k_proj.bias"]).reshape(n, c.num_key_value_heads, hd)
        v = (h @ w[p + "v_proj.weight"].T + w[p + "v_proj.bias"]).reshape(n, c.num_key_value_heads, hd)
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def hidden(self, ids, capture=None):
        """Final normed hidden states [N, hidden]; capture(i, q, k, v) sees every layer's states."""
        c, w = self.cfg, self.w
        ids = np.asarray(ids)
        n = ids.shape[0]
        pos = np.arange(n)
        x = w["model.embed_tokens.weight"][ids].astype(np.float32)
        group = c.num_attention_heads // c.num_key_value_heads
        causal = np.tril(np.ones((n, n), dtype=bool))
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            q, k, v = self.layer_qkv(i, h, pos)
            if capture is not None:
                capture(i, q, k, v)
            o = np.empty_like(q)
            for hq in range(c.num_attention_heads):
                s = (q[:, hq] @ k[:, hq // group].T) / np.sqrt(c.head_dim)
                s = np.where(causal, s, -np.inf)
                s = np.exp(s - s.max(-1, keepdims=True))
                o[:, hq] = (s / s.sum(-1, keepdims=True)) @ v[:, hq // group]
            x = x + o.reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
        return rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)

    def logits(self, ids, capture=None):
        head = self.w["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        return self.hidden(ids, capture) @ head.T


def next_token_loss(logits, ids):
    """Mean next-token cross entropy (nats) of logits [N, V] for ids [N]."""
    z = logits[:-1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-lp[np.arange(len(ids) - 1), np.asarray(ids)[1:]].mean())
