// The decode's combine kernel: the lse-weighted merge of the split kernel's partials (num_splits > 1).
#pragma once

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common/rule.h"
#include "cuda/core/ptx.cuh"
#include "cuda/decode/kernel.cuh"
#include "cuda/decode/params.h"

namespace mala {
namespace cuda {

// lse-weighted merge of the split partials (the combine kernel).  One work item = (output row,
// 32-dim chunk), done by one CTA of kMergeThreads threads: thread t owns float4 (t % 8) of the
// chunk and the splits t / 8, t / 8 + 16, ...; it loads all of them at once (one L2 round trip for
// up to 16 * kMergePre splits), merges them online into its own (m, l, acc), and the 16 subsets are
// merged through shared memory after one barrier (rather than a block-wide max and sum of the split
// lse before the weighted sum, which costs two more round trips).  It is the whole of its CTA's work
// (one item per CTA), so it ends without a barrier.
constexpr int kMergeThreads = 128;
constexpr int kMergeDims = 32;
constexpr int kMergeSubs = kMergeThreads / (kMergeDims / 4);  // 16 split subsets
constexpr int kMergePre = 16;  // splits per thread loaded up front (more are merged one at a time)
__host__ __device__ constexpr int merge_smem_bytes() { return kMergeSubs * (kMergeDims + 2) * 4; }
template <int D>
__host__ __device__ inline int64_t merge_items(const DecodeParams& p) {
  return static_cast<int64_t>(p.B) * p.HS * p.R * (D / kMergeDims);
}

template <typename T, int D>
__device__ void merge_item(const DecodeParams& p, int64_t item, float* sm) {
  constexpr int NCH = D / kMergeDims;
  float* red = sm;                                // [kMergeSubs][kMergeDims]
  float* red_m = sm + kMergeSubs * kMergeDims;    // [kMergeSubs]
  float* red_l = red_m + kMergeSubs;              // [kMergeSubs]
  const int chunk = static_cast<int>(item % NCH);
  const int64_t gr = item / NCH;
  const int r = static_cast<int>(gr % p.R), hs = static_cast<int>((gr / p.R) % p.HS),
            b = static_cast<int>(gr / (static_cast<int64_t>(p.R) * p.HS));
  const int qt = r / kDecodeBlockQ, lr = r % kDecodeBlockQ;
  const int64_t idx0 = ((static_cast<int64_t>(b) * p.HS + hs) * p.NQT + qt) * p.S;
  const int t = threadIdx.x, f4 = t % (kMergeDims / 4), sub = t / (kMergeDims / 4);
  const float* col = p.ws_o + (idx0 * kDecodeBlockQ + lr) * D + chunk * kMergeDims + f4 * 4;
  const float* lse_col = p.ws_lse + idx0 * kDecodeBlockQ + lr;
  const int64_t split_stride = static_cast<int64_t>(kDecodeBlockQ) * D;
  // A split's partial O is normalized by its own l, and lse_s = log2 of that l plus its m: the row's
  // O = sum_s 2^(lse_s - lse) O_s.  Splits that saw nothing for the row have lse_s = -inf, O_s = 0
  // (they add nothing); a split whose lse_s is NaN (a NaN score) makes the maxima (rule::nan_max),
  // the weights, the row's O and its lse NaN.
  float4 v[kMergePre];
  float ls[kMergePre];
#pragma unroll
  for (int k = 0; k < kMergePre; ++k) {
    const int s = sub + k * kMergeSubs;
    const bool ok = s < p.S;
    v[k] = ok ? __ldcg(reinterpret_cast<const float4*>(col + s * split_stride)) : make_float4(0.f, 0.f, 0.f, 0.f);
    ls[k] = ok ? __ldcg(lse_col + s * kDecodeBlockQ) : -INFINITY;
  }
  float m = -INFINITY, l = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kMergePre; ++k) m = rule::nan_max(m, ls[k]);
  if (m != -INFINITY) {
#pragma unroll
    for (int k = 0; k < kMergePre; ++k) {
      const float w = exp2f(ls[k] - m);
      l += w;
      acc.x += w * v[k].x, acc.y += w * v[k].y, acc.z += w * v[k].z, acc.w += w * v[k].w;
    }
  }
  for (int s = sub + kMergePre * kMergeSubs; s < p.S; s += kMergeSubs) {
    const float lv = __ldcg(lse_col + s * kDecodeBlockQ);
    const float4 ov = __ldcg(reinterpret_cast<const float4*>(col + s * split_stride));
    if (lv == -INFINITY) continue;
    const float m_new = rule::nan_max(m, lv), f = exp2f(m - m_new), w = exp2f(lv - m_new);
    l = l * f + w;
    acc.x = acc.x * f + w * ov.x, acc.y = acc.y * f + w * ov.y, acc.z = acc.z * f + w * ov.z, acc.w = acc.w * f + w * ov.w;
    m = m_new;
  }
  *reinterpret_cast<float4*>(red + sub * kMergeDims + f4 * 4) = acc;
  if (f4 == 0) {
    red_m[sub] = m;
    red_l[sub] = l;
  }
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int k = 0; k < kMergeSubs; ++k) M = rule::nan_max(M, red_m[k]);
  const int tok = p.pack ? r / p.G : r, head = p.pack ? hs * p.G + r % p.G : hs;
  if (t < kMergeDims / 2) {
    float L = 0.f, o0 = 0.f, o1 = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int k = 0; k < kMergeSubs; ++k) {
        const float w = exp2f(red_m[k] - M);  // 0 for subsets without a finite lse
        L += w * red_l[k];
        o0 += w * red[k * kMergeDims + 2 * t];
        o1 += w * red[k * kMergeDims + 2 * t + 1];
      }
    }
    const float inv = L == 0.f ? 0.f : 1.f / L;
    T* out = static_cast<T*>(p.o) + b * p.o_sb + tok * p.o_sr + head * p.o_sh + chunk * kMergeDims + 2 * t;
    *reinterpret_cast<uint32_t*>(out) = pack2<T>(o0 * inv, o1 * inv);
    if (t == 0 && chunk == 0) {
      const int64_t idx = (static_cast<int64_t>(b) * p.Hq + head) * p.Nq + tok;
      if (p.lse) p.lse[idx] = L == 0.f ? -INFINITY : log2_norm(M, L) * rule::kLn2;
      if (p.slots) {
        int cnt = 0;
        for (int s = 0; s < p.S; ++s) cnt += __ldcg(p.ws_cnt + idx0 + s);
        const int Lq = rule::visible_keys(tok, p.Nq, min(max(p.cache_seqlens[b] + p.seqlen_new, 0), p.capacity), p.causal != 0);
        p.slots[idx] = Lq > 0 ? cnt * decode_block_k(D) : 0;
      }
    }
  }
}

// The combine kernel: one CTA per merge item, launched as a programmatic dependent of the split kernel.
template <typename T, int D>
__global__ void __launch_bounds__(kMergeThreads) decode_combine_kernel(const DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // (the next call's split kernel)
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the split kernel's partials are complete
#endif
  extern __shared__ __align__(16) float cmb_smem[];
  merge_item<T, D>(p, blockIdx.x, cmb_smem);
}

}  // namespace cuda
}  // namespace mala
