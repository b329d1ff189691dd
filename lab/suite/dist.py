"""Tensor-parallel operator benchmark (issue 6): attention heads split over the GPUs of one host.

    python3 lab/suite/run.py --dist W [--quick] [--out DIR] [--ns 8,32,128] [--systems ...]

The paper's setting: 64 query heads and 8 KV heads, d = 128, bf16, causal, batch 1, split over
W ranks (W must divide 8): each rank runs Hq = 64/W, Hkv = 8/W on its own GPU (one process per
GPU, torch.multiprocessing.spawn, NCCL).  Attention needs no communication between heads; the
group's latency is what the paper reports: per timed call every rank flushes L2, meets at a
barrier, runs the call and synchronizes its device; the call's time is the maximum over ranks (an
all-reduce of the per-rank times), and the median over calls is reported, both as host wall-clock
from the barrier and as CUDA-event time.  Peak memory is gathered from every rank.

Each rank draws its own heads' inputs (seed + rank): the same distributions as the full 64-head
workload, not its exact slice.  NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 in every process).
"""

from __future__ import annotations

import gc
import os
import socket
import statistics
import sys
import time
import traceback

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402
import systems as S  # noqa: E402
import timing  # noqa: E402

KI = 1024
FULL_NS = [8, 32, 64, 128]
QUICK_NS = [8, 32]
DEFAULT_SYSTEMS = "sdpa_flash,sdpa_cudnn,fsa,mala,mala0"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(args):
    W = args.dist
    n_gpu = torch.cuda.device_count() if args.device == "cuda" else W
    if W > n_gpu:
        print(f"--dist {W}: only {n_gpu} GPUs visible")
        return 2
    if 8 % W and not args.dist_rank_heads:
        print(f"--dist {W}: must divide the 8 KV heads (or give --dist-rank-heads)")
        return 2
    os.makedirs(args.out, exist_ok=True)
    port = _free_port()
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(W, port, vars(args)), nprocs=W, join=True)
    return 0


DEV = "cuda"  # "cpu" (gloo, host timer) only for smoke tests of this module


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _sync_time(fn, flush, reps, setup=None):
    """Per call: flush, barrier, run, synchronize; returns (host_ms_max[], event_ms_max[])."""
    host, ev = [], []
    for _ in range(reps):
        if setup:
            setup()
        if flush is not None:
            flush.zero_()
        _sync()
        dist.barrier()
        if DEV == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        if DEV == "cuda":
            s.record()
        fn()
        if DEV == "cuda":
            e.record()
        _sync()
        h = (time.perf_counter() - t) * 1e3
        x = torch.tensor([h, s.elapsed_time(e) if DEV == "cuda" else h], device=DEV, dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        host.append(float(x[0]))
        ev.append(float(x[1]))
    return host, ev


def _worker(rank, W, port, a):
    global DEV
    os.environ.update(NO_MULTICAST)
    DEV = timing.DEVICE = a.get("device", "cuda")
    if DEV == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    t0 = time.time()
    deadline = a["deadline"] or (t0 + a["budget_s"])
    reserve = 30.0
    quick = a["quick"]
    ns = a["ns"] or (QUICK_NS if quick else FULL_NS)
    ops = (a["ops"] or "fwd,bwd,fwd_bwd,decode").split(",")
    names = a["systems"] or DEFAULT_SYSTEMS
    systems = S.all_systems(names.split(","), taus=(a["tau"],))
    # Default: the paper's 64/8 heads split over W ranks.  --dist-rank-heads HQ,HKV fixes the
    # per-rank shape instead (the paper's TP = 8 per-rank shape 8/1 on fewer GPUs: issue 6's fallback).
    if a.get("dist_rank_heads"):
        Hq, Hkv = a["dist_rank_heads"]
    else:
        Hq, Hkv = 64 // W, 8 // W
    d = 128
    regime = "synthetic" if a.get("sharpness") else "random"
    sharp = (a.get("sharpness") or [0.0])[0]
    res = None
    if rank == 0:
        meta = common.env_info(S)
        meta.update(mode=("quick" if quick else "full") + f" dist W={W}", world_size=W,
                    timing="per call: L2 flush, barrier, call, device sync; max over ranks; median over calls")
        res = common.Results(os.path.join(a["out"], "results_dist.json"), meta)
    log = (lambda m: print(f"[{time.time() - t0:7.1f}s] {m}", flush=True)) if rank == 0 else (lambda m: None)
    log(f"dist: W={W}, per rank Hq={Hq} Hkv={Hkv} d={d}, N={ns}K, ops {ops}, systems {[s.name for s in systems]}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if DEV == "cuda" else None
    min_reps = a["min_reps"]
    for n in ns:
        N = n * KI
        q, k, v, dout = common.make_inputs(regime, 1, N, Hq, Hkv, d, sharp, seed=1000 + rank)
        lse_dense = common.dense_lse(q, k, v) if any(s.sparse for s in systems) else None
        fl = timing.causal_flops_fwd(1, N, N, Hq, d) * W
        flops = {"fwd": fl, "bwd": 2.5 * fl, "fwd_bwd": 3.5 * fl, "decode": timing.causal_flops_fwd(1, 1, N, Hq, d) * W}
        for sysm in systems:
            why = sysm.available()
            whys = [None] * W
            dist.all_gather_object(whys, why)
            why = next((w for w in whys if w), None)
            info = {}
            if not why and sysm.sparse and sysm.tau:
                try:
                    if isinstance(sysm, S.Mala):
                        st, lse = sysm.stats(q, k, v, dout)
                        info.update(st)
                    else:
                        _, lse = sysm.outputs(q, k, v)
                    info["omitted_mass_mean"], info["omitted_mass_max"] = common.omitted_mass(lse, lse_dense)
                except Exception as e:  # noqa: BLE001
                    info["stats_error"] = str(e)[:300]
                infos = [None] * W
                dist.all_gather_object(infos, info)
                if rank == 0:
                    info = _merge_infos(infos)
            prep = None
            for op in ops:
                rec = {"section": "dist", "op": op, "system": sysm.name, "label": sysm.label, "tau": sysm.tau,
                       "regime": regime, "sharpness": sharp, "B": 1, "N": N, "Hq": Hq, "Hkv": Hkv, "d": d,
                       "world_size": W, "heads_q_total": Hq * W, "heads_kv_total": Hkv * W}
                if op != "decode":
                    rec.update(info)
                if why:
                    rec.update(status="unavailable", reason=why)
                    if rank == 0:
                        res.add(rec)
                        log(f"{op} N={N} {sysm.name}: unavailable ({why[:100]})")
                    continue
                go = torch.tensor([1 if time.time() < deadline - reserve else 0], device=DEV)
                dist.broadcast(go, 0)
                if not go.item():
                    rec.update(status="skipped", reason="time budget")
                    if rank == 0:
                        res.add(rec)
                        log(f"{op} N={N} {sysm.name}: skipped (time budget)")
                    continue
                err = None
                fn, setup = None, None
                dinfo = None
                try:
                    if op == "decode":
                        q1 = q[:, -1:].contiguous()
                        pd = sysm.prepare_decode(q1, k, v)
                        fn = pd.decode
                        if sysm.sparse and sysm.tau:
                            dinfo = {}
                            try:
                                if hasattr(pd, "stats"):
                                    dinfo.update(pd.stats())
                                _, lse1 = pd.out_lse()
                                dinfo["omitted_mass_mean"], dinfo["omitted_mass_max"] = common.omitted_mass(
                                    lse1, common.dense_lse(q1, k, v, causal=False))
                            except Exception as e:  # noqa: BLE001
                                dinfo["stats_error"] = str(e)[:300]
                    else:
                        if prep is None:
                            prep = sysm.prepare(q, k, v, dout)
                        if op == "fwd":
                            fn = prep.fwd
                        elif op == "bwd":
                            prep.make_graph()
                            fn = prep.bwd
                        else:
                            fn = prep.fwd_bwd
                    fn()
                    fn()
                    _sync()
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"[:400]
                errs = [None] * W
                dist.all_gather_object(errs, err)
                err = next((x for x in errs if x), None)
                if err:
                    rec.update(status="oom" if "out of memory" in err.lower() else "failed", reason=err)
                    if rank == 0:
                        res.add(rec)
                        log(f"{op} N={N} {sysm.name}: {rec['status']}: {err[:160]}")
                    gc.collect()
                    timing.empty_cache()
                    continue
                if op == "decode":
                    dinfos = [None] * W
                    dist.all_gather_object(dinfos, dinfo or {})
                    rec.update(_merge_infos(dinfos))
                # one probe to size the repetitions, then the timed calls
                host, ev = _sync_time(fn, flush, 1, setup)
                reps = int(min(100, max(min_reps, (0.3 if quick else 0.6) * 1e3 / max(host[0], 1e-3))))
                host, ev = _sync_time(fn, flush, reps, setup)
                _sync()
                if DEV == "cuda":
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    fn()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated()
                else:
                    before = peak = 0
                peaks = [None] * W
                dist.all_gather_object(peaks, (int(peak), int(peak - before)))
                rec.update(status="ok", ms=statistics.median(host), ms_event=statistics.median(ev),
                           ms_min=min(host), reps=reps, peak_bytes_per_rank=[p[0] for p in peaks],
                           peak_bytes_max_rank=max(p[0] for p in peaks), peak_bytes=max(p[0] for p in peaks),
                           peak_extra_bytes_max_rank=max(p[1] for p in peaks))
                rec["tflops_dense_equiv"] = flops[op] / (rec["ms"] * 1e-3) / 1e12
                if rank == 0:
                    res.add(rec)
                    extra = ""
                    if rec.get("fwd_slots_mean") is not None:
                        extra = (f" | slots fwd {rec['fwd_slots_mean']:.0f}"
                                 + (f" bwd {rec['bwd_slots_mean']:.0f}" if rec.get("bwd_slots_mean") else "")
                                 + f", retained fwd {100 * rec['fwd_retained_fraction']:.2f}%")
                    if rec.get("omitted_mass_max") is not None:
                        extra += f", omitted mean {rec['omitted_mass_mean']:.2e} max {rec['omitted_mass_max']:.2e}"
                    log(f"{op:8s} N={N} {sysm.name:12s} group {rec['ms']:9.3f} ms (events {rec['ms_event']:.3f}) "
                        f"peak/rank {rec['peak_bytes_max_rank'] / 2**30:.2f} GiB{extra}")
                if op == "bwd" and prep is not None:
                    prep.out_graph = None
            del prep
            gc.collect()
            timing.empty_cache()
        del q, k, v, dout, lse_dense
        gc.collect()
        timing.empty_cache()
    if rank == 0:
        res.data["meta"]["wall_s"] = time.time() - t0
        res.save()
        try:
            import plots
            import report
            made = plots.make_all(res.data, a["out"])
            log(f"plots: {made}")
            print(report.summary_text(res.data), flush=True)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    dist.barrier()
    dist.destroy_process_group()


def _merge_infos(infos):
    """Per-rank realized work -> the group's (mean of per-rank means: equal shapes; max of maxima)."""
    out = {}
    keys = set().union(*[i.keys() for i in infos])
    for key in keys:
        vals = [i.get(key) for i in infos if i.get(key) is not None]
        if not vals:
            continue
        if key.endswith("_max"):
            out[key] = max(vals)
        elif isinstance(vals[0], (int, float)):
            out[key] = sum(vals) / len(vals)
        else:
            out[key] = vals[0]
    return out
