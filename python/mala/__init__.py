"""MassAlloc Attention (MALA) for PyTorch.

Causal softmax attention that skips the post-score work of key tiles whose contribution is below
tau / L_q (tau = 0 is exact dense attention).  The operators are C++ (torch.ops.mala.*); this
package adds autograd, torch.compile support and the flash_attn-style functions below.

    import mala
    out = mala.attention(q, k, v, tau=1.0)            # q [B, N, Hq, d], k/v [B, N, Hkv, d]
    out = mala.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    out = mala.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=k_new, v=v_new)
    out = mala.scaled_dot_product_attention(q, k, v, is_causal=True)   # torch's [B, H, N, d] layout
    tau = mala.layer_tau(lambda i: 0.0 if i == 0 else 1.0, layer_idx)  # a per-layer tau spec
    mala.integrations.transformers.register()        # attn_implementation="mala"
    from mala.flash_attn_interface import flash_attn_func   # flash_attn's signatures (+ tau)
    mala.sdpa.register(tau=1.0)                      # then torch.nn.attention.activate_flash_attention_impl("MALA")
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.mala.*)
from . import _ops  # noqa: F401  (fake implementations and autograd)
from .api import (attention, attention_varlen, attention_with_kvcache, layer_tau, scaled_dot_product_attention,
                  tile_sizes)
from .stats import AttentionStats

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "layer_tau",
    "scaled_dot_product_attention",
    "tile_sizes",
    "AttentionStats",
]


def __getattr__(name):
    # `mala.integrations` is imported on first use so that `import mala` never imports transformers;
    # `mala.sdpa` likewise (importing it registers nothing with torch).
    if name in ("integrations", "sdpa"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'mala' has no attribute {name!r}")
