"""The study's model: a small pre-norm transformer (2 layers, as Zoology's MQAR models), identical
for every method except the attention inside each layer (ar_methods.Attention).

Rotary position embeddings on q and k, and before each attention a short causal depthwise
convolution (3 taps, added to the normed input: h + conv(h)) that hands each value position its
key.  Recall is a two-step circuit: bind each value to the key just before it, then match the query
against those bindings.  With rotary attention alone the model has to learn the first step as a
previous-token head, and it did not: full attention stayed at the in-context shortcut (accuracy
1 / n_kv) from 256 tokens up (1M examples at 256 tokens on an H200; on the CPU, 256 tokens, 16 pairs,
d_model 64, 1,500 steps: accuracy 0.057 without the conv, 1.0 by step 500 with it).  Zoology's MQAR
attention model has the same short convolution (its BaseConv, kernel 3, as layer 0); the paper's
appendix, as docs/evaluation.md reads it, names none, so treat it as a deviation: the same for every
method, and local: 3 tokens, so recall across the suffix is still the attention's.  conv=0 builds the first
model.  Heads of head_dim 64 (d_model / 64 of them, one head
below d_model 64); a 4x GELU MLP; untied embedding and output.  Initialization at PyTorch's
default scales: embedding N(0, 1), Linear and conv weights U(+-1/sqrt(fan_in)), zero biases (N(0, 0.02)
everywhere, the first version, left the embedding small against the blocks' outputs, and a small
MQAR stayed at the in-context heuristic, accuracy 1 / n_kv, where this init solves it).  The output head runs only at the
scored (query) positions, so a batch of 8K sequences never materializes N x vocab logits.  Each
weight is drawn from its own generator, seeded by the run's seed and the weight's name: a seed
gives every method the same initial weights for every parameter they share (a method's own ones,
DSA's indexer or NSA's gates, draw nothing from the others' streams).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ar_methods import Attention, MethodConfig


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x [B, N, H, d] (d even), positions 0 .. N - 1, half-split layout."""
    n, d = x.shape[1], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.arange(n, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def head_layout(d_model: int, head_dim: int = 64) -> tuple[int, int]:
    hd = min(head_dim, d_model)
    if d_model % hd:
        raise ValueError(f"d_model {d_model} is not a multiple of head_dim {hd}")
    return d_model // hd, hd


class Block(nn.Module):
    def __init__(self, method, d_model, head_dim, mcfg, conv: int = 3):
        super().__init__()
        self.n_heads, self.head_dim = head_layout(d_model, head_dim)
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        # short causal depthwise convolution on the attention input (conv taps; 0: none)
        self.conv = nn.Conv1d(d_model, d_model, conv, groups=d_model, padding=conv - 1) if conv else None
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.attn = Attention(method, d_model, self.n_heads, self.head_dim, mcfg)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        B, n, D = x.shape
        h = self.ln1(x)
        if self.conv is not None:
            h = h + self.conv(h.transpose(1, 2))[..., :n].transpose(1, 2)
        q, k, v = self.qkv(h).view(B, n, 3, self.n_heads, self.head_dim).unbind(2)
        a = self.attn(rope(q), rope(k), v, h, rope)
        x = x + self.proj(a.reshape(B, n, D))
        return x + self.mlp(self.ln2(x))


class ARModel(nn.Module):
    def __init__(self, vocab: int, d_model: int, method: str, n_layers: int = 2, head_dim: int = 64,
                 mcfg: MethodConfig = MethodConfig(), seed: int = 0, conv: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(method, d_model, head_dim, mcfg, conv) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d)):
                g = torch.Generator().manual_seed(zlib.crc32(f"{int(seed)}:{name}".encode()))
                if isinstance(m, nn.Embedding):
                    nn.init.normal_(m.weight, std=1.0, generator=g)
                else:
                    # fan_in: in_features, or a depthwise conv's taps
                    bound = (m.in_features if isinstance(m, nn.Linear) else m.weight[0].numel()) ** -0.5
                    nn.init.uniform_(m.weight, -bound, bound, generator=g)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def attentions(self):
        return [b.attn for b in self.blocks]

    def forward(self, tokens: torch.Tensor, where: torch.Tensor):
        """Logits [len(where rows), vocab] at the positions where `where` [B, N] is True, and the
        summed auxiliary loss of the attentions (0 when none has one)."""
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x[where]))
        aux = [a.aux for a in self.attentions() if a.aux is not None]
        return logits, (torch.stack(aux).sum() if aux else logits.new_zeros(()))

    def mean_slots(self) -> float:
        """Mean realized forward slots per query row over the layers of the last forward."""
        s = [float(a.last_slots) for a in self.attentions()]
        return sum(s) / len(s)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.float(), labels)
