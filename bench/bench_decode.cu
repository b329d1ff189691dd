// Decode benchmark (issue 4): mala::decode on the GPU, 1 query token per sequence against a KV cache
// of N keys, Hq = 8, Hkv = 1, d = 128, bf16, batch 1 and 8, tau = 0 and 1, random and synthetic inputs.
//
// Timing: CUDA events around one decode call, preceded (outside the events) by a kernel that reads
// 256 MiB (evicts L2, leaves no dirty lines), median of `iters` runs after warm-up.  The workspace
// is preallocated.
// tau = 1 runs under both split rules (DecodeArgs::split_rule): seeded (the default) and per_split.
// Every MALA timing prints the realized retained fraction of legal tiles (from tile_mask, in a
// separate untimed call), the realized slots (mean fwd_slots per row: retained tiles * block_k), the
// mean omitted mass (vs our tau = 0 lse of the same inputs), and the memory floor: (bytes of K +
// retained V) / copy bandwidth, the bandwidth measured here with a 1 GiB cudaMemcpy D2D counting
// read + write.
//
// Inputs:
//   random    : q, K, V ~ N(0, 1) (device-generated).
//   synthetic : mala::make_workload(regime "synthetic", sharpness s) for one sequence of 128K tokens
//               per batch entry (seed = batch index); a decode at N uses the workload's keys [0, N)
//               and its query row N-1 (the token at position N-1 sees every key).  Larger s: sharper
//               attention (locality, a sink, planted needles), fewer retained tiles.
//   recency   : score(q, key pos) ~ -slope * (N-1-pos)/128 + N(0,1) nats (see apply_recency): the
//               last query attends sharply to the newest keys (slopes 2 and 16; --quick and
//               --profile: 16 only).  Under per_split each split keeps its
//               own normalizer, so a tile is skipped only when it is ~log(L) nats below what its own
//               split has retained: homogeneous far context is retained; a ramp is skipped.  Seeded
//               splits also count the newest tile's mass, so far context is skipped too.
//   patchy    : random scores with one key tile in three (scattered) 30 nats lower (see apply_patchy):
//               about two thirds of the tiles retained, like the real model's 32K cache.
// Each N uses a cache of capacity N (the kernel's split heuristic depends on the capacity only).
//
// Measured: docs/kernels.md ("Decode"), bench/results/mala_bench_decode_h200.log.
// Entry point: run_decode_bench(argc, argv) (called by bench_main.cpp); flags: --quick (fewer
// lengths / runs), --sweep (num_splits sweep at the largest N), --overhead (batch-1 fixed costs
// only: empty kernels, a plain kernel streaming the same K+V bytes, the split kernel's (K, V) tile
// stream without compute, calls back to back over 8 rotated caches (eager and in one CUDA graph),
// decode at several split counts).
// Built with -DMALA_DECODE_BENCH_MAIN it has its own main().
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/backend.h"
#include "mala/mala.h"

namespace {

#define BENCH_CHECK(expr)                                                                      \
  do {                                                                                         \
    cudaError_t e_ = (expr);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_normal_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint64_t h = mix64(seed ^ mix64(static_cast<uint64_t>(i)));
    const float u1 = ((h >> 40) + 0.5f) * (1.0f / 16777216.0f);
    const float u2 = ((h & 0xFFFFFF) + 0.5f) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16_rn(sqrtf(-2.f * logf(u1)) * cosf(6.2831853f * u2));
  }
}

// "recency" input: score(q, key pos) ~ -slope * (N - 1 - pos) / 128 + N(0, 1) nats: a ramp of
// `slope` nats per 128-key tile towards the newest key (a sharp sliding-window-like head).
// q[.., 0] = sqrt(d), K[.., pos, 0] = the ramp, all other entries N(0, 1) (K, V already filled).
__global__ void apply_recency(__nv_bfloat16* q, __nv_bfloat16* k, int64_t batch, int64_t n, int64_t cap_stride,
                              int hq, int d, float slope) {
  const int64_t total = batch * n;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / n, pos = i % n;
    k[(b * cap_stride + pos) * d] = __float2bfloat16_rn(-slope * static_cast<float>(n - 1 - pos) / 128.f);
  }
  if (blockIdx.x == 0)
    for (int64_t i = threadIdx.x; i < batch * hq; i += blockDim.x) q[i * d] = __float2bfloat16_rn(sqrtf((float)d));
}

// "patchy" input: random scores, except that one key tile in three (a fixed hash of the tile index;
// never tile 0 or the newest, the seeded rule's anchors) sits 30 nats lower, far below the
// threshold: about two thirds of the tiles are retained, the skipped ones scattered, as in the
// real model's 32K cache (65-68% kept in layers 0 and 14).  q[.., 0] = sqrt(d), K[.., pos, 0] = 0
// or -30, all other entries N(0, 1).
__global__ void apply_patchy(__nv_bfloat16* q, __nv_bfloat16* k, int64_t batch, int64_t n, int64_t cap_stride, int hq,
                             int d, int block_k) {
  const int64_t total = batch * n;
  const int64_t last = (n - 1) / block_k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / n, pos = i % n, t = pos / block_k;
    const bool low = t != 0 && t != last && ((static_cast<uint32_t>(t) * 2654435761u) >> 16) % 3 == 0;
    k[(b * cap_stride + pos) * d] = __float2bfloat16_rn(low ? -30.f : 0.f);
  }
  if (blockIdx.x == 0)
    for (int64_t i = threadIdx.x; i < batch * hq; i += blockDim.x) q[i * d] = __float2bfloat16_rn(sqrtf((float)d));
}

std::vector<uint16_t> to_bf16(const float* x, size_t n) {
  std::vector<uint16_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    __nv_bfloat16 h = __float2bfloat16_rn(x[i]);
    std::memcpy(&out[i], &h, 2);
  }
  return out;
}

// Reads the whole buffer (evicts L2 and leaves it clean; a memset would leave dirty lines whose
// write-back would be charged to the next kernel).
__global__ void flush_l2(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) *sink = x;
}

__global__ void empty_kernel() {}

// The dependent half of the empty-kernel pair: launched with programmatic stream serialization,
// it waits for its primary like decode's combine kernel does.
__global__ void empty_dependent_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Streams two buffers once (16-byte loads, L2-bypassing like the decode tiles): the time the bytes
// of one decode take with nothing else to do, launch included.
__global__ void stream_read(const uint4* a, const uint4* b, int64_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint4 u = __ldcg(a + i), v = __ldcg(b + i);
    x ^= u.x ^ u.w ^ v.y ^ v.z;
  }
  if (x == 0x12345678u) *sink = x;
}

// The decode split kernel's memory pattern without its compute: one CTA of 128 threads per split,
// (K, V) tile pairs of 128 x 128 bf16 through a 3-stage cp.async ring.  strided = 0: split c owns
// tiles [c*per, (c+1)*per) (rule::split_tiles); 1: tiles c, c + S, c + 2S, ... (all CTAs read
// neighbouring tiles at the same time).  Newest first in both.
__global__ void __launch_bounds__(128, 1) stream_tiles(const uint4* k, const uint4* v, int n_tiles, int strided,
                                                       uint32_t* sink) {
  extern __shared__ uint4 st_smem[];  // [3 stages][K, V][2048 uint4]
  constexpr int TILE16 = 2048;        // 16-byte chunks per 32 KB tile
  const int S = gridDim.x, c = blockIdx.x, tid = threadIdx.x;
  const int per = (n_tiles + S - 1) / S;
  const int cnt = strided ? (c < n_tiles ? (n_tiles - 1 - c) / S + 1 : 0) : max(0, min(per, n_tiles - c * per));
  auto tile = [&](int i) { return strided ? c + (cnt - 1 - i) * S : c * per + cnt - 1 - i; };
  auto issue = [&](int i) {
    if (i < cnt) {
      const int64_t t = tile(i);
      for (int q = 0; q < TILE16 / 128; ++q) {
        const int e = q * 128 + tid;
        const uint32_t dk = static_cast<uint32_t>(__cvta_generic_to_shared(st_smem + ((i % 3) * 2) * TILE16 + e));
        const uint32_t dv = static_cast<uint32_t>(__cvta_generic_to_shared(st_smem + ((i % 3) * 2 + 1) * TILE16 + e));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dk), "l"(k + t * TILE16 + e));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dv), "l"(v + t * TILE16 + e));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  issue(0);
  issue(1);
  uint32_t x = 0;
  for (int i = 0; i < cnt; ++i) {
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();
    issue(i + 2);
    const uint4 a = st_smem[((i % 3) * 2) * TILE16 + tid * 16], b = st_smem[((i % 3) * 2 + 1) * TILE16 + tid * 16];
    x ^= a.x ^ b.y;
    __syncthreads();
  }
  asm volatile("cp.async.wait_group 0;\n" ::);
  if (x == 0x12345678u) *sink = x;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Env {
  cudaStream_t stream;
  cudaEvent_t e0, e1;
  void* flush = nullptr;
  size_t flush_bytes = size_t(256) << 20;
  double copy_bw = 0;  // bytes/s, read + write
  int iters = 30;
  uint32_t* sink = nullptr;
  void flush_l2_now() {
    flush_l2<<<1056, 512, 0, stream>>>(static_cast<const uint4*>(flush), flush_bytes / 16, sink);
  }
};

double measure_copy_bw(Env& env) {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  BENCH_CHECK(cudaMalloc(&a, bytes));
  BENCH_CHECK(cudaMalloc(&b, bytes));
  BENCH_CHECK(cudaMemset(a, 1, bytes));
  std::vector<float> t;
  for (int i = 0; i < 12; ++i) {
    BENCH_CHECK(cudaEventRecord(env.e0, env.stream));
    BENCH_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, env.stream));
    BENCH_CHECK(cudaEventRecord(env.e1, env.stream));
    BENCH_CHECK(cudaEventSynchronize(env.e1));
    float ms;
    BENCH_CHECK(cudaEventElapsedTime(&ms, env.e0, env.e1));
    if (i >= 2) t.push_back(ms);
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (median(t) * 1e-3);
}

// Median time (microseconds) of an enqueue with a cold L2: the L2 flush kernel, then CUDA events
// around the enqueue, `iters` times after 3 warm-up calls (none with --profile: one call each).
template <typename F>
float time_enqueue(Env& env, F&& enqueue) {
  for (int i = 0; i < (env.iters > 1 ? 3 : 0); ++i) enqueue();
  std::vector<float> t;
  for (int i = 0; i < env.iters; ++i) {
    env.flush_l2_now();
    BENCH_CHECK(cudaEventRecord(env.e0, env.stream));
    enqueue();
    BENCH_CHECK(cudaEventRecord(env.e1, env.stream));
    BENCH_CHECK(cudaEventSynchronize(env.e1));
    float ms;
    BENCH_CHECK(cudaEventElapsedTime(&ms, env.e0, env.e1));
    t.push_back(ms * 1000.f);
  }
  BENCH_CHECK(cudaGetLastError());
  return median(t);
}

// The same timing around a CUDA graph replay of what `enqueue` launches (captured once), as a
// serving loop replays its decode step: no per-call host launch work between the two events.
template <typename F>
float time_graph(Env& env, F&& enqueue) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BENCH_CHECK(cudaStreamBeginCapture(env.stream, cudaStreamCaptureModeThreadLocal));
  enqueue();
  BENCH_CHECK(cudaStreamEndCapture(env.stream, &graph));
  BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const float t = time_enqueue(env, [&] { BENCH_CHECK(cudaGraphLaunch(exec, env.stream)); });
  BENCH_CHECK(cudaGraphExecDestroy(exec));
  BENCH_CHECK(cudaGraphDestroy(graph));
  return t;
}

// Back-to-back time per call (microseconds): `calls` enqueues of enq(i) for i = 0, 1, ... between
// one pair of events, no L2 flush, median of 5 such runs after one untimed run.  With enq rotating
// over caches that together exceed the L2, each call reads its bytes from DRAM as a serving loop's
// consecutive decode steps (one per layer) do, while the launch latency of one call overlaps the
// previous one.
template <typename F>
float time_back_to_back(Env& env, int calls, F&& enq) {
  std::vector<float> t;
  for (int r = 0; r < 6; ++r) {
    BENCH_CHECK(cudaEventRecord(env.e0, env.stream));
    for (int i = 0; i < calls; ++i) enq(i);
    BENCH_CHECK(cudaEventRecord(env.e1, env.stream));
    BENCH_CHECK(cudaEventSynchronize(env.e1));
    float ms;
    BENCH_CHECK(cudaEventElapsedTime(&ms, env.e0, env.e1));
    if (r > 0) t.push_back(ms * 1000.f / calls);
  }
  BENCH_CHECK(cudaGetLastError());
  return median(t);
}

// One decode call; a failed call ends the benchmark.
void decode_or_exit(const mala::DecodeArgs& a) {
  mala::Status st = mala::decode(a);
  if (!st) {
    std::fprintf(stderr, "decode failed: %s\n", st.message.c_str());
    std::exit(1);
  }
}

// Median time (microseconds) of one decode call with a cold L2.
float time_decode(Env& env, const mala::DecodeArgs& a) {
  return time_enqueue(env, [&] { decode_or_exit(a); });
}

struct Problem {
  int64_t batch, n, cap_stride;  // cap_stride: rows between batch entries in the device buffers
  const int64_t hq = 8, hkv = 1, d = 128;
  uint16_t* q;  // [batch, 1, hq, d]
  uint16_t* k;  // [batch, cap_stride, hkv, d]
  uint16_t* v;
};

struct Stats {
  double retained = 0, slots = 0, omitted_mean = 0, omitted_max = 0;
  int splits = 0;
};

mala::DecodeArgs make_args(const Problem& pb, Env& env, int32_t* lens, float tau, void* ws, size_t ws_bytes,
                           int num_splits, mala::SplitRule rule = mala::SplitRule::seeded) {
  mala::DecodeArgs a;
  a.split_rule = rule;
  a.device = mala::Device::cuda;
  a.dtype = mala::DType::bf16;
  a.q = pb.q;
  a.k_cache = pb.k;
  a.v_cache = pb.v;
  a.cache_seqlens = lens;
  a.batch = pb.batch;
  a.seqlen_q = 1;
  a.cache_capacity = pb.n;
  a.heads_q = pb.hq;
  a.heads_kv = pb.hkv;
  a.head_dim = pb.d;
  a.k_cache_strides.batch = pb.cap_stride * pb.hkv * pb.d;
  a.v_cache_strides.batch = pb.cap_stride * pb.hkv * pb.d;
  a.tau = tau;
  a.num_splits = num_splits;
  a.stream = env.stream;
  a.workspace = ws;
  a.workspace_bytes = ws_bytes;
  return a;
}

struct Bufs {
  void* ws = nullptr;
  size_t ws_bytes = size_t(64) << 20;
  void* o = nullptr;
  float* lse0 = nullptr;
  float* lse1 = nullptr;
  uint8_t* mask = nullptr;
  int32_t* slots = nullptr;
  int32_t* lens = nullptr;
};

// Realized work of one configuration (untimed call with tile_mask and lse).
Stats realized(const Problem& pb, Env& env, Bufs& bf, float tau, int num_splits, mala::SplitRule rule) {
  Stats s;
  mala::DecodeArgs a = make_args(pb, env, bf.lens, tau, bf.ws, bf.ws_bytes, num_splits, rule);
  a.o = bf.o;
  s.splits = mala::decode_num_splits(a);
  const int64_t bk = mala::decode_tiles(a).block_k;
  const int64_t nkt = (pb.n + bk - 1) / bk;
  a.tile_mask = bf.mask;
  a.lse = bf.lse1;
  a.fwd_slots = bf.slots;
  decode_or_exit(a);
  mala::DecodeArgs a0 = make_args(pb, env, bf.lens, 0.f, bf.ws, bf.ws_bytes, 0);
  a0.o = bf.o;
  a0.lse = bf.lse0;
  decode_or_exit(a0);
  BENCH_CHECK(cudaStreamSynchronize(env.stream));
  const int64_t tiles_q = (8 + 15) / 16;
  std::vector<uint8_t> mask(pb.batch * pb.hkv * tiles_q * nkt);
  BENCH_CHECK(cudaMemcpy(mask.data(), bf.mask, mask.size(), cudaMemcpyDeviceToHost));
  s.retained = mala::retained_fraction(mask.data(), static_cast<int64_t>(mask.size()));
  std::vector<int32_t> slots(pb.batch * pb.hq);
  BENCH_CHECK(cudaMemcpy(slots.data(), bf.slots, slots.size() * 4, cudaMemcpyDeviceToHost));
  for (int32_t x : slots) s.slots += x;
  s.slots /= static_cast<double>(slots.size());
  std::vector<float> l0(pb.batch * pb.hq), l1(l0.size());
  BENCH_CHECK(cudaMemcpy(l0.data(), bf.lse0, l0.size() * 4, cudaMemcpyDeviceToHost));
  BENCH_CHECK(cudaMemcpy(l1.data(), bf.lse1, l1.size() * 4, cudaMemcpyDeviceToHost));
  mala::Distribution om = mala::omitted_mass(l1.data(), l0.data(), static_cast<int64_t>(l0.size()));
  s.omitted_mean = om.mean;
  s.omitted_max = om.max;
  return s;
}

void bench_problem(const Problem& pb, Env& env, Bufs& bf, const char* input, bool sweep) {
  std::vector<int32_t> lens(pb.batch, static_cast<int32_t>(pb.n));
  BENCH_CHECK(cudaMemcpy(bf.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  const double k_bytes = double(pb.batch) * pb.n * pb.hkv * pb.d * 2;
  mala::DecodeArgs a0 = make_args(pb, env, bf.lens, 0.f, bf.ws, bf.ws_bytes, 0);
  a0.o = bf.o;
  const float t0 = time_decode(env, a0);
  const int s0 = mala::decode_num_splits(a0);
  const double floor0 = 2 * k_bytes / env.copy_bw * 1e6;
  std::printf("decode N=%-6lld B=%lld %-14s tau=0           splits=%3d: %8.2f us | retained 1.000 | slots %8lld | "
              "floor(K+V) %7.2f us | x floor %.2f\n",
              (long long)pb.n, (long long)pb.batch, input, s0, t0, (long long)pb.n, floor0, t0 / floor0);
  std::vector<int> split_list = {0};
  if (sweep) split_list = {0, 16, 32, 64, 96, 128};
  for (int ns : split_list)
    for (mala::SplitRule rule : {mala::SplitRule::seeded, mala::SplitRule::per_split}) {
      Stats st = realized(pb, env, bf, 1.f, ns, rule);
      mala::DecodeArgs a1 = make_args(pb, env, bf.lens, 1.f, bf.ws, bf.ws_bytes, ns, rule);
      a1.o = bf.o;
      const float t1 = time_decode(env, a1);
      const double floor1 = (k_bytes + st.retained * k_bytes) / env.copy_bw * 1e6;
      std::printf("decode N=%-6lld B=%lld %-14s tau=1 %-9s splits=%3d: %8.2f us | retained %.3f | slots %8.0f | "
                  "omitted mean %.2e max %.2e | floor(K+retV) %7.2f us | x floor %.2f | speedup vs tau0 %.2fx\n",
                  (long long)pb.n, (long long)pb.batch, input, mala::split_rule_name(rule), st.splits, t1, st.retained,
                  st.slots, st.omitted_mean, st.omitted_max, floor1, t1 / floor1, t0 / t1);
    }
  std::fflush(stdout);
}

// --overhead: where a batch-1 decode's time goes beyond its bytes.  The same timing (cold L2, CUDA
// events, median) around: one empty kernel; an empty kernel plus a dependent one launched the way
// decode launches its combine; a plain kernel streaming the same K and V bytes; decode at tau = 0
// eager and replayed from a CUDA graph; decode at tau = 0 with several split counts (num_splits = 1
// has no combine).
// An empty kernel, then an empty programmatic dependent of it (8 CTAs of `threads`): the launch
// pattern of a decode call (split kernel, then the combine as its dependent).
void launch_empty_pair(Env& env, int threads) {
  empty_kernel<<<1, 32, 0, env.stream>>>();
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(8);
  cfg.blockDim = dim3(threads);
  cfg.stream = env.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  BENCH_CHECK(cudaLaunchKernelEx(&cfg, empty_dependent_kernel));
}

// Host cost of one enqueue: the wall time of 100 calls in a row with no synchronization inside the
// timed loop (their few hundred launches stay within the launch queue, so the time is the host's):
// the public mala::decode (validation, device-pointer checks, then the backend), the backend alone,
// two bare kernel launches like the decode's (the second a programmatic dependent), and the
// cudaPointerGetAttributes calls the validation makes (one per device pointer).
void host_probe(const Problem& pb, Env& env, Bufs& bf) {
  std::vector<int32_t> lens(pb.batch, static_cast<int32_t>(pb.n));
  BENCH_CHECK(cudaMemcpy(bf.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  mala::DecodeArgs a = make_args(pb, env, bf.lens, 1.f, bf.ws, bf.ws_bytes, 0);
  a.o = bf.o;
  auto per_call_us = [&](auto&& fn) {
    for (int i = 0; i < 20; ++i) fn();
    BENCH_CHECK(cudaStreamSynchronize(env.stream));
    const int calls = 100;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    const auto t1 = std::chrono::steady_clock::now();
    BENCH_CHECK(cudaStreamSynchronize(env.stream));
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / calls;
  };
  const double t_api = per_call_us([&] { decode_or_exit(a); });
  const double t_backend = per_call_us([&] {
    if (!mala::cuda_backend::decode(a)) {
      std::fprintf(stderr, "decode bench: backend decode failed\n");
      std::exit(1);
    }
  });
  const double t_launch = per_call_us([&] { launch_empty_pair(env, 128); });
  const void* ptrs[] = {a.q, a.k_cache, a.v_cache, a.o, a.lse, a.cache_seqlens, a.workspace, a.tile_mask};
  const double t_ptr = per_call_us([&] {
    for (const void* p : ptrs) {
      cudaPointerAttributes attr;
      if (p) BENCH_CHECK(cudaPointerGetAttributes(&attr, p));
    }
  });
  std::printf("host N=%-6lld B=%lld: per call mala::decode %.2f us | backend alone %.2f us | two bare launches %.2f us "
              "| 8 cudaPointerGetAttributes %.2f us\n",
              (long long)pb.n, (long long)pb.batch, t_api, t_backend, t_launch, t_ptr);
}

void overhead_probe(const Problem& pb, Env& env, Bufs& bf) {
  std::vector<int32_t> lens(pb.batch, static_cast<int32_t>(pb.n));
  BENCH_CHECK(cudaMemcpy(bf.lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice));
  const double kv_bytes = 2.0 * pb.batch * pb.n * pb.hkv * pb.d * 2;
  const float t_empty = time_enqueue(env, [&] { empty_kernel<<<1, 32, 0, env.stream>>>(); });
  const float t_pair = time_enqueue(env, [&] { launch_empty_pair(env, 512); });
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // Only valid when the batch's sequences are adjacent (cap_stride == n) or batch == 1.
  const int64_t n16 = static_cast<int64_t>(kv_bytes / 2 / 16);
  const float t_stream = time_enqueue(env, [&] {
    stream_read<<<sms * 4, 512, 0, env.stream>>>(reinterpret_cast<const uint4*>(pb.k), reinterpret_cast<const uint4*>(pb.v),
                                                 n16, env.sink);
  });
  float t_tiles[2] = {0.f, 0.f};
  if (pb.batch == 1) {
    const int tiles_smem = 3 * 2 * 32768;
    BENCH_CHECK(cudaFuncSetAttribute(stream_tiles, cudaFuncAttributeMaxDynamicSharedMemorySize, tiles_smem));
    for (int strided = 0; strided < 2; ++strided)
      t_tiles[strided] = time_enqueue(env, [&] {
        stream_tiles<<<sms, 128, tiles_smem, env.stream>>>(reinterpret_cast<const uint4*>(pb.k),
                                                           reinterpret_cast<const uint4*>(pb.v),
                                                           static_cast<int>(pb.n / 128), strided, env.sink);
      });
  }
  std::printf("overhead N=%-6lld B=%lld: stream (K, V) tiles like the split kernel, %d CTAs: contiguous splits %.2f us, "
              "strided splits %.2f us\n", (long long)pb.n, (long long)pb.batch, sms, t_tiles[0], t_tiles[1]);
  std::printf("overhead N=%-6lld B=%lld: empty kernel %.2f us | empty + dependent (PDL) %.2f us | stream K+V %.2f us "
              "(%.0f GB/s; floor at copy bandwidth %.2f us)\n",
              (long long)pb.n, (long long)pb.batch, t_empty, t_pair, t_stream, kv_bytes / (t_stream * 1e3),
              kv_bytes / env.copy_bw * 1e6);
  {
    mala::DecodeArgs a = make_args(pb, env, bf.lens, 0.f, bf.ws, bf.ws_bytes, 0);
    a.o = bf.o;
    const float t_eager = time_decode(env, a);
    const float t_graph = time_graph(env, [&] { decode_or_exit(a); });
    const float t_empty_graph = time_graph(env, [&] { empty_kernel<<<1, 32, 0, env.stream>>>(); });
    std::printf("overhead N=%-6lld B=%lld: decode tau=0 default splits: eager %.2f us | CUDA graph replay %.2f us "
                "(empty kernel in a graph %.2f us) | floor(K+V) %.2f us\n",
                (long long)pb.n, (long long)pb.batch, t_eager, t_graph, t_empty_graph, kv_bytes / env.copy_bw * 1e6);
  }
  // Back to back over `rot` caches (the batch-8 buffers hold 8 batch-1 caches of capacity cap_stride).
  if (pb.batch == 1) {
    const int rot = 8, calls = 64;
    const int64_t cache_elems = pb.cap_stride * pb.hkv * pb.d;
    auto rotated = [&](int i) {
      Problem pr = pb;
      pr.k = pb.k + (i % rot) * cache_elems;
      pr.v = pb.v + (i % rot) * cache_elems;
      return pr;
    };
    std::vector<mala::DecodeArgs> args;
    for (int i = 0; i < rot; ++i) {
      args.push_back(make_args(rotated(i), env, bf.lens, 0.f, bf.ws, bf.ws_bytes, 0));
      args.back().o = bf.o;
    }
    const float t_dec = time_back_to_back(env, calls, [&](int i) { decode_or_exit(args[i % rot]); });
    const float t_str = time_back_to_back(env, calls, [&](int i) {
      const Problem pr = rotated(i);
      stream_read<<<sms * 4, 512, 0, env.stream>>>(reinterpret_cast<const uint4*>(pr.k),
                                                   reinterpret_cast<const uint4*>(pr.v), n16, env.sink);
    });
    const float t_emp = time_back_to_back(env, calls, [&](int) { empty_kernel<<<1, 32, 0, env.stream>>>(); });
    // The same decode calls captured in one CUDA graph (no host launch work between them).
    float t_dec_graph = 0.f;
    {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      BENCH_CHECK(cudaStreamBeginCapture(env.stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < calls; ++i) decode_or_exit(args[i % rot]);
      BENCH_CHECK(cudaStreamEndCapture(env.stream, &graph));
      BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      t_dec_graph = time_back_to_back(env, 1, [&](int) { BENCH_CHECK(cudaGraphLaunch(exec, env.stream)); }) / calls;
      BENCH_CHECK(cudaGraphExecDestroy(exec));
      BENCH_CHECK(cudaGraphDestroy(graph));
    }
    const double floor_us = kv_bytes / env.copy_bw * 1e6;
    std::printf("overhead N=%-6lld B=%lld: back to back over %d caches (%.0f MB in all), per call: decode tau=0 %.2f us "
                "(%.2fx the floor), %d calls in one CUDA graph %.2f us (%.2fx) | stream K+V %.2f us | empty kernel %.2f us "
                "| floor(K+V) %.2f us\n",
                (long long)pb.n, (long long)pb.batch, rot, rot * kv_bytes / 1e6, t_dec, t_dec / floor_us, calls, t_dec_graph,
                t_dec_graph / floor_us, t_str, t_emp, floor_us);
  }
  for (int ns : {1, 8, 33, 66, 132, 264}) {
    mala::DecodeArgs a = make_args(pb, env, bf.lens, 0.f, bf.ws, bf.ws_bytes, ns);
    a.o = bf.o;
    if (mala::decode_workspace_size(a) > bf.ws_bytes) continue;
    std::printf("overhead N=%-6lld B=%lld: decode tau=0 splits=%3d %8.2f us\n", (long long)pb.n, (long long)pb.batch, ns,
                time_decode(env, a));
  }
  std::fflush(stdout);
}

}  // namespace

int run_decode_bench(int argc, char** argv) {
  bool quick = false, sweep = false, profile = false, no_synth = false, overhead = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--sweep")) sweep = true;
    if (!std::strcmp(argv[i], "--profile")) profile = true;      // one call per config (for ncu)
    if (!std::strcmp(argv[i], "--no-synthetic")) no_synth = true;
    if (!std::strcmp(argv[i], "--overhead")) overhead = true;   // batch-1 fixed-cost probe only
  }
  if (!mala::cuda_available()) {
    std::printf("decode bench: no CUDA device\n");
    return 0;
  }
  Env env;
  env.iters = profile ? 1 : quick ? 10 : 30;
  BENCH_CHECK(cudaStreamCreateWithFlags(&env.stream, cudaStreamNonBlocking));
  BENCH_CHECK(cudaEventCreate(&env.e0));
  BENCH_CHECK(cudaEventCreate(&env.e1));
  BENCH_CHECK(cudaMalloc(&env.flush, env.flush_bytes));
  BENCH_CHECK(cudaMemset(env.flush, 1, env.flush_bytes));
  BENCH_CHECK(cudaMalloc(&env.sink, 4));
  env.copy_bw = measure_copy_bw(env);
  std::printf("== decode benchmark on %s: copy bandwidth %.0f GB/s (1 GiB D2D, read+write)\n",
              mala::device_name().c_str(), env.copy_bw / 1e9);
  std::printf("   Hq=8 Hkv=1 d=128 bf16, 1 token, cache capacity = N, cold L2, median of %d\n", env.iters);

  std::vector<int64_t> lengths = {1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072};
  if (quick) lengths = {1024, 8192, 32768, 131072};
  if (profile) lengths = {1024, 131072};
  const int64_t max_n = lengths.back();
  const int64_t max_b = 8, hq = 8, d = 128;
  Bufs bf;
  BENCH_CHECK(cudaMalloc(&bf.ws, bf.ws_bytes));
  BENCH_CHECK(cudaMalloc(&bf.o, max_b * hq * d * 2));
  BENCH_CHECK(cudaMalloc(&bf.lse0, max_b * hq * 4));
  BENCH_CHECK(cudaMalloc(&bf.lse1, max_b * hq * 4));
  BENCH_CHECK(cudaMalloc(&bf.mask, max_b * ((max_n + 15) / 16)));  // any key tile >= 16
  BENCH_CHECK(cudaMalloc(&bf.slots, max_b * hq * 4));
  BENCH_CHECK(cudaMalloc(&bf.lens, max_b * 4));
  uint16_t *q, *k, *v;
  const size_t kv_elems = size_t(max_b) * max_n * d;
  BENCH_CHECK(cudaMalloc(&q, max_b * hq * d * 2));
  BENCH_CHECK(cudaMalloc(&k, kv_elems * 2));
  BENCH_CHECK(cudaMalloc(&v, kv_elems * 2));

  if (overhead) {
    fill_normal_bf16<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(k), kv_elems, 11);
    fill_normal_bf16<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(v), kv_elems, 12);
    fill_normal_bf16<<<64, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(q), max_b * hq * d, 13);
    host_probe(Problem{1, 1024, max_n, 8, 1, 128, q, k, v}, env, bf);
    for (int64_t n : {int64_t(1024), int64_t(32768), max_n}) overhead_probe(Problem{1, n, max_n, 8, 1, 128, q, k, v}, env, bf);
    lengths.clear();
    no_synth = true;
  }
  // random
  fill_normal_bf16<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(k), kv_elems, 11);
  fill_normal_bf16<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(v), kv_elems, 12);
  fill_normal_bf16<<<64, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(q), max_b * hq * d, 13);
  BENCH_CHECK(cudaStreamSynchronize(env.stream));
  for (int64_t b : {int64_t(1), int64_t(8)})
    for (int64_t n : lengths) {
      Problem pb{b, n, max_n, 8, 1, 128, q, k, v};
      bench_problem(pb, env, bf, "random", sweep && n == max_n);
    }

  // recency ramps (device-generated; regenerated per N since the ramp spans the context).
  for (float slope : quick ? std::vector<float>{16.f} : std::vector<float>{2.f, 16.f}) {
    char name[32];
    std::snprintf(name, sizeof name, "recency(%g/tile)", slope);
    for (int64_t b : {int64_t(1), int64_t(8)})
      for (int64_t n : lengths) {
        if (profile && slope != 16.f) break;  // --profile: one ramp (a skip-heavy input)
        fill_normal_bf16<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(k), kv_elems, 21);
        fill_normal_bf16<<<64, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(q), max_b * hq * d, 23);
        apply_recency<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(q), reinterpret_cast<__nv_bfloat16*>(k),
                                                    b, n, max_n, hq, d, slope);
        BENCH_CHECK(cudaStreamSynchronize(env.stream));
        Problem pb{b, n, max_n, 8, 1, 128, q, k, v};
        bench_problem(pb, env, bf, name, sweep && n == max_n);
      }
  }

  // patchy: about a third of the tiles skipped, scattered (device-generated).
  for (int64_t b : {int64_t(1), int64_t(8)})
    for (int64_t n : lengths) {
      fill_normal_bf16<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(k), kv_elems, 31);
      fill_normal_bf16<<<64, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(q), max_b * hq * d, 33);
      apply_patchy<<<1024, 256, 0, env.stream>>>(reinterpret_cast<__nv_bfloat16*>(q), reinterpret_cast<__nv_bfloat16*>(k), b,
                                                 n, max_n, hq, d, 128);
      BENCH_CHECK(cudaStreamSynchronize(env.stream));
      Problem pb{b, n, max_n, 8, 1, 128, q, k, v};
      bench_problem(pb, env, bf, "patchy(1/3 low)", sweep && n == max_n);
    }

  // synthetic: one 128K workload per batch entry; query row N-1 for each N.
  std::vector<double> sharp = quick ? std::vector<double>{16.0} : std::vector<double>{4.0, 16.0};
  if (no_synth || profile) sharp.clear();
  std::vector<float> hq_buf(size_t(max_n) * hq * d), hk(size_t(max_n) * d), hv(hk.size());
  for (double s : sharp) {
    // host q rows per (N, batch entry): [n_index][b][hq*d]
    std::vector<std::vector<uint16_t>> qrows(lengths.size(), std::vector<uint16_t>(max_b * hq * d));
    for (int64_t b = 0; b < max_b; ++b) {
      mala::WorkloadSpec spec;
      spec.regime = "synthetic";
      spec.batch = 1;
      spec.seqlen = max_n;
      spec.heads_q = hq;
      spec.heads_kv = 1;
      spec.head_dim = d;
      spec.sharpness = s;
      spec.seed = static_cast<uint64_t>(b);
      mala::Status st = mala::make_workload(spec, hq_buf.data(), hk.data(), hv.data(), nullptr);
      if (!st) {
        std::fprintf(stderr, "make_workload: %s\n", st.message.c_str());
        return 1;
      }
      std::vector<uint16_t> kb = to_bf16(hk.data(), hk.size()), vb = to_bf16(hv.data(), hv.size());
      BENCH_CHECK(cudaMemcpy(k + b * max_n * d, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice));
      BENCH_CHECK(cudaMemcpy(v + b * max_n * d, vb.data(), vb.size() * 2, cudaMemcpyHostToDevice));
      for (size_t li = 0; li < lengths.size(); ++li) {
        std::vector<uint16_t> r = to_bf16(&hq_buf[size_t(lengths[li] - 1) * hq * d], hq * d);
        std::copy(r.begin(), r.end(), qrows[li].begin() + b * hq * d);
      }
    }
    char name[32];
    std::snprintf(name, sizeof name, "synthetic(s=%g)", s);
    for (int64_t b : {int64_t(1), int64_t(8)})
      for (size_t li = 0; li < lengths.size(); ++li) {
        BENCH_CHECK(cudaMemcpy(q, qrows[li].data(), qrows[li].size() * 2, cudaMemcpyHostToDevice));
        Problem pb{b, lengths[li], max_n, 8, 1, 128, q, k, v};
        bench_problem(pb, env, bf, name, sweep && lengths[li] == max_n);
      }
  }
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(bf.ws);
  cudaFree(bf.o);
  cudaFree(bf.lse0);
  cudaFree(bf.lse1);
  cudaFree(bf.mask);
  cudaFree(bf.slots);
  cudaFree(bf.lens);
  cudaFree(env.flush);
  return 0;
}

#ifdef MALA_DECODE_BENCH_MAIN
int main(int argc, char** argv) { return run_decode_bench(argc, argv); }
#endif
