// Backward benchmark (run_backward_bench): latency, dense-equivalent TFLOP/s (2.5 x the causal forward
// count), realized mean backward post-score slots per query and retained tile fraction, for each
// (regime, sharpness, N, tau); ratios are to our own tau = 0 backward on the same inputs in the same
// run.  O and lse come from our CUDA forward at the same tau (the backward tests against them).
//   mala_bench --op bwd --n 1K,32K,128K --tau 0,1 --regime random,synthetic --sharpness 4 --iters 10
//   mala_bench --op bwd --real real-data/gpl3/layer05   (captured inputs, lab/real/; shape from the files)
// Inputs are converted on the GPU and timed as in the forward bench (bench_forward.cu: CUDA events,
// warm-up, median, L2 flushed before each timed call); with --interleave the taus of one input
// alternate within each timed iteration.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench.h"

namespace {

using mala_bench::DevMem;
using mala_bench::Options;

}  // namespace

int run_backward_bench(int argc, char** argv) {
  const Options opt = mala_bench::parse_options(argc, argv);
  char shape[96] = "shapes from the --real files";
  if (opt.real.empty())
    std::snprintf(shape, sizeof shape, "B=%lld Hq=%lld Hkv=%lld d=%lld", (long long)opt.batch, (long long)opt.heads_q,
                  (long long)opt.heads_kv, (long long)opt.head_dim);
  std::printf("== backward: %s %s %s%s%s, %s (device %s)\n", mala::dtype_name(opt.dtype), shape,
              opt.causal ? "causal" : "non-causal", opt.deterministic ? ", deterministic" : "",
              opt.fwd_mask ? ", with the forward's tile mask" : "",
              opt.interleave ? "median of --iters, L2 flushed, taus interleaved" : "median of --iters, L2 flushed",
              mala::device_name().c_str());
  std::printf("%-10s %5s %6s %4s %10s %8s %10s %9s %9s\n", "regime", "sharp", "N", "tau", "bwd ms", "TFLOP/s",
              "slots/q", "retained", "vs tau0");
  // The inputs: generated (regime x sharpness x N) or captured real layers (--real PREFIX,...).
  struct Input {
    std::string regime;
    double sharp;
    int64_t n;
    std::string prefix;  // real only
  };
  std::vector<Input> inputs;
  if (!opt.real.empty()) {
    for (const std::string& p : opt.real) inputs.push_back({"real", 0.0, 0, p});
  } else {
    for (const std::string& regime : opt.regimes) {
      const std::vector<double> sharps = regime == "synthetic" ? opt.sharpness : std::vector<double>{0.0};
      for (double sharp : sharps)
        for (int64_t n : opt.n) inputs.push_back({regime, sharp, n, ""});
    }
  }
  int rc = 0;
  for (const Input& in : inputs) {
    const std::string& regime = in.regime;
    const double sharp = in.sharp;
    int64_t n = in.n, B = opt.batch, hq = opt.heads_q, hkv = opt.heads_kv, d = opt.head_dim;
    mala_bench::RealInput r;
    if (!in.prefix.empty()) {
      if (!mala_bench::load_real_input(in.prefix, &r)) return 1;
      n = r.n, B = 1, hq = r.heads_q, hkv = r.heads_kv, d = r.head_dim;
      std::printf("real input %s: N=%lld Hq=%lld Hkv=%lld d=%lld, dO ~ N(0, 1) (seed %llu)\n", in.prefix.c_str(),
                  (long long)n, (long long)hq, (long long)hkv, (long long)d, (unsigned long long)opt.seed);
    }
    // Real inputs take dO from the random regime (the backward's test reads only the lse) and
    // replace its Q, K, V with the captured ones.
    std::vector<float> q(static_cast<size_t>(B * n * hq * d)), dout(q.size());
    std::vector<float> k(static_cast<size_t>(B * n * hkv * d)), v(k.size());
    const mala::WorkloadSpec w{in.prefix.empty() ? regime : "random", B, n, hq, hkv, d, sharp, opt.seed};
    mala::Status s = mala::make_workload(w, q.data(), k.data(), v.data(), dout.data());
    if (!s) {
      std::printf("workload: %s\n", s.message.c_str());
      return 1;
    }
    if (!in.prefix.empty()) q = std::move(r.q), k = std::move(r.k), v = std::move(r.v);
    const size_t nq_el = q.size(), nk_el = k.size();
    DevMem gq(nq_el * 2), gk(nk_el * 2), gv(nk_el * 2), gdo(nq_el * 2), gdq(nq_el * 2), gdk(nk_el * 2),
        gdv(nk_el * 2);
    DevMem gslots(static_cast<size_t>(B * hq * n) * 4);
    mala_bench::upload_converted(q.data(), nq_el, opt.dtype, gq.p);
    mala_bench::upload_converted(dout.data(), nq_el, opt.dtype, gdo.p);
    mala_bench::upload_converted(k.data(), nk_el, opt.dtype, gk.p);
    mala_bench::upload_converted(v.data(), nk_el, opt.dtype, gv.p);
    q.clear(); q.shrink_to_fit();
    dout.clear(); dout.shrink_to_fit();
    const double flops = 2.5 * mala_bench::forward_flops(B, n, n, hq, d, opt.causal);
    // One workspace for every tau of this shape: the fp32 dQ accumulator in it takes red.global.add
    // traffic, and its placement alone moved the backward by up to 12% on the H100 (48K: 37 vs 42
    // ms, alternating between consecutive allocations), so tau = 0 and tau > 0 share it.
    DevMem ws;
    // Per tau: its own O and lse (from our forward at that tau), the arguments, the realized work.
    struct PerTau {
      float tau;
      DevMem o, lse, fmask;
      mala::BackwardArgs a;
      mala::Distribution sd;
      double kept;
    };
    std::vector<PerTau> runs(opt.tau.size());
    for (size_t ti = 0; ti < opt.tau.size(); ++ti) {
      PerTau& run = runs[ti];
      const float tau = run.tau = opt.tau[ti];
      run.o.alloc(nq_el * 2);
      run.lse.alloc(static_cast<size_t>(B * hq * n) * 4);
      mala::ForwardArgs f;
      f.device = mala::Device::cuda;
      f.dtype = opt.dtype;
      f.q = gq.p;
      f.k = gk.p;
      f.v = gv.p;
      f.o = run.o.p;
      f.lse = run.lse.as<float>();
      f.batch = B;
      f.seqlen_q = f.seqlen_k = n;
      f.heads_q = hq;
      f.heads_kv = hkv;
      f.head_dim = d;
      f.causal = opt.causal;
      f.tau = tau;
      mala::Tiles ft{};
      if (opt.fwd_mask && tau > 0.f) {
        ft = mala::forward_tiles(f);
        run.fmask.alloc(static_cast<size_t>(B * hq * ((n + ft.block_q - 1) / ft.block_q) *
                                            ((n + ft.block_k - 1) / ft.block_k)));
        f.tile_mask = run.fmask.as<uint8_t>();
      }
      s = mala::forward(f);
      if (!s) {
        std::printf("forward (needed for O, lse): %s\n", s.message.c_str());
        return 1;
      }
      mala::BackwardArgs& a = run.a;
      a.device = mala::Device::cuda;
      a.dtype = opt.dtype;
      a.q = gq.p;
      a.k = gk.p;
      a.v = gv.p;
      a.o = run.o.p;
      a.dout = gdo.p;
      a.lse = run.lse.as<float>();
      a.dq = gdq.p;
      a.dk = gdk.p;
      a.dv = gdv.p;
      a.batch = B;
      a.seqlen_q = a.seqlen_k = n;
      a.heads_q = hq;
      a.heads_kv = hkv;
      a.head_dim = d;
      a.causal = opt.causal;
      a.tau = tau;
      a.deterministic = opt.deterministic;
      if (f.tile_mask) {
        a.forward_tile_mask = f.tile_mask;
        a.forward_block_q = ft.block_q;
        a.forward_block_k = ft.block_k;
      }
      const size_t ws_need = mala::backward_workspace_size(a);
      if (ws.bytes < ws_need) ws.alloc(ws_need);
      // Realized work (untimed call with the counters on).
      const mala::Tiles t = mala::backward_tiles(a);
      const int64_t nqt = (n + t.block_q - 1) / t.block_q, nkt = (n + t.block_k - 1) / t.block_k;
      const int64_t mask_n = B * hq * nqt * nkt;
      DevMem gmask(static_cast<size_t>(mask_n));
      mala::BackwardArgs ac = a;
      ac.workspace = ws.p;
      ac.workspace_bytes = ws.bytes;
      ac.bwd_slots = gslots.as<int32_t>();
      ac.tile_mask = gmask.as<uint8_t>();
      s = mala::backward(ac);
      if (!s) {
        std::printf("backward: %s\n", s.message.c_str());
        return 1;
      }
      BENCH_CUDA(cudaDeviceSynchronize());
      std::vector<int32_t> slots(static_cast<size_t>(B * hq * n));
      std::vector<uint8_t> mask(static_cast<size_t>(mask_n));
      BENCH_CUDA(cudaMemcpy(slots.data(), gslots.p, slots.size() * 4, cudaMemcpyDeviceToHost));
      BENCH_CUDA(cudaMemcpy(mask.data(), gmask.p, mask.size(), cudaMemcpyDeviceToHost));
      run.sd = mala::slot_stats(slots.data(), B, hq, n, n, opt.causal);
      run.kept = mala::retained_fraction(mask.data(), mask_n);
    }
    // All taus share one workspace (allocated above to the largest need).
    for (PerTau& run : runs) run.a.workspace = ws.p, run.a.workspace_bytes = ws.bytes;
    // Timing: each tau on its own, or (--interleave) the taus alternating within each iteration, so
    // that clock and thermal drift fall on all of them alike.
    Options topt = opt;
    topt.iters = std::max(3, n >= 65536 ? std::min(opt.iters, 10) : opt.iters);
    std::vector<std::function<void(cudaStream_t)>> calls;
    for (PerTau& run : runs)
      calls.push_back([&run](cudaStream_t st) {
        mala::BackwardArgs a = run.a;
        a.stream = st;
        mala::Status bs = mala::backward(a);
        if (!bs) {
          std::printf("backward: %s\n", bs.message.c_str());
          std::exit(1);
        }
      });
    std::vector<double> times;
    if (opt.interleave) {
      times = mala_bench::time_medians_interleaved(topt, calls);
    } else {
      for (auto& c : calls) times.push_back(mala_bench::time_median_ms(topt, c));
    }
    double t0_ms = 0;
    for (size_t ti = 0; ti < runs.size(); ++ti)
      if (runs[ti].tau == 0.f) t0_ms = times[ti];
    for (size_t ti = 0; ti < runs.size(); ++ti) {
      const PerTau& run = runs[ti];
      const double ms = times[ti];
      char ratio[32] = "-";
      if (t0_ms > 0 && run.tau != 0.f) std::snprintf(ratio, sizeof ratio, "%.2fx", t0_ms / ms);
      std::printf("%-10s %5.1f %6s %4g %10.3f %8.1f %10.1f %8.2f%% %9s\n", regime.c_str(), sharp,
                  mala_bench::fmt_n(n).c_str(), run.tau, ms, flops / (ms * 1e-3) / 1e12, run.sd.mean,
                  100.0 * run.kept, ratio);
      std::fflush(stdout);
    }
  }
  return rc;
}
