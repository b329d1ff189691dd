"""The dense baseline beside mala_bench: torch SDPA's cuDNN backend, forward and backward, causal,
with mala_bench's protocol (CUDA events, L2 flushed before each timed call, median of --iters).

    python python/benchmarks/sdpa_cudnn_timing.py [--seqlens 8192 32768 131072] [--heads-q 8 --heads-kv 1]
        [--head-dims 64 128 256] [--dtype bf16] [--iters 10]

Random N(0, 1) inputs, batch 1, [B, H, N, d] layout; K and V are expanded to the query heads (the
cuDNN backend takes no GQA), as lab/suite/systems.py does.  TFLOP/s use the causal count of
mala_bench (forward 4 N^2 d Hq / 2, backward 2.5x that).  Needs only torch.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timer import median_ms


def flushed_median_ms(fn, iters):
    """median_ms with 3 warm-up calls and a 512 MiB write (the L2 flush) before each timed call."""
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    return median_ms(fn, iters, warmup=3, before=flush.zero_)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--heads-q", type=int, default=8)
    p.add_argument("--heads-kv", type=int, default=1)
    p.add_argument("--head-dims", type=int, nargs="+", default=[128])
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-backward", action="store_true")
    args = p.parse_args()
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"# SDPA cuDNN, causal, B=1 Hq={args.heads_q} Hkv={args.heads_kv} (expanded) {args.dtype}, L2 flushed, "
          f"median of {args.iters}")
    for d in args.head_dims:
        for n in args.seqlens:
            g = args.heads_q // args.heads_kv
            q = torch.randn(1, args.heads_q, n, d, device="cuda", dtype=dt, requires_grad=True)
            k, v = (torch.randn(1, args.heads_kv, n, d, device="cuda", dtype=dt).repeat_interleave(g, 1)
                    .requires_grad_() for _ in range(2))
            dout = torch.randn_like(q)
            flops = 4.0 * (n * (n + 1) / 2) * d * args.heads_q

            def fwd():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            fwd_ms = flushed_median_ms(fwd, args.iters)
            line = f"d={d:<3} N={n:>6}  fwd {fwd_ms:9.3f} ms {flops / fwd_ms * 1e-9:6.1f} TF/s"
            if not args.no_backward:
                out = fwd()

                def bwd():
                    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

                bwd_ms = flushed_median_ms(bwd, args.iters)
                line += f"  bwd {bwd_ms:9.3f} ms {2.5 * flops / bwd_ms * 1e-9:6.1f} TF/s"
            print(line, flush=True)
            del q, k, v, dout


if __name__ == "__main__":
    main()
