// Forward benchmark (issue 3) and the shared bench helpers declared in bench.h.
//
// For each N, input regime (random; synthetic at each sharpness) and tau: one untimed call with
// lse/fwd_slots/tile_mask to measure the realized work (mean post-score slots per query, retained
// fraction of legal tiles, omitted mass vs our tau = 0 lse), then the timed calls (no optional
// outputs; with --interleave the taus of one input alternate within each timed iteration, so clock
// drift at the power limit does not favour the tau timed first).  TFLOP/s use the dense causal
// count 4 * sum_q L_q * d * Hq (the same count for every tau, so they are "effective" TFLOP/s for
// tau > 0); speedup is against our tau = 0 on the same inputs.  --fwd-mask: the timed calls at
// tau > 0 also record the tile mask, as autograd's forward does when the backward reads it.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench.h"
#include "npy.h"


namespace mala_bench {

namespace {

template <typename T>
__global__ void convert_kernel(const float* __restrict__ in, T* __restrict__ out, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (; i < n; i += stride) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) out[i] = __float2bfloat16_rn(in[i]);
    else out[i] = __float2half_rn(in[i]);
  }
}

float* flush_buffer(size_t* bytes) {
  static float* buf = nullptr;
  static const size_t kBytes = 256ull << 20;
  if (!buf) BENCH_CUDA(cudaMalloc(&buf, kBytes));
  *bytes = kBytes;
  return reinterpret_cast<float*>(buf);
}


// Runs the forward.  Prints and exits on failure.
void run_fwd(const Options& opt, const mala::ForwardArgs& a, int* bq, int* bk) {
  (void)opt;
  mala::Tiles t = mala::forward_tiles(a);
  *bq = t.block_q, *bk = t.block_k;
  mala::Status s = mala::forward(a);
  if (!s.ok) {
    std::fprintf(stderr, "forward failed: %s\n", s.message.c_str());
    std::exit(1);
  }
}

}  // namespace

void upload_converted(const float* host, size_t n, mala::DType dtype, void* dev) {
  const size_t chunk = 64ull << 20;  // elements per staging copy
  float* staging = nullptr;
  BENCH_CUDA(cudaMalloc(&staging, std::min(n, chunk) * sizeof(float)));
  for (size_t off = 0; off < n; off += chunk) {
    size_t m = std::min(chunk, n - off);
    BENCH_CUDA(cudaMemcpy(staging, host + off, m * sizeof(float), cudaMemcpyHostToDevice));
    if (dtype == mala::DType::bf16)
      convert_kernel<<<1024, 256>>>(staging, static_cast<__nv_bfloat16*>(dev) + off, m);
    else if (dtype == mala::DType::f16)
      convert_kernel<<<1024, 256>>>(staging, static_cast<__half*>(dev) + off, m);
    else
      BENCH_CUDA(cudaMemcpy(static_cast<float*>(dev) + off, staging, m * 4, cudaMemcpyDeviceToDevice));
    BENCH_CUDA(cudaGetLastError());
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  cudaFree(staging);
}

bool make_device_workload(const Options& opt, const std::string& regime, double sharpness, int64_t seqlen,
                          bool with_dout, Workload* w) {
  mala::WorkloadSpec& s = w->spec;
  s.regime = regime;
  s.batch = opt.batch, s.seqlen = seqlen, s.heads_q = opt.heads_q, s.heads_kv = opt.heads_kv;
  s.head_dim = opt.head_dim, s.sharpness = sharpness, s.seed = opt.seed;
  const size_t nq = (size_t)s.batch * seqlen * s.heads_q * s.head_dim;
  const size_t nk = (size_t)s.batch * seqlen * s.heads_kv * s.head_dim;
  std::vector<float> q(nq), k(nk), v(nk), dout(with_dout ? nq : 0);
  mala::Status st = mala::make_workload(s, q.data(), k.data(), v.data(), with_dout ? dout.data() : nullptr);
  if (!st.ok) {
    std::fprintf(stderr, "make_workload: %s\n", st.message.c_str());
    return false;
  }
  const size_t es = mala::dtype_size(opt.dtype);
  w->q.alloc(nq * es), w->k.alloc(nk * es), w->v.alloc(nk * es);
  upload_converted(q.data(), nq, opt.dtype, w->q.p);
  upload_converted(k.data(), nk, opt.dtype, w->k.p);
  upload_converted(v.data(), nk, opt.dtype, w->v.p);
  if (with_dout) {
    w->dout.alloc(nq * es);
    upload_converted(dout.data(), nq, opt.dtype, w->dout.p);
  }
  return true;
}

std::vector<double> time_medians_interleaved(const Options& opt,
                                             const std::vector<std::function<void(cudaStream_t)>>& fns) {
  static cudaStream_t stream = nullptr;
  static cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (!stream) {
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
  }
  size_t fb = 0;
  float* flush = flush_buffer(&fb);
  for (const auto& fn : fns)
    for (int i = 0; i < opt.warmup; ++i) fn(stream);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<std::vector<float>> ms(fns.size());
  for (int i = 0; i < std::max(opt.iters, 1); ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      if (opt.flush_l2) BENCH_CUDA(cudaMemsetAsync(flush, i & 0xff, fb, stream));
      BENCH_CUDA(cudaEventRecord(e0, stream));
      fns[f](stream);
      BENCH_CUDA(cudaEventRecord(e1, stream));
      BENCH_CUDA(cudaEventSynchronize(e1));
      float t = 0;
      BENCH_CUDA(cudaEventElapsedTime(&t, e0, e1));
      ms[f].push_back(t);
    }
  }
  BENCH_CUDA(cudaGetLastError());
  std::vector<double> med;
  for (auto& v : ms) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

double time_median_ms(const Options& opt, const std::function<void(cudaStream_t)>& fn) {
  return time_medians_interleaved(opt, {fn})[0];
}

// One input (its device workload already uploaded): realized work per tau, timings, rows.
int run_forward_input(const Options& opt, int64_t n, const std::string& label, double sharp, const Workload& w) {
  const int64_t B = opt.batch, hq = opt.heads_q, hkv = opt.heads_kv, d = opt.head_dim;
  const double flops = forward_flops(B, n, n, hq, d, opt.causal);
  const size_t es = mala::dtype_size(opt.dtype);
  DevMem o((size_t)B * n * hq * d * es), lse((size_t)B * hq * n * 4), lse0((size_t)B * hq * n * 4),
      slots((size_t)B * hq * n * 4);
  mala::ForwardArgs a;
  a.device = mala::Device::cuda;
  a.dtype = opt.dtype;
  a.q = w.q.p, a.k = w.k.p, a.v = w.v.p, a.o = o.p;
  a.batch = B, a.seqlen_q = n, a.seqlen_k = n, a.heads_q = hq, a.heads_kv = hkv, a.head_dim = d;
  a.causal = opt.causal;
  // --varlen: the same memory as one packed sequence ([n, heads, d]; lse [heads, n] is then the
  // padded layout too, at batch 1).
  DevMem cu(opt.varlen ? 2 * sizeof(int32_t) : 0);
  if (opt.varlen) {
    const int32_t offsets[2] = {0, (int32_t)n};
    BENCH_CUDA(cudaMemcpy(cu.p, offsets, sizeof offsets, cudaMemcpyHostToDevice));
    a.cu_seqlens_q = a.cu_seqlens_k = cu.as<int32_t>();
    a.total_k = n;
  }

  // Dense lse for the omitted mass.
  {
    mala::ForwardArgs a0 = a;
    a0.tau = 0.f;
    a0.lse = lse0.as<float>();
    int bq, bk;
    run_fwd(opt, a0, &bq, &bk);
    BENCH_CUDA(cudaDeviceSynchronize());
  }
  std::vector<float> lse_dense((size_t)B * hq * n);
  BENCH_CUDA(cudaMemcpy(lse_dense.data(), lse0.p, lse_dense.size() * 4, cudaMemcpyDeviceToHost));

  // Per tau: realized work first (untimed), then the timings (one after the other, or
  // alternating with --interleave), then the rows.
  struct Row {
    float tau;
    int bq, bk;
    mala::Distribution sd, om;
    double ret;
    std::function<void(cudaStream_t)> call;
  };
  std::vector<Row> rows;
  std::vector<std::shared_ptr<DevMem>> timed_masks;  // --fwd-mask: what the timed calls record into
  for (float tau : opt.tau) {
    int bq = 0, bk = 0;
    mala::ForwardArgs ar = a;
    ar.tau = tau;
    // Realized work (untimed call with the optional outputs).
    {
      mala::Tiles t = mala::forward_tiles(ar);
      bq = t.block_q, bk = t.block_k;
    }
    const int64_t nqt = (n + bq - 1) / bq, nkt = (n + bk - 1) / bk;
    DevMem mask((size_t)B * hq * nqt * nkt);
    mala::ForwardArgs aw = ar;
    aw.lse = lse.as<float>(), aw.fwd_slots = slots.as<int32_t>(), aw.tile_mask = mask.as<uint8_t>();
    run_fwd(opt, aw, &bq, &bk);
    BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<int32_t> hs((size_t)B * hq * n);
    std::vector<float> hl(hs.size());
    std::vector<uint8_t> hm(mask.bytes);
    BENCH_CUDA(cudaMemcpy(hs.data(), slots.p, hs.size() * 4, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hl.data(), lse.p, hl.size() * 4, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hm.data(), mask.p, hm.size(), cudaMemcpyDeviceToHost));
    const mala::Distribution sd = mala::slot_stats(hs.data(), B, hq, n, n, opt.causal);
    const double ret = mala::retained_fraction(hm.data(), (int64_t)hm.size());
    const mala::Distribution om = mala::omitted_mass(hl.data(), lse_dense.data(), (int64_t)hl.size());

    mala::ForwardArgs ar_timed = ar;
    if (opt.fwd_mask && tau > 0.f) {
      timed_masks.push_back(std::make_shared<DevMem>(mask.bytes));
      ar_timed.tile_mask = timed_masks.back()->as<uint8_t>();
    }
    rows.push_back({tau, bq, bk, sd, om, ret, [&opt, ar = ar_timed](cudaStream_t s) {
                      mala::ForwardArgs at = ar;
                      at.stream = s;
                      int x, y;
                      run_fwd(opt, at, &x, &y);
                    }});
  }
  std::vector<double> times;
  if (opt.interleave) {
    std::vector<std::function<void(cudaStream_t)>> calls;
    for (const Row& r : rows) calls.push_back(r.call);
    times = time_medians_interleaved(opt, calls);
  } else {
    for (const Row& r : rows) times.push_back(time_median_ms(opt, r.call));
  }
  double t_tau0 = -1;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double ms = times[i];
    if (r.tau == 0.f) t_tau0 = ms;
    char ratio[32] = "-";
    if (t_tau0 > 0) std::snprintf(ratio, sizeof ratio, "%.3fx", t_tau0 / ms);
    char tiles[16];
    std::snprintf(tiles, sizeof tiles, "%dx%d", r.bq, r.bk);
    std::printf("%6s %-10s %5.1f %5.2f %6s %10.3f %8.1f %8s %9.1f %8.2f %10.2e %10.2e\n", fmt_n(n).c_str(),
                label.c_str(), sharp, r.tau, tiles, ms, flops / (ms * 1e-3) / 1e12, ratio, r.sd.mean,
                100.0 * r.ret, r.om.mean, r.om.max);
  }
  std::fflush(stdout);
  return 0;
}

bool load_real_input(const std::string& prefix, RealInput* out) {
  mala::npy::Array a[3];
  const char* names[3] = {"_q.npy", "_k.npy", "_v.npy"};
  for (int i = 0; i < 3; ++i) {
    mala::Status st = mala::npy::read(prefix + names[i], &a[i]);
    if (!st.ok || a[i].shape.size() != 3) {
      std::fprintf(stderr, "--real %s%s: %s\n", prefix.c_str(), names[i],
                   st.ok ? ("expected [N, H, d], got " + a[i].shape_string()).c_str() : st.message.c_str());
      return false;
    }
  }
  out->n = a[0].shape[0], out->heads_q = a[0].shape[1], out->heads_kv = a[1].shape[1], out->head_dim = a[0].shape[2];
  if (a[1].shape != a[2].shape || a[1].shape[0] != out->n || a[1].shape[2] != out->head_dim ||
      out->heads_q % out->heads_kv) {
    std::fprintf(stderr, "--real %s: inconsistent shapes q %s k %s v %s\n", prefix.c_str(), a[0].shape_string().c_str(),
                 a[1].shape_string().c_str(), a[2].shape_string().c_str());
    return false;
  }
  out->q = mala::npy::to_float(a[0]), out->k = mala::npy::to_float(a[1]), out->v = mala::npy::to_float(a[2]);
  return true;
}

// --real PREFIX: the forward on a captured input; the shape comes from the files.
int run_forward_real(const Options& opt, const std::string& prefix) {
  RealInput r;
  if (!load_real_input(prefix, &r)) return 1;
  Options o = opt;
  o.batch = 1, o.heads_q = r.heads_q, o.heads_kv = r.heads_kv, o.head_dim = r.head_dim;
  std::printf("   real input %s: N=%lld Hq=%lld Hkv=%lld d=%lld\n", prefix.c_str(), (long long)r.n,
              (long long)o.heads_q, (long long)o.heads_kv, (long long)o.head_dim);
  Workload w;
  const size_t es = mala::dtype_size(o.dtype);
  const std::vector<float>* src[3] = {&r.q, &r.k, &r.v};
  DevMem* dst[3] = {&w.q, &w.k, &w.v};
  for (int i = 0; i < 3; ++i) {
    dst[i]->alloc(src[i]->size() * es);
    upload_converted(src[i]->data(), src[i]->size(), o.dtype, dst[i]->p);
  }
  return run_forward_input(o, r.n, "real", 0.0, w);
}

int run_forward_bench(const Options& opt) {
  const int64_t B = opt.batch, hq = opt.heads_q, hkv = opt.heads_kv, d = opt.head_dim;
  char shape[96] = "shapes from the --real files";
  if (opt.real.empty())
    std::snprintf(shape, sizeof shape, "B=%lld Hq=%lld Hkv=%lld d=%lld", (long long)B, (long long)hq, (long long)hkv,
                  (long long)d);
  std::printf("\n== forward: %s %s %s, median of %d (warm-up %d)%s, L2 %s\n", shape, mala::dtype_name(opt.dtype),
              opt.causal ? "causal" : "non-causal", opt.iters, opt.warmup,
              opt.interleave ? ", taus interleaved" : "", opt.flush_l2 ? "flushed" : "warm");
  if (opt.varlen) {
    if (B != 1 || !opt.real.empty()) {
      std::fprintf(stderr, "mala_bench: --varlen takes batch 1 and the generated regimes\n");
      return 2;
    }
    std::printf("   varlen: one packed sequence (cu_seqlens on the device, total_k given)\n");
  }
  std::printf("%6s %-10s %5s %5s %6s %10s %8s %8s %9s %8s %10s %10s\n", "N", "regime", "sharp", "tau", "tiles",
              "ms", "TFLOP/s", "vs_tau0", "slots/q", "retain%", "omit_mean", "omit_max");
  if (!opt.real.empty()) {
    for (const std::string& prefix : opt.real)
      if (run_forward_real(opt, prefix) != 0) return 1;
    return 0;
  }
  std::vector<std::pair<std::string, double>> inputs;
  for (const auto& r : opt.regimes) {
    if (r == "synthetic")
      for (double s : opt.sharpness) inputs.push_back({r, s});
    else
      inputs.push_back({r, 0.0});
  }
  for (int64_t n : opt.n) {
    for (const auto& in : inputs) {
      Workload w;
      if (!make_device_workload(opt, in.first, in.second, n, false, &w)) return 1;
      if (run_forward_input(opt, n, in.first, in.second, w) != 0) return 1;
    }
  }
  return 0;
}

}  // namespace mala_bench
