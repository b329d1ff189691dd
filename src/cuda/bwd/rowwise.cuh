// The backward's row-wise kernels, one kernel template (bwd_rowwise_kernel<Op, T, D>) and three
// ops, a warp's work each: BwdPreprocess before the main kernel, one warp per (row, head) of the
// dense or packed row space (D = rowsum(dO * O), lse in log2 units, the raw-score skip bound, the
// fixed-point dQ unit, bwd_slots zeroed); BwdConvert after it, the same warp per row (fp32 or
// fixed-point accumulators to the output dtype); and in deterministic mode, before preprocess,
// BwdKvMax (the K/V maxima that the fixed-point unit needs), its warps striding over the rows.
#pragma once

#include <math.h>
#include <stdint.h>

#include "common/rule.h"
#include "cuda/attn/skip.cuh"
#include "cuda/bwd/params.cuh"
#include "cuda/core/ptx.cuh"

namespace mala {
namespace cuda {

// Element strides of one tensor (batch, row, head).
struct RowStrides {
  int64_t b, r, h;
};

// Rows handled by the row-wise kernels: one warp per (row, head) of the dense/packed row space.
struct RowParams {
  const void* o;
  const void* dout;
  void* dst;          // convert: output tensor
  const float* src;   // convert: fp32 accumulator [heads, rows_cap, d]
  const int32_t* src_fixed;  // convert, deterministic dQ: the fixed-point accumulator instead of src
  float* dq_unit;      // preprocess (deterministic dQ, else null): the row's fixed-point unit; convert: read
  const float* kv_max; // preprocess, dq_unit: max |K| and max ||V_j||^2 over the call (BwdKvMax)
  float dq_mass;       // preprocess, dq_unit: 1 + tau, the bound on a row's sum of P (kDqFixedBits)
  RowStrides o_s, do_s, dst_s;
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
  int rows_before;                 // preprocess: BackwardArgs::rows_before (rule::threshold_length)
  int64_t rows_cap;
  float mul;
  int slices;             // convert: sum of this many accumulators (1, or the deterministic dK/dV
  int64_t slice_stride;   // slices, in split order) slice_stride floats apart
};

__device__ __forceinline__ int64_t rp_total(const RowParams& p) {
  return p.cu ? static_cast<int64_t>(p.cu[p.batch]) : p.rows_cap;
}
__device__ __forceinline__ int64_t rp_offset(const RowParams& p, const RowStrides& s, int64_t g, int h) {
  if (p.cu) return g * s.r + h * s.h;
  return (g / p.seqlen) * s.b + (g % p.seqlen) * s.r + h * s.h;
}

// This lane's elements of two rows of D elements (16-byte loads of 8, the warp's lanes 256 elements
// apart): f(a_e, b_e) for each pair, in fp32.
template <typename T, int D, typename F>
__device__ __forceinline__ void for_lane_pairs(const T* a, const T* b, int lane, F&& f) {
#pragma unroll
  for (int c = lane * 8; c < D; c += 256) {
    const uint4 av = *reinterpret_cast<const uint4*>(a + c);
    const uint4 bv = *reinterpret_cast<const uint4*>(b + c);
    const T* ae = reinterpret_cast<const T*>(&av);
    const T* be = reinterpret_cast<const T*>(&bv);
#pragma unroll
    for (int e = 0; e < 8; ++e) f(to_float<T>(ae[e]), to_float<T>(be[e]));
  }
}

// 8 values times mul, as T, in one 16-byte store at dst.
template <typename T>
__device__ __forceinline__ void store8(T* dst, const float (&x)[8], float mul) {
  uint4 out;
  out.x = pack2<T>(x[0] * mul, x[1] * mul);
  out.y = pack2<T>(x[2] * mul, x[3] * mul);
  out.z = pack2<T>(x[4] * mul, x[5] * mul);
  out.w = pack2<T>(x[6] * mul, x[7] * mul);
  *reinterpret_cast<uint4*>(dst) = out;
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
  return rule::skip_bound_raw(l2, row_log2_threshold_or_inf(p.log2_tau, rule::threshold_length(L, r, p.rows_before)),
                              p.inv_scale_log2);
}

// The fixed-point unit of a dQ row (BwdParams::dq_unit): the power of two that takes `bound`, a bound
// on the row's |dQ| before the softmax scale, to at most 2^kDqFixedBits.  (A zero or non-finite bound
// belongs to a row whose dQ is zero, or not finite anyway.)  A NaN bound (the row's D is NaN: its O
// was) gives a NaN unit: its dQ sums stay 0 (a NaN converts to the integer 0) and the convert
// kernel, dividing by the unit, writes the row's dQ as NaN, as the fp32 accumulation would.
__device__ __forceinline__ float bwd_dq_fixed_unit(float bound) {
  if (bound != bound) return bound;
  int e = 0;
  if (bound > 0.f && bound <= 3.402823466e38f) frexpf(bound, &e);  // bound < 2^e
  const int s = min(max(kDqFixedBits - e, -126), 126);
  return __int_as_float((s + 127) << 23);
}

// The row-wise kernel: 8 warps a block, each warp's work Op's (BwdKvMax, BwdPreprocess, BwdConvert
// below; Op::Params its parameter struct, passed by value as each kernel had it; Op::run<T, D> the
// body, given the warp in the block and the lane).
template <class Op, typename T, int D>
__global__ void bwd_rowwise_kernel(const typename Op::Params p) {
  Op::template run<T, D>(p, threadIdx.x >> 5, threadIdx.x & 31);
}

// Warp `warp` of this block, over the grid.  (Computed where each op first needs it: BwdKvMax's
// index taken ahead of its row count changed the SASS.)
__device__ __forceinline__ int64_t rowwise_warp_index(int warp) {
  return static_cast<int64_t>(blockIdx.x) * 8 + warp;
}

// The (row g, head h) of a preprocess or convert warp: one warp per (row, head), heads fastest.
struct RowWarp {
  int64_t g;
  int h;
  __device__ __forceinline__ static RowWarp of(const RowParams& p, int warp) {
    const int64_t w = rowwise_warp_index(warp);
    return {w / p.heads, static_cast<int>(w % p.heads)};
  }
};

// The K/V maxima of a deterministic backward: max |K| over every element and max ||V_j||^2 over every
// row (every sequence and KV head), into kv_max[0] and [1] (zeroed; non-negative floats compare as
// their bits).  With them |dQ_i| <= max|K| * sum_j |dS_ij| <= max|K| * (||dO_i|| max||V_j|| + |D_i|),
// since dS_ij = P_ij (dO_i . V_j - D_i) and the P_ij of a row sum to 1.  Warps stride over the rows
// (a grid of at most 1024 blocks), then the block reduces its 8 warps' maxima into one atomicMax.
struct KvMaxParams {
  const void* k;
  const void* v;
  RowStrides k_s, v_s;
  const int32_t* cu;  // varlen key offsets, or null
  int batch, seqlen, heads;
  int64_t rows_cap;
  unsigned int* out;
};

struct BwdKvMax {
  using Params = KvMaxParams;
  template <typename T, int D>
  __device__ __forceinline__ static void run(const Params& p, int warp, int lane) {
    const int64_t total = p.cu ? static_cast<int64_t>(p.cu[p.batch]) : p.rows_cap;
    float kmax = 0.f, vmax = 0.f;
    for (int64_t w = rowwise_warp_index(warp); w < total * p.heads; w += static_cast<int64_t>(gridDim.x) * 8) {
      const int64_t g = w / p.heads;
      const int h = static_cast<int>(w % p.heads);
      const int64_t bk = p.cu ? 0 : g / p.seqlen, rk = p.cu ? g : g % p.seqlen;
      const T* k = static_cast<const T*>(p.k) + bk * p.k_s.b + rk * p.k_s.r + h * p.k_s.h;
      const T* v = static_cast<const T*>(p.v) + bk * p.v_s.b + rk * p.v_s.r + h * p.v_s.h;
      float km = kmax, v2 = 0.f;
      for_lane_pairs<T, D>(k, v, lane, [&](float ke, float ve) {
        km = fmaxf(km, fabsf(ke));
        v2 += ve * ve;
      });
      kmax = km;
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) v2 += __shfl_xor_sync(0xffffffffu, v2, m);
      vmax = fmaxf(vmax, v2);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) kmax = fmaxf(kmax, __shfl_xor_sync(0xffffffffu, kmax, m));
    __shared__ float part[2][8];
    if (lane == 0) {
      part[0][warp] = kmax;
      part[1][warp] = vmax;
    }
    __syncthreads();
    if (threadIdx.x < 2) {
      float x = 0.f;
      for (int i = 0; i < 8; ++i) x = fmaxf(x, part[threadIdx.x][i]);
      atomicMax(p.out + threadIdx.x, __float_as_uint(x));
    }
  }
};

// Before the main kernel: row g's D = rowsum(dO * O), lse2, the skip bound, the dQ unit; slots zeroed.
struct BwdPreprocess {
  using Params = RowParams;
  template <typename T, int D>
  __device__ __forceinline__ static void run(const Params& p, int warp, int lane) {
    const auto [g, h] = RowWarp::of(p, warp);
    const int64_t total = rp_total(p);
    if (g >= p.rows_cap) return;
    if (g >= total) {
      // Varlen: the rows between the packed total and rows_cap belong to no sequence, but the
      // warp-specialized kernel's per-row TMA boxes read past a last tile into them: neutral values
      // (P = 0 for any score, no bound reached, D = 0) instead of whatever the workspace held.
      if (lane == 0) {
        p.dsum[h * p.rows_cap + g] = 0.f;
        p.lse2[h * p.rows_cap + g] = 0.f;
        if (p.bound2) p.bound2[h * p.rows_cap + g] = INFINITY;
        if (p.dq_unit) p.dq_unit[h * p.rows_cap + g] = 0.f;
      }
      return;
    }
    const T* o = static_cast<const T*>(p.o) + rp_offset(p, p.o_s, g, h);
    const T* dout = static_cast<const T*>(p.dout) + rp_offset(p, p.do_s, g, h);
    float acc = 0.f, do2 = 0.f;
    for_lane_pairs<T, D>(o, dout, lane, [&](float oe, float de) {
      acc += oe * de;
      do2 += de * de;
    });
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (p.dq_unit) {
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) do2 += __shfl_xor_sync(0xffffffffu, do2, m);
    }
    if (lane == 0) {
      p.dsum[h * p.rows_cap + g] = acc;
      if (p.dq_unit) {
        const float kmax = p.kv_max[0], vmax = sqrtf(p.kv_max[1]);
        p.dq_unit[h * p.rows_cap + g] = bwd_dq_fixed_unit(p.dq_mass * kmax * (sqrtf(do2) * vmax + fabsf(acc)));
      }
      const int64_t idx = p.cu ? h * total + g : ((g / p.seqlen) * p.heads + h) * p.seqlen + g % p.seqlen;
      // The main kernel's offline test and P = exp2(S - lse2) read this: converted once per row instead
      // of once per visited tile (and finite, so the test needs no -inf case; a NaN lse stays NaN: its
      // bound is NaN, which every legal score of the row fails, and its P is NaN, as on the CPU).
      const float l2 = p.lse[idx] * rule::kLog2e;
      const float l2f = l2 == -INFINITY ? 0.f : l2;
      p.lse2[h * p.rows_cap + g] = l2f;
      if (p.bound2) p.bound2[h * p.rows_cap + g] = bwd_row_skip_bound(p, g, l2f);
      if (p.slots) p.slots[idx] = 0;
    }
  }
};

// After the main kernel: an accumulator row (fp32, or dQ's fixed point) times mul into the output.
struct BwdConvert {
  using Params = RowParams;
  template <typename T, int D>
  __device__ __forceinline__ static void run(const Params& p, int warp, int lane) {
    const auto [g, h] = RowWarp::of(p, warp);
    if (g >= rp_total(p)) return;
    T* dst = static_cast<T*>(p.dst) + rp_offset(p, p.dst_s, g, h);
    if (p.src_fixed) {  // the fixed-point dQ: each sum to fp32 (rounded once), then out of the row's unit
      const int32_t* src = p.src_fixed + (h * p.rows_cap + g) * D;
      const float inv_unit = 1.f / p.dq_unit[h * p.rows_cap + g];  // (a power of two: exact)
#pragma unroll
      for (int c = lane * 8; c < D; c += 256) {
        float x[8];
#pragma unroll
        for (int e = 0; e < 8; e += 4) {
          const int4 y = *reinterpret_cast<const int4*>(src + c + e);
          x[e] = __int2float_rn(y.x) * inv_unit;
          x[e + 1] = __int2float_rn(y.y) * inv_unit;
          x[e + 2] = __int2float_rn(y.z) * inv_unit;
          x[e + 3] = __int2float_rn(y.w) * inv_unit;
        }
        store8<T>(dst + c, x, p.mul);
      }
      return;
    }
    const float* src = p.src + (h * p.rows_cap + g) * D;
#pragma unroll
    for (int c = lane * 8; c < D; c += 256) {
      float4 x0 = *reinterpret_cast<const float4*>(src + c);
      float4 x1 = *reinterpret_cast<const float4*>(src + c + 4);
      for (int s = 1; s < p.slices; ++s) {
        const float4 y0 = *reinterpret_cast<const float4*>(src + s * p.slice_stride + c);
        const float4 y1 = *reinterpret_cast<const float4*>(src + s * p.slice_stride + c + 4);
        x0 = make_float4(x0.x + y0.x, x0.y + y0.y, x0.z + y0.z, x0.w + y0.w);
        x1 = make_float4(x1.x + y1.x, x1.y + y1.y, x1.z + y1.z, x1.w + y1.w);
      }
      const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      store8<T>(dst + c, x, p.mul);
    }
  }
};

}  // namespace cuda
}  // namespace mala
