// Shared pieces of the mala benchmark (mala_bench): options, workload setup on the device, the
// timing helper, FLOP counts.  bench_main.cpp parses the flags and calls run_*_bench; each op lives in
// its own file (bench_forward.cu, bench_backward.cu, bench_decode.cu).
//
// Protocol (docs/benchmarks.md, "Protocol"): CUDA events around each call, warm-up first, median of
// >= 20 calls, the L2 cache flushed (a 256 MB memset) before every timed call, one device, one run;
// every MALA timing is printed next to its realized mean post-score slots per query and retained
// fraction, and ratios are to our own tau = 0 in the same run.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "cuda/backend.h"
#include "mala/mala.h"

namespace mala_bench {

struct Options {
  std::string op = "fwd";                                // fwd | bwd | decode | all
  std::vector<int64_t> n = {1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
  std::vector<float> tau = {0.f, 1.f};
  std::vector<std::string> regimes = {"random", "synthetic"};
  std::vector<double> sharpness = {1.0, 4.0, 16.0};     // synthetic only
  int64_t batch = 1, heads_q = 8, heads_kv = 1, head_dim = 128;
  mala::DType dtype = mala::DType::bf16;
  bool causal = true;
  int iters = 20, warmup = 3;
  bool flush_l2 = true;
  uint64_t seed = 0;
  std::vector<int64_t> decode_batch = {1, 8};            // decode only
  // Kernel override (src/cuda/backend.h): --fwd-kernel, --bwd-kernel, --decode-kernel,
  // --bwd-q-stages, --bwd-head-splits; set for the whole run by main.
  mala::cuda_backend::KernelOverride kernels;
  bool check = false;                                    // also compare with the CPU (small N only)
  bool deterministic = false;                            // backward: BackwardArgs::deterministic
  // backward: pass the forward's tile mask (BackwardArgs::forward_tile_mask; the forward that makes
  // O and lse records it, untimed)
  bool fwd_mask = false;
  // Forward: time the taus of one input in alternation (tau_a, tau_b, tau_a, ... per iteration)
  // instead of one after the other, so GPU clock drift (power limit, heating) does not favour
  // whichever tau runs first.
  bool interleave = false;
  // Forward and backward: captured real inputs instead of the generated regimes
  // (lab/real/capture_qkv.py): one file prefix per input, PREFIX_{q,k,v}.npy.
  std::vector<std::string> real;
  // Forward: pass the input as varlen (one packed sequence, cu_seqlens on the device, total_k
  // given), to time the varlen path against the padded one.
  bool varlen = false;
};

#define BENCH_CUDA(expr)                                                                         \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

// A device allocation freed on scope exit.
struct DevMem {
  void* p = nullptr;
  size_t bytes = 0;
  DevMem() = default;
  explicit DevMem(size_t n) { alloc(n); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  ~DevMem() { if (p) cudaFree(p); }
  void alloc(size_t n) {
    if (p) cudaFree(p);
    p = nullptr;
    bytes = n;
    if (n) BENCH_CUDA(cudaMalloc(&p, n));
  }
  template <typename T> T* as() const { return static_cast<T*>(p); }
};

// q, k, v (and optionally dout) of a built-in workload (mala::make_workload: "random" or
// "synthetic" with a sharpness), converted to opt.dtype on the device.  Contiguous
// [batch, seqlen, heads, head_dim].
struct Workload {
  mala::WorkloadSpec spec;
  DevMem q, k, v, dout;
};
// Defined in bench_forward.cu.  Returns false (and prints why) on failure.
bool make_device_workload(const Options& opt, const std::string& regime, double sharpness, int64_t seqlen,
                          bool with_dout, Workload* w);
// A captured real input (--real PREFIX: PREFIX_{q,k,v}.npy, [N, H, d], lab/real/capture_qkv.py),
// widened to fp32.  Prints the reason and returns false on a missing or inconsistent file.
struct RealInput {
  int64_t n = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  std::vector<float> q, k, v;
};
bool load_real_input(const std::string& prefix, RealInput* out);
// fp32 host -> dtype device conversion (on the GPU).  Defined in bench_forward.cu.
void upload_converted(const float* host, size_t n, mala::DType dtype, void* dev);

// Median milliseconds of fn(stream) over opt.iters timed calls after opt.warmup untimed ones, each
// preceded (outside the timed region) by an L2 flush when opt.flush_l2.  Defined in bench_forward.cu.
double time_median_ms(const Options& opt, const std::function<void(cudaStream_t)>& fn);
// Medians of several calls timed in alternation: each iteration runs every fn once, in order.
std::vector<double> time_medians_interleaved(const Options& opt,
                                             const std::vector<std::function<void(cudaStream_t)>>& fns);

// Dense causal (or full) forward FLOPs: 4 * sum over rows of visible keys * d * Hq * batch.
inline double forward_flops(int64_t batch, int64_t nq, int64_t nk, int64_t hq, int64_t d, bool causal) {
  double keys = 0;
  if (causal) {
    for (int64_t r = 0; r < nq; ++r) {
      int64_t L = r + nk - nq + 1;
      keys += static_cast<double>(L < 0 ? 0 : (L > nk ? nk : L));
    }
  } else {
    keys = static_cast<double>(nq) * nk;
  }
  return 4.0 * keys * static_cast<double>(d) * hq * batch;
}

inline std::string fmt_n(int64_t n) {
  if (n % 1024 == 0) return std::to_string(n / 1024) + "K";
  return std::to_string(n);
}

inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}
inline int64_t parse_len(const std::string& s) {  // "4096", "4K", "128k"
  if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) return std::stoll(s.substr(0, s.size() - 1)) * 1024;
  return std::stoll(s);
}

// Flags shared by all ops (unknown flags are left for the op's own parser: decode's --quick, --sweep,
// --profile, --no-synthetic, --overhead; see bench_decode.cu):
//   --op fwd|bwd|decode|all   --n 1K,4K,...   --tau 0,1   --regime random,synthetic
//   --sharpness 1,4,16   --batch B   --hq H   --hkv H   --d D   --dtype bf16|fp16   --noncausal
//   --iters N   --warmup N   --no-flush   --seed S   --decode-batch 1,8   --check
//   --interleave   --real PREFIX,...   --varlen (forward, batch 1)   --deterministic (backward)
//   --fwd-mask (backward: with the forward's tile mask; forward: tau > 0 calls record it, as
//               autograd's forward does where the backward reads it)
//   --fwd-kernel auto|mma_sync   --bwd-kernel auto|mma_sync
//   --decode-kernel auto|small_smem   --bwd-q-stages 2|3   --bwd-head-splits S
//   (the kernel override, for comparing kernels on one device)
inline Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--op") o.op = next();
    else if (a == "--n") { o.n.clear(); for (auto& x : split_list(next())) o.n.push_back(parse_len(x)); }
    else if (a == "--tau") { o.tau.clear(); for (auto& x : split_list(next())) o.tau.push_back(std::stof(x)); }
    else if (a == "--regime") o.regimes = split_list(next());
    else if (a == "--sharpness") { o.sharpness.clear(); for (auto& x : split_list(next())) o.sharpness.push_back(std::stod(x)); }
    else if (a == "--batch") o.batch = std::stoll(next());
    else if (a == "--hq") o.heads_q = std::stoll(next());
    else if (a == "--hkv") o.heads_kv = std::stoll(next());
    else if (a == "--d") o.head_dim = std::stoll(next());
    else if (a == "--dtype") o.dtype = next() == "fp16" ? mala::DType::f16 : mala::DType::bf16;
    else if (a == "--noncausal") o.causal = false;
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--no-flush") o.flush_l2 = false;
    else if (a == "--seed") o.seed = std::stoull(next());
    else if (a == "--decode-batch") { o.decode_batch.clear(); for (auto& x : split_list(next())) o.decode_batch.push_back(std::stoll(x)); }
    else if (a == "--fwd-kernel" || a == "--bwd-kernel" || a == "--decode-kernel") {
      const std::string v = next();
      const bool ok = a == "--fwd-kernel"   ? mala::cuda_backend::parse_variant(v, &o.kernels.fwd)
                      : a == "--bwd-kernel" ? mala::cuda_backend::parse_variant(v, &o.kernels.bwd)
                                            : mala::cuda_backend::parse_variant(v, &o.kernels.decode);
      if (!ok) {
        std::fprintf(stderr, "mala_bench: unknown %s %s\n", a.c_str(), v.c_str());
        std::exit(2);
      }
    }
    else if (a == "--bwd-q-stages") o.kernels.bwd_q_stages = std::stoi(next());
    else if (a == "--bwd-head-splits") o.kernels.bwd_head_splits = std::stoi(next());
    else if (a == "--check") o.check = true;
    else if (a == "--deterministic") o.deterministic = true;
    else if (a == "--fwd-mask") o.fwd_mask = true;
    else if (a == "--interleave") o.interleave = true;
    else if (a == "--real") o.real = split_list(next());
    else if (a == "--varlen") o.varlen = true;
  }
  return o;
}

int run_forward_bench(const Options& opt);

}  // namespace mala_bench

// The backward and decode benches take the raw flags (parse_options above reads the shared ones).
// bench_main.cpp provides weak "not built" fallbacks so mala_bench always links.
int run_backward_bench(int argc, char** argv);
int run_decode_bench(int argc, char** argv);
