// CUDA backward (issue 3): host side of the fused MALA backward.
//   1. preprocess kernel: D = rowsum(dO * O) (fp32) into the workspace, lse in log2 units and (tau >
//      0) each row's skip bound on raw scores beside it, bwd_slots zeroed; the fp32 dQ
//      accumulator (and the dK/dV accumulators when used) zeroed with cudaMemsetAsync.
//   2. the fused key-major kernel (bwd_kernel.cuh), one instantiation per (dtype, head dim).
//   3. convert kernel: dQ (and dK/dV when they went through the fp32 workspace) in the input dtype.
// GQA: a CTA loops over `heads_per_cta` query heads of one KV group with dK/dV in registers.  When
// one CTA per (key tile, KV head) would leave the GPU underfilled the group is split and the CTAs
// add their partial dK/dV into an fp32 workspace (red.global.add), converted at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "common/rule.h"
#include "cuda/backend.h"
#include "cuda/bwd_params.cuh"
#include "cuda/ptx.cuh"

namespace mala {
namespace cuda_backend {

namespace {

using cuda::BwdParams;

Tiles tiles_for_dim(int64_t d) {
  switch (d) {
    case 64: return {cuda::BwdConfig<64>::BQ, cuda::BwdConfig<64>::BK};
    case 128: return {cuda::BwdConfig<128>::BQ, cuda::BwdConfig<128>::BK};
    case 256: return {cuda::BwdConfig<256>::BQ, cuda::BwdConfig<256>::BK};
    default: return {64, 128};
  }
}

int device_sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
    return 132;
  }
  return n > 0 ? n : 132;
}

// 3 Q stages where the device's opt-in shared memory holds them (H100: yes; A100 at d = 128: no).
int pick_q_stages(int bytes3) {
  if (const char* env = std::getenv("MALA_BWD_Q_STAGES")) {
    const int s = std::atoi(env);
    if (s == 2 || s == 3) return s;
  }
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return 2;
  }
  return optin >= bytes3 ? 3 : 2;
}

struct Plan {
  Tiles tiles;
  int n_q_tiles = 0, n_k_tiles = 0;
  int64_t rows_q_cap = 0, rows_k_cap = 0;
  int heads_per_cta = 1, head_splits = 1;
  bool kv_atomic = false;
  size_t off_dsum = 0, off_lse2 = 0, off_bound2 = 0, off_dq = 0, off_dk = 0, off_dv = 0, bytes = 0;
};

size_t align_up(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

Plan make_plan(const BackwardArgs& a) {
  Plan pl;
  pl.tiles = tiles_for_dim(a.head_dim);
  pl.n_q_tiles = static_cast<int>(rule::ceil_div(static_cast<int>(a.seqlen_q), pl.tiles.block_q));
  pl.n_k_tiles = static_cast<int>(rule::ceil_div(static_cast<int>(a.seqlen_k), pl.tiles.block_k));
  pl.rows_q_cap = a.batch * a.seqlen_q;
  pl.rows_k_cap = a.batch * a.seqlen_k;
  const int group = static_cast<int>(a.heads_q / a.heads_kv);
  // Split the query-head group over CTAs only while the grid is small against the GPU.
  int splits = 1;
  if (const char* env = std::getenv("MALA_BWD_HEAD_SPLITS")) {
    int s = std::atoi(env);
    if (s >= 1 && s <= group && group % s == 0) splits = s;
  } else {
    const int64_t base = static_cast<int64_t>(pl.n_k_tiles) * a.batch * a.heads_kv;
    const int64_t want = 4LL * device_sm_count();
    while (splits < group && base * splits < want) {
      int next = splits + 1;
      while (group % next != 0) ++next;
      splits = next;
    }
  }
  pl.head_splits = splits;
  pl.heads_per_cta = group / splits;
  pl.kv_atomic = splits > 1;
  const size_t d = static_cast<size_t>(a.head_dim);
  size_t off = 0;
  pl.off_dsum = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap));
  pl.off_lse2 = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap));
  pl.off_dq = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap) * d);
  if (pl.kv_atomic) {
    pl.off_dk = off;
    off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_kv * pl.rows_k_cap) * d);
    pl.off_dv = off;
    off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_kv * pl.rows_k_cap) * d);
  }
  // Last, so that the accumulators keep their offsets (the dQ accumulator's placement alone moved
  // the backward by up to 12%: bench_backward.cu).
  pl.off_bound2 = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap));
  pl.bytes = off;
  return pl;
}

struct Str {
  int64_t b, r, h;
};
Str resolve(const Strides& s, int64_t seqlen, int64_t heads, int64_t d) {
  Str r;
  r.h = s.head != 0 ? s.head : d;
  r.r = s.row != 0 ? s.row : heads * r.h;
  r.b = s.batch != 0 ? s.batch : seqlen * r.r;
  return r;
}

// Rows handled by the row-wise kernels: one warp per (row, head) of the dense/packed row space.
struct RowParams {
  const void* o;
  const void* dout;
  void* dst;          // convert: output tensor
  const float* src;   // convert: fp32 accumulator [heads, rows_cap, d]
  Str o_s, do_s, dst_s;
  float* dsum;
  float* lse2;        // preprocess: lse * log2(e), -inf -> 0, in dsum's layout
  float* bound2;      // preprocess, tau > 0 (else null): the row's skip bound on raw scores, dsum's layout
  const float* lse;   // preprocess: the forward's lse [B, H, N] or [H, total]
  int32_t* slots;
  const int32_t* cu;  // varlen when non-null
  const int32_t* cu_k;  // preprocess, varlen: the key offsets (for the rows' L_q)
  int batch, seqlen, heads;
  int seqlen_k;       // preprocess: keys per sequence (dense layout)
  bool causal;        // preprocess
  float log2_tau, inv_scale_log2;  // preprocess, tau > 0
  int64_t rows_cap;
  float mul;
};

__device__ __forceinline__ int64_t rp_total(const RowParams& p) {
  return p.cu ? static_cast<int64_t>(p.cu[p.batch]) : p.rows_cap;
}
__device__ __forceinline__ int64_t rp_offset(const RowParams& p, const Str& s, int64_t g, int h) {
  if (p.cu) return g * s.r + h * s.h;
  return (g / p.seqlen) * s.b + (g % p.seqlen) * s.r + h * s.h;
}

// The offline test of row g solved for the raw score (rule::skip_bound_raw): a tile's entries of the
// row allow the skip iff none exceeds this bound, so the wgmma kernel compares its raw S^T against it
// and scales only retained tiles.  A row without legal keys gets +inf (it never blocks a skip).
__device__ __forceinline__ float bwd_row_skip_bound(const RowParams& p, int64_t g, float l2) {
  int r, qlen = p.seqlen, klen = p.seqlen_k;
  if (p.cu) {
    int lo = 0, hi = p.batch;  // the sequence b with cu[b] <= g < cu[b + 1]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (p.cu[mid] <= g) lo = mid; else hi = mid;
    }
    r = static_cast<int>(g - p.cu[lo]);
    qlen = p.cu[lo + 1] - p.cu[lo];
    klen = p.cu_k[lo + 1] - p.cu_k[lo];
  } else {
    r = static_cast<int>(g % p.seqlen);
  }
  const int L = rule::visible_keys(r, qlen, klen, p.causal);
  return rule::skip_bound_raw(l2, cuda::bwd_row_log2_thr(p.log2_tau, L), p.inv_scale_log2);
}

template <typename T, int D>
__global__ void bwd_preprocess_kernel(const RowParams p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * 8 + warp;
  const int64_t g = w / p.heads;
  const int h = static_cast<int>(w % p.heads);
  const int64_t total = rp_total(p);
  if (g >= total) return;
  const T* o = static_cast<const T*>(p.o) + rp_offset(p, p.o_s, g, h);
  const T* dout = static_cast<const T*>(p.dout) + rp_offset(p, p.do_s, g, h);
  float acc = 0.f;
#pragma unroll
  for (int c = lane * 8; c < D; c += 256) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(dout + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += cuda::to_float<T>(oe[e]) * cuda::to_float<T>(de[e]);
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) {
    p.dsum[h * p.rows_cap + g] = acc;
    const int64_t idx = p.cu ? h * total + g : ((g / p.seqlen) * p.heads + h) * p.seqlen + g % p.seqlen;
    // The main kernel's offline test and P = exp2(S - lse2) read this: converted once per row instead
    // of once per visited tile (and finite, so the test needs no -inf case).
    const float l2 = p.lse[idx] * 1.4426950408889634f;
    const float l2f = l2 == -INFINITY ? 0.f : l2;
    p.lse2[h * p.rows_cap + g] = l2f;
    if (p.bound2) p.bound2[h * p.rows_cap + g] = bwd_row_skip_bound(p, g, l2f);
    if (p.slots) p.slots[idx] = 0;
  }
}

template <typename T, int D>
__global__ void bwd_convert_kernel(const RowParams p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * 8 + warp;
  const int64_t g = w / p.heads;
  const int h = static_cast<int>(w % p.heads);
  if (g >= rp_total(p)) return;
  const float* src = p.src + (h * p.rows_cap + g) * D;
  T* dst = static_cast<T*>(p.dst) + rp_offset(p, p.dst_s, g, h);
#pragma unroll
  for (int c = lane * 8; c < D; c += 256) {
    const float4 x0 = *reinterpret_cast<const float4*>(src + c);
    const float4 x1 = *reinterpret_cast<const float4*>(src + c + 4);
    uint4 out;
    out.x = cuda::pack2<T>(x0.x * p.mul, x0.y * p.mul);
    out.y = cuda::pack2<T>(x0.z * p.mul, x0.w * p.mul);
    out.z = cuda::pack2<T>(x1.x * p.mul, x1.y * p.mul);
    out.w = cuda::pack2<T>(x1.z * p.mul, x1.w * p.mul);
    *reinterpret_cast<uint4*>(dst + c) = out;
  }
}

template <typename T, int D>
cudaError_t run_typed(const BackwardArgs& a, const Plan& pl, char* ws, cudaStream_t stream) {
  const int64_t d = a.head_dim;
  const Str qs = resolve(a.q_strides, a.seqlen_q, a.heads_q, d), ks = resolve(a.k_strides, a.seqlen_k, a.heads_kv, d),
            vs = resolve(a.v_strides, a.seqlen_k, a.heads_kv, d), os = resolve(a.o_strides, a.seqlen_q, a.heads_q, d),
            dos = resolve(a.dout_strides, a.seqlen_q, a.heads_q, d),
            dqs = resolve(a.dq_strides, a.seqlen_q, a.heads_q, d),
            dks = resolve(a.dk_strides, a.seqlen_k, a.heads_kv, d),
            dvs = resolve(a.dv_strides, a.seqlen_k, a.heads_kv, d);
  float* dsum = reinterpret_cast<float*>(ws + pl.off_dsum);
  float* lse2 = reinterpret_cast<float*>(ws + pl.off_lse2);
  float* bound2 = reinterpret_cast<float*>(ws + pl.off_bound2);
  float* dq_acc = reinterpret_cast<float*>(ws + pl.off_dq);
  float* dk_acc = pl.kv_atomic ? reinterpret_cast<float*>(ws + pl.off_dk) : nullptr;
  float* dv_acc = pl.kv_atomic ? reinterpret_cast<float*>(ws + pl.off_dv) : nullptr;
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  // Shared by the preprocess kernel (the raw-score bound) and the main kernel (P, the test).
  const float scale_log2 = scale * 1.4426950408889634f;
  const float log2_tau = a.tau > 0.f ? std::log2(a.tau) : -INFINITY;
  cudaError_t err;

  // 1. zero accumulators, tile_mask; D and slot zeroing.
  err = cudaMemsetAsync(dq_acc, 0, sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap * d), stream);
  if (err != cudaSuccess) return err;
  if (pl.kv_atomic) {
    err = cudaMemsetAsync(ws + pl.off_dk, 0, pl.bytes - pl.off_dk, stream);
    if (err != cudaSuccess) return err;
  }
  if (a.tile_mask) {
    err = cudaMemsetAsync(a.tile_mask, 0,
                          static_cast<size_t>(a.batch * a.heads_q) * pl.n_q_tiles * pl.n_k_tiles, stream);
    if (err != cudaSuccess) return err;
  }
  RowParams rq{};
  rq.o = a.o;
  rq.dout = a.dout;
  rq.o_s = os;
  rq.do_s = dos;
  rq.dsum = dsum;
  rq.lse2 = lse2;
  rq.bound2 = a.tau > 0.f ? bound2 : nullptr;
  rq.cu_k = a.cu_seqlens_k;
  rq.seqlen_k = static_cast<int>(a.seqlen_k);
  rq.causal = a.causal;
  rq.log2_tau = log2_tau;
  rq.inv_scale_log2 = 1.0f / scale_log2;
  rq.lse = a.lse;
  rq.slots = a.bwd_slots;
  rq.cu = a.cu_seqlens_q;
  rq.batch = static_cast<int>(a.batch);
  rq.seqlen = static_cast<int>(a.seqlen_q);
  rq.heads = static_cast<int>(a.heads_q);
  rq.rows_cap = pl.rows_q_cap;
  const int64_t q_warps = pl.rows_q_cap * a.heads_q;
  if (q_warps > 0) {
    bwd_preprocess_kernel<T, D><<<static_cast<unsigned>((q_warps + 7) / 8), 256, 0, stream>>>(rq);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  // 2. fused kernel.
  BwdParams p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.dout = a.dout;
  p.q_b = qs.b; p.q_r = qs.r; p.q_h = qs.h;
  p.k_b = ks.b; p.k_r = ks.r; p.k_h = ks.h;
  p.v_b = vs.b; p.v_r = vs.r; p.v_h = vs.h;
  p.do_b = dos.b; p.do_r = dos.r; p.do_h = dos.h;
  p.dk = a.dk;
  p.dv = a.dv;
  p.dk_b = dks.b; p.dk_r = dks.r; p.dk_h = dks.h;
  p.dv_b = dvs.b; p.dv_r = dvs.r; p.dv_h = dvs.h;
  p.bwd_slots = a.bwd_slots;
  p.tile_mask = a.tile_mask;
  p.cu_q = a.cu_seqlens_q;
  p.cu_k = a.cu_seqlens_k;
  p.batch = static_cast<int>(a.batch);
  p.seqlen_q = static_cast<int>(a.seqlen_q);
  p.seqlen_k = static_cast<int>(a.seqlen_k);
  p.heads_q = static_cast<int>(a.heads_q);
  p.heads_kv = static_cast<int>(a.heads_kv);
  p.group = static_cast<int>(a.heads_q / a.heads_kv);
  p.n_q_tiles = pl.n_q_tiles;
  p.n_k_tiles = pl.n_k_tiles;
  p.rows_q_cap = pl.rows_q_cap;
  p.rows_k_cap = pl.rows_k_cap;
  p.causal = a.causal;
  p.tau_zero = a.tau == 0.f;
  p.scale = scale;
  p.scale_log2 = scale_log2;
  p.log2_tau = log2_tau;
  p.dsum = dsum;
  p.lse2 = lse2;
  p.bound2 = bound2;
  p.dq_acc = dq_acc;
  p.dk_acc = dk_acc;
  p.dv_acc = dv_acc;
  p.heads_per_cta = pl.heads_per_cta;
  // 3 Q stages where they fit (they pay on the skip path: 10.66 -> 10.44 ms at 32K, 6% retained;
  // dense tau = 0 measured within 1% either way).  MALA_BWD_Q_STAGES=2|3 overrides.
  p.q_stages = pick_q_stages(cuda::bwd_smem_bytes<D>(3));
  p.head_splits = pl.head_splits;
  if ((err = cuda::launch_bwd_main<T, D>(p, stream)) != cudaSuccess) return err;

  // 3. converts.
  if (q_warps > 0) {
    RowParams rc = rq;
    rc.dst = a.dq;
    rc.dst_s = dqs;
    rc.src = dq_acc;
    rc.mul = scale;
    bwd_convert_kernel<T, D><<<static_cast<unsigned>((q_warps + 7) / 8), 256, 0, stream>>>(rc);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (pl.kv_atomic) {
    RowParams rk{};
    rk.cu = a.cu_seqlens_k;
    rk.batch = static_cast<int>(a.batch);
    rk.seqlen = static_cast<int>(a.seqlen_k);
    rk.heads = static_cast<int>(a.heads_kv);
    rk.rows_cap = pl.rows_k_cap;
    rk.mul = 1.f;
    const int64_t k_warps = pl.rows_k_cap * a.heads_kv;
    if (k_warps > 0) {
      rk.dst = a.dk;
      rk.dst_s = dks;
      rk.src = dk_acc;
      bwd_convert_kernel<T, D><<<static_cast<unsigned>((k_warps + 7) / 8), 256, 0, stream>>>(rk);
      rk.dst = a.dv;
      rk.dst_s = dvs;
      rk.src = dv_acc;
      bwd_convert_kernel<T, D><<<static_cast<unsigned>((k_warps + 7) / 8), 256, 0, stream>>>(rk);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
bool strides_ok(const Strides& s) { return s.batch % 8 == 0 && s.row % 8 == 0 && s.head % 8 == 0; }

}  // namespace

Tiles backward_tiles(const BackwardArgs& a) { return tiles_for_dim(a.head_dim); }

size_t backward_workspace_size(const BackwardArgs& a) { return make_plan(a).bytes; }

Status backward(const BackwardArgs& a) {
  if (a.dtype != DType::bf16 && a.dtype != DType::f16)
    return Status::error("dtype: CUDA backward supports bfloat16 and float16 (got " + std::string(dtype_name(a.dtype)) + ")");
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256)
    return Status::error("head_dim: CUDA backward supports 64, 128, 256 (got " + std::to_string(a.head_dim) + ")");
  const Tiles t = tiles_for_dim(a.head_dim);
  if ((a.block_q != 0 && a.block_q != t.block_q) || (a.block_k != 0 && a.block_k != t.block_k))
    return Status::error("block_q: CUDA backward tiles are " + std::to_string(t.block_q) + "x" +
                         std::to_string(t.block_k) + " for head_dim " + std::to_string(a.head_dim));
  const struct {
    const void* p;
    const Strides* s;
    const char* name;
  } tensors[] = {{a.q, &a.q_strides, "q"},       {a.k, &a.k_strides, "k"},   {a.v, &a.v_strides, "v"},
                 {a.o, &a.o_strides, "o"},       {a.dout, &a.dout_strides, "dout"}, {a.dq, &a.dq_strides, "dq"},
                 {a.dk, &a.dk_strides, "dk"},    {a.dv, &a.dv_strides, "dv"}};
  for (const auto& x : tensors) {
    if (!aligned16(x.p)) return Status::error(std::string(x.name) + ": CUDA backward needs 16-byte aligned tensors");
    if (!strides_ok(*x.s))
      return Status::error(std::string(x.name) + "_strides: CUDA backward needs strides that are multiples of 8 elements");
  }
  const Plan pl = make_plan(a);
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  char* ws = static_cast<char*>(a.workspace);
  bool owned = false;
  cudaError_t err = cudaSuccess;
  if (ws == nullptr) {
    err = cudaMallocAsync(reinterpret_cast<void**>(&ws), pl.bytes, stream);
    if (err != cudaSuccess) return Status::error(std::string("workspace: cudaMallocAsync failed: ") + cudaGetErrorString(err));
    owned = true;
  }
  const bool bf16 = a.dtype == DType::bf16;
  switch (a.head_dim) {
    case 64: err = bf16 ? run_typed<__nv_bfloat16, 64>(a, pl, ws, stream) : run_typed<__half, 64>(a, pl, ws, stream); break;
    case 128: err = bf16 ? run_typed<__nv_bfloat16, 128>(a, pl, ws, stream) : run_typed<__half, 128>(a, pl, ws, stream); break;
    default: err = bf16 ? run_typed<__nv_bfloat16, 256>(a, pl, ws, stream) : run_typed<__half, 256>(a, pl, ws, stream); break;
  }
  if (owned) {
    cudaError_t e2 = cudaFreeAsync(ws, stream);
    if (err == cudaSuccess) err = e2;
  }
  if (err != cudaSuccess) return Status::error(std::string("device: CUDA backward failed: ") + cudaGetErrorString(err));
  return Status::success();
}

}  // namespace cuda_backend
}  // namespace mala
