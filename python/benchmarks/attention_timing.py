"""Times mala.attention through the PyTorch binding against torch SDPA (its default backend choice;
CUDA events, median of 10).

    python python/benchmarks/attention_timing.py [--seqlens 8192 32768] [--heads-q 8 --heads-kv 1 --head-dim 128]

Random N(0, 1) inputs (near-uniform attention: MALA retains almost every tile, so this shows the
cost of the binding and of the tile test, not MALA's savings).  Prints the realized work too.
"""

import argparse

import torch
import torch.nn.functional as F

import mala
from cuda_timer import median_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192])
    parser.add_argument("--heads-q", type=int, default=8)
    parser.add_argument("--heads-kv", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for n in args.seqlens:
        shape_q = (1, n, args.heads_q, args.head_dim)
        shape_kv = (1, n, args.heads_kv, args.head_dim)
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        dout_t = dout.transpose(1, 2)

        def sdpa():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

        rows = {"torch sdpa": (sdpa, dout_t)}
        for tau in (0.0, 1.0):
            rows[f"mala tau={tau:g}"] = ((lambda tau=tau: mala.attention(q, k, v, tau=tau)), dout)
        for name, (fn, grad) in rows.items():
            fwd = median_ms(lambda: fn(), reps=10, warmup=3)
            both = median_ms(lambda: torch.autograd.backward(fn(), grad), reps=10, warmup=3)
            print(f"N={n:6d} {name:12s} fwd {fwd:8.3f} ms   fwd+bwd {both:8.3f} ms")
        out, stats = mala.attention(q, k, v, tau=1.0, return_stats=True)
        torch.autograd.backward(out, dout)
        print(f"N={n:6d} realized at tau=1: {stats}")


if __name__ == "__main__":
    main()
