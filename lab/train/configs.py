"""Model sizes and training settings of the study, and the paper's attention FLOP accounting.

Every size is transformers' Qwen3 architecture (RMSNorm, SwiGLU, RoPE, q/k norms, tied embeddings)
with head_dim 128 and 2 KV heads (GQA), no attention dropout, randomly initialised from the seed.
Sizes are named by their non-embedding parameters (`non_embedding_params`); the three span more
than 8x.  `tiny` is the CPU tests' configuration.
"""

from __future__ import annotations

SEED = 42
VOCAB = 32768

SIZES = {
    # name: hidden, layers, q heads, kv heads, intermediate, peak learning rate
    "tiny": dict(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=128, lr=3e-3),
    "s4m": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=128, intermediate=768, lr=2e-3),
    "m13m": dict(hidden=512, layers=4, heads=4, kv_heads=2, head_dim=128, intermediate=1536, lr=1.5e-3),
    "l41m": dict(hidden=768, layers=6, heads=6, kv_heads=2, head_dim=128, intermediate=2304, lr=1e-3),
}

# WSD (warm-up, stable, decay), as the paper's pre-training: linear warm-up, constant peak, then a
# linear decay over the last DECAY_FRACTION of the steps to LCT_LR_FACTOR x peak, which is also the
# constant learning rate of the long-context stage.
WARMUP_STEPS = 100
DECAY_FRACTION = 0.2
LCT_LR_FACTOR = 0.1
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
CLIP = 1.0
ROPE_THETA = 1_000_000.0
MAX_POSITIONS = 32768


def qwen3_config(size: str, vocab: int = VOCAB, attn: str = "sdpa"):
    from transformers import Qwen3Config

    s = SIZES[size]
    return Qwen3Config(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                       max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, attention_dropout=0.0,
                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                       attn_implementation=attn)


def non_embedding_params(model) -> int:
    emb = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not emb)


def wsd_lr(step: int, total: int, peak: float, warmup: int = WARMUP_STEPS) -> float:
    """Learning rate of (0-based) step under WSD: warm-up to peak, stable, linear decay to
    LCT_LR_FACTOR x peak over the last DECAY_FRACTION of `total` steps."""
    warmup = min(warmup, max(1, total // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_start = int(total * (1 - DECAY_FRACTION))
    if step < decay_start:
        return peak
    frac = (step - decay_start + 1) / max(1, total - decay_start)
    return peak * (1 - (1 - LCT_LR_FACTOR) * min(1.0, frac))


def attention_flops_per_token(n: int, heads: int, head_dim: int, layers: int, s_f=None, s_b=None) -> float:
    """The paper's attention FLOPs per token of a training step (forward + backward), summed over
    layers, for a causal sequence of n tokens: dense 8ahd + 6ahd; MALA 4ahd + 4 s_b hd + 2 s_f hd +
    4 s_b hd, with a = (n + 1) / 2 and s_f, s_b the realized forward and backward slots per query.
    s_f / s_b may be one number or a per-layer list."""
    a = (n + 1) / 2
    hd = heads * head_dim
    if s_f is None:
        return layers * (8 * a * hd + 6 * a * hd)
    sf = list(s_f) if isinstance(s_f, (list, tuple)) else [s_f] * layers
    sb = list(s_b) if isinstance(s_b, (list, tuple)) else [s_b] * layers
    if len(sf) != layers or len(sb) != layers:
        raise ValueError(f"s_f / s_b: need {layers} layers (got {len(sf)} / {len(sb)})")
    return sum(4 * a * hd + 4 * b * hd + 2 * f * hd + 4 * b * hd for f, b in zip(sf, sb))
