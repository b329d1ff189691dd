"""Context-parallel MALA (mala.distributed) on N GPUs: latency, memory, work and exposed communication.

    torchrun --nproc-per-node 8 python/benchmarks/cp_timing.py --seqlen 131072 --tau 0 1 --dense-ring
    torchrun --nproc-per-node 8 python/benchmarks/cp_timing.py --seqlen 32768 --check
    python python/benchmarks/cp_timing.py --single-process --world 8 --seqlen 32768 --check

The inputs are the suite's workloads (lab/suite/workloads.py, mala::make_workload in PyTorch):
"random" (near-uniform attention) or "synthetic" (RoPE-like locality, a sink, needles; --sharpness),
drawn for the full sequence on every rank from the same seed, cast to --dtype, then zig-zag sharded.

For each tau, and for a dense ring built the same way (--dense-ring: the same zig-zag schedule, the
same ring and lse merge, torch's flash SDPA per chunk pair with the KV heads expanded for GQA):
- fwd_ms / bwd_ms: median over --reps of the slowest rank (all ranks start after a barrier; CUDA
  events; the backward is timed alone, from saved forward results);
- compute-only fwd_ms / bwd_ms: the same schedule with the communication replaced by local copies
  (every K/V shard all-gathered beforehand; the incoming running dK/dV replaced by zeros), and
  exposed communication = ring time - compute-only time;
- peak memory per rank over one forward + backward (torch.cuda.max_memory_allocated);
- realized work (MALA): mean forward/backward slots per query and retained tile fractions, all ranks;
- --check: against single-GPU mala.attention on the full sequence (same tau): relative L2 error of
  out, dq, dk, dv, max |lse difference|, its mean slots, and the omitted mass 1 - exp(lse - lse_dense)
  (lse_dense: the single call at tau = 0) against the bound tau / (1 + tau).

--single-process: all W ranks in one process on one GPU, in lockstep (no communication; the time is
the whole sharded schedule, W times one rank's work; memory is the process's).
Prints one JSON object (and writes it to --out).
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mala  # noqa: E402
import mala.distributed as mcp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "suite"))
from workloads import make_workload  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"  # a smoke test of the script itself may set "cpu" (gloo; it must stub torch.cuda's timers)


# ---- communication variants ---------------------------------------------------------------------

class PregatheredComm(mcp._GroupComm):
    """The ring's schedule without communication: every K/V shard was all-gathered beforehand, so
    a shift of K/V is a lookup and the incoming running dK/dV is replaced by zeros (same compute,
    wrong gradients: for timing only)."""

    def __init__(self, group, k, v):
        super().__init__(group)
        ks, vs = [torch.empty_like(k) for _ in range(self.world_size)], [torch.empty_like(v) for _ in
                                                                         range(self.world_size)]
        dist.all_gather(ks, k, group=self.group)
        dist.all_gather(vs, v, group=self.group)
        ks[self.ranks[0]], vs[self.ranks[0]] = k, v  # identity: the schedule starts from the caller's tensors
        self.shards = list(zip(ks, vs))

    def broadcast_from_first(self, tensors):
        return [self.shards[0][0][:, :tensors[0].shape[1]]]

    def shift(self, tensors, kind):
        if kind == "grad":
            return mcp._Pending([], [[torch.zeros_like(t) for t in tensors[0]]])
        current = next(i for i, (k, _) in enumerate(self.shards) if k is tensors[0][0])
        return mcp._Pending([], [self.shards[(current - 1) % self.world_size]])


# ---- the dense ring baseline: same schedule, flash SDPA per pair --------------------------------

def _expand_heads(x, heads_q):
    """[B, C, Hkv, d] -> [B, Hq, C, d] (the flash kernel here has no GQA)."""
    return x.transpose(1, 2).repeat_interleave(heads_q // x.shape[2], dim=1)


class DenseRing:
    """Dense ring attention: the zig-zag pairs of mala.distributed, each by
    aten._scaled_dot_product_flash_attention (causal on the diagonal), merged by lse; the backward
    against the final out and lse, dK/dV travelling around the ring as in mala.distributed."""

    def __init__(self, chunk, scale):
        self.chunk, self.scale, self.aux = chunk, scale, {}

    def forward(self, comm, qs, ks, vs):
        world, c = comm.world_size, self.chunk
        acc = [[[torch.zeros(q[:, :c].shape, dtype=torch.float32, device=q.device),
                 torch.full((q.shape[0], q.shape[2], c), float("-inf"), device=q.device)] for _ in range(2)]
               for q in qs]
        kv = list(zip(ks, vs))
        for step in range(world):
            pending = comm.shift(kv, "kv") if step + 1 < world else None
            for i, r in enumerate(comm.ranks):
                k, v = kv[i]
                for ia, ib, a, b in mcp._pairs(r, (r - step) % world, world):
                    q_a = qs[i][:, ia * c:(ia + 1) * c].transpose(1, 2)
                    res = torch.ops.aten._scaled_dot_product_flash_attention(
                        q_a, _expand_heads(k[:, ib * c:(ib + 1) * c], q_a.shape[1]),
                        _expand_heads(v[:, ib * c:(ib + 1) * c], q_a.shape[1]), 0.0, a == b, False, scale=self.scale)
                    self.aux[a == b] = (res[2], res[3], res[4], res[5], res[6], res[7])
                    acc[i][ia] = list(mcp._merge(acc[i][ia][0], acc[i][ia][1], res[0].transpose(1, 2), res[1]))
            if pending is not None:
                kv = pending.wait()
        outs = [torch.cat([o for o, _ in halves], 1).to(q.dtype) for halves, q in zip(acc, qs)]
        lses = [torch.cat([l for _, l in halves], 2).contiguous() for halves in acc]
        return outs, lses

    def backward(self, comm, qs, ks, vs, outs, lses, douts):
        world, c = comm.world_size, self.chunk
        dqs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in qs]
        kv, grads_pending = list(zip(ks, vs)), None
        for step in range(world):
            kv_pending = comm.shift(kv, "kv") if step + 1 < world else None
            contributions = []
            for i, r in enumerate(comm.ranks):
                k, v = kv[i]
                dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
                dv = torch.zeros_like(dk)
                for ia, ib, a, b in mcp._pairs(r, (r - step) % world, world):
                    rows, keys = slice(ia * c, (ia + 1) * c), slice(ib * c, (ib + 1) * c)
                    q_a = qs[i][:, rows].transpose(1, 2)
                    hq, hkv = q_a.shape[1], k.shape[2]
                    cum_q, cum_k, max_q, max_k, seed, offset = self.aux[a == b]
                    dq_p, dk_p, dv_p = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                        douts[i][:, rows].transpose(1, 2), q_a, _expand_heads(k[:, keys], hq),
                        _expand_heads(v[:, keys], hq), outs[i][:, rows].transpose(1, 2),
                        lses[i][..., rows].contiguous(), cum_q, cum_k, max_q, max_k, 0.0, a == b, seed, offset,
                        scale=self.scale)
                    fold = lambda g: g.unflatten(1, (hkv, hq // hkv)).sum(2).transpose(1, 2)  # noqa: E731
                    dqs[i][:, rows] += dq_p.transpose(1, 2)
                    dk[:, keys] += fold(dk_p)
                    dv[:, keys] += fold(dv_p)
                contributions.append((dk, dv))
            if grads_pending is not None:
                incoming = grads_pending.wait()
                contributions = [(dk + dk_in, dv + dv_in) for (dk, dv), (dk_in, dv_in) in zip(contributions, incoming)]
            grads_pending = comm.shift(contributions, "grad")
            if kv_pending is not None:
                kv = kv_pending.wait()
        home = grads_pending.wait()
        return dqs, [dk for dk, _ in home], [dv for _, dv in home]


# ---- timing ---------------------------------------------------------------------------------------

def timed_ms(fn, comm, reps, warmup):
    """Median over reps of the slowest rank's time of fn() (CUDA events; a barrier before each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if isinstance(comm, mcp._GroupComm):
            dist.barrier(group=comm.group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device=DEVICE)
        if isinstance(comm, mcp._GroupComm):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
        times.append(t.item())
    return statistics.median(times)


def peak_memory_gib(fn, comm):
    """Peak allocated memory of fn() on each rank (GiB; one entry in --single-process)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2 ** 30], device=DEVICE)
    if not isinstance(comm, mcp._GroupComm):
        return [peak.item()]
    peaks = [torch.zeros_like(peak) for _ in range(comm.world_size)]
    dist.all_gather(peaks, peak, group=comm.group)
    return [p.item() for p in peaks]


def measure(method, comm, compute_comm, qs, ks, vs, douts, args):
    """fwd/bwd times with the ring and with compute only; peak memory.  method has forward(comm, ...)
    and backward(comm, ...)."""
    saved = {}

    def fwd(c=comm):
        saved["out"], saved["lse"] = method.forward(c, qs, ks, vs)[:2]

    def bwd(c=comm):
        method.backward(c, qs, ks, vs, saved["out"], saved["lse"], douts)

    fwd()
    row = {"fwd_ms": timed_ms(fwd, comm, args.reps, args.warmup), "bwd_ms": timed_ms(bwd, comm, args.reps,
                                                                                       args.warmup)}
    if compute_comm is not None:
        row["compute_only_fwd_ms"] = timed_ms(lambda: fwd(compute_comm), comm, args.reps, args.warmup)
        row["compute_only_bwd_ms"] = timed_ms(lambda: bwd(compute_comm), comm, args.reps, args.warmup)
        row["exposed_comm_fwd_ms"] = row["fwd_ms"] - row["compute_only_fwd_ms"]
        row["exposed_comm_bwd_ms"] = row["bwd_ms"] - row["compute_only_bwd_ms"]
    saved.clear()
    row["peak_mem_gib_per_rank"] = peak_memory_gib(lambda: (fwd(), bwd()), comm)
    return row


class MalaRing:
    """mala.distributed's forward and backward passes for one plan (the functions behind attention())."""

    def __init__(self, plan):
        self.plan = plan

    def forward(self, comm, qs, ks, vs):
        return mcp._forward(comm, self.plan, qs, ks, vs)

    def backward(self, comm, qs, ks, vs, outs, lses, douts):
        return mcp._backward(comm, self.plan, qs, ks, vs, outs, lses, douts)


# ---- the check against one GPU ------------------------------------------------------------------

def rel_l2(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def check(tau, plan, comm, full, shard, qs, ks, vs, douts):
    """This process's ranks against mala.attention on the full sequence (run on every rank)."""
    q, k, v, dout = (t.detach().requires_grad_(t is not full[3]) for t in full)
    out, lse, stats = mala.attention(q, k, v, tau=tau, return_lse=True, return_stats=True)
    out.backward(dout)
    lse_dense = mala.attention(q.detach(), k.detach(), v.detach(), tau=0.0, return_lse=True)[1]
    with_stats = dataclasses.replace(plan, return_stats=True)
    outs, lses, fwd_work = mcp._forward(comm, with_stats, qs, ks, vs)
    dqs, dks, dvs, bwd_work = mcp._backward(comm, with_stats, qs, ks, vs, outs, lses, douts)
    mine = {"out": outs, "lse": lses, "dq": dqs, "dk": dks, "dv": dvs}
    ref = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    result = {}
    for name, xs in mine.items():
        dim = 2 if name == "lse" else 1
        errs = [rel_l2(x, shard(ref[name], r, dim)) if name != "lse" else
                (x - shard(ref[name], r, dim)).abs().max().item() for x, r in zip(xs, comm.ranks)]
        result["max_abs_lse_diff" if name == "lse" else f"rel_l2_{name}"] = max(errs)
    omitted = max((1 - torch.exp(x - shard(lse_dense, r, 2))).max().item() for x, r in zip(lses, comm.ranks))
    t = torch.tensor([result[key] for key in sorted(result)] + [omitted], device=DEVICE)
    if isinstance(comm, mcp._GroupComm):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
    result = dict(zip(sorted(result) + ["max_omitted_mass"], t.tolist()))
    result["omitted_mass_bound"] = tau / (1 + tau)
    result["ring_mean_fwd_slots"] = mcp._reduce_work(comm, fwd_work)[0]
    result["ring_mean_bwd_slots"] = mcp._reduce_work(comm, bwd_work)[0]
    result["single_gpu_mean_fwd_slots"] = stats.mean_fwd_slots
    result["single_gpu_mean_bwd_slots"] = stats.mean_bwd_slots
    result["single_gpu_fwd_tiles"] = [stats.fwd_block_q, stats.fwd_block_k]
    result["single_gpu_bwd_tiles"] = [stats.bwd_block_q, stats.bwd_block_k]
    return result


# ---- main -----------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads-q", type=int, default=8)
    parser.add_argument("--heads-kv", type=int, default=1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tau", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--regime", choices=["random", "synthetic"], default="synthetic")
    parser.add_argument("--sharpness", type=float, default=1.0, help="synthetic regime only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dense-ring", action="store_true", help="also time a dense ring with flash SDPA per pair")
    parser.add_argument("--check", action="store_true", help="compare with single-GPU mala.attention")
    parser.add_argument("--single-process", action="store_true", help="simulate --world ranks on one GPU")
    parser.add_argument("--world", type=int, default=8, help="ranks simulated by --single-process")
    parser.add_argument("--block-q", type=int, default=0)
    parser.add_argument("--block-k", type=int, default=0)
    parser.add_argument("--bwd-block-q", type=int, default=0)
    parser.add_argument("--bwd-block-k", type=int, default=0)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="also write the JSON here (rank 0)")
    args = parser.parse_args()

    if args.single_process:
        comm, compute_comm = mcp._LocalComm(args.world), None
        torch.cuda.set_device(0)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
        comm = mcp._GroupComm()
    world = comm.world_size
    dtype = DTYPES[args.dtype]

    full = make_workload(args.regime, args.batch, args.seqlen, args.heads_q, args.heads_kv, args.dim,
                         sharpness=args.sharpness, seed=args.seed, device=DEVICE)
    full = tuple(t.to(dtype) for t in full)
    shard = lambda t, r, dim=1: mcp.zigzag_shard(t, r, world, dim=dim).contiguous()  # noqa: E731
    qs, ks, vs, douts = ([shard(t, r) for r in comm.ranks] for t in full)
    if not args.check:
        del full
    if not args.single_process:
        compute_comm = PregatheredComm(None, ks[0], vs[0])

    scale = 1.0 / math.sqrt(args.dim)
    tiles = (args.block_q, args.block_k, args.bwd_block_q, args.bwd_block_k)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "mode": "single-process" if args.single_process else "torchrun", "world_size": world,
              "seqlen": args.seqlen, "chunk": args.seqlen // (2 * world), "batch": args.batch,
              "heads_q": args.heads_q, "heads_kv": args.heads_kv, "dim": args.dim, "dtype": args.dtype,
              "regime": args.regime, "sharpness": args.sharpness if args.regime == "synthetic" else None,
              "seed": args.seed, "reps": args.reps, "results": []}
    for tau in args.tau:
        plan = mcp._make_plan(qs[0], ks[0], tau, None, tiles, False, False)
        row = {"method": "mala", "tau": tau, "fwd_tiles": [plan.fwd_block_q, plan.fwd_block_k],
               "bwd_tiles": [plan.bwd_block_q, plan.bwd_block_k]}
        row.update(measure(MalaRing(plan), comm, compute_comm, qs, ks, vs, douts, args))
        with_stats = dataclasses.replace(plan, return_stats=True)
        outs, lses, fwd_work = mcp._forward(comm, with_stats, qs, ks, vs)
        *_, bwd_work = mcp._backward(comm, with_stats, qs, ks, vs, outs, lses, douts)
        for kind, work in (("fwd", fwd_work), ("bwd", bwd_work)):
            mean, retained, legal = mcp._reduce_work(comm, work)
            row[f"mean_{kind}_slots"] = mean
            row[f"{kind}_retained_fraction"] = retained / legal if legal else 1.0
        del outs, lses
        if args.check:
            row["check"] = check(tau, plan, comm, full, shard, qs, ks, vs, douts)
        report["results"].append(row)
    if args.dense_ring:
        row = {"method": "dense_ring_sdpa_flash", "tau": None}
        row.update(measure(DenseRing(args.seqlen // (2 * world), scale), comm, compute_comm, qs, ks, vs, douts,
                           args))
        report["results"].append(row)

    if args.single_process or dist.get_rank() == 0:
        text = json.dumps(report, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    if not args.single_process:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
