// Pieces the backward main kernels share (kernel_sm80.cuh, and in part the warp-specialized ones):
// the CTA's work and rows, the per-row loaders, the recorded outputs, the CTA vote, the retained
// tile's loads and the dK/dV stores.
#pragma once

#include <math.h>
#include <stdint.h>

#include "common/rule.h"
#include "cuda/attn/mask.cuh"
#include "cuda/attn/skip.cuh"
#include "cuda/bwd/cta_order.h"
#include "cuda/bwd/params.cuh"
#include "cuda/core/ptx.cuh"
#include "mala/tile_state.h"

namespace mala {
namespace cuda {

// 4-byte global->shared copy, zero-filled when !valid (the scalars lse and D of a query tile).
__device__ __forceinline__ void bwd_cp_async_4(uint32_t smem, const void* gmem, bool valid) {
  int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_size));
}

// Fire-and-forget fp32 add of two consecutive floats (8-byte aligned).
__device__ __forceinline__ void bwd_red_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// What one CTA covers: key tile j (BK keys from kb) of sequence b and KV head hk, the query heads
// h0 .. h0 + heads_per_cta - 1 (head split hs), and their query tiles of BQ rows, ascending from the
// first one with a legal entry; iteration t visits query head head(t), query tile q_tile(t).  CTAs
// are ordered so that key tiles with more query tiles come first.
struct BwdWork {
  int j, hs, hk, b;
  bool varlen;
  int qlen, klen, kb, kn, i_start, n_iq, n_iter, h0, heads_per_cta;
  int64_t qrow0, krow0, total_q;
  __device__ __forceinline__ int head(int t) const { return h0 + t / n_iq; }
  __device__ __forceinline__ int q_tile(int t) const { return i_start + t % n_iq; }
  // Iteration t's (head, query tile) in one word (head << 16 | query tile; n_q_tiles < 65536, which
  // dispatch.cu checks), for the wgmma kernel, which steps from one to the next (next) instead of
  // dividing by n_iq (head(t), q_tile(t)).
  struct Tile {
    uint32_t v;
    __device__ __forceinline__ int h() const { return static_cast<int>(v >> 16); }
    __device__ __forceinline__ int qi() const { return static_cast<int>(v & 0xffffu); }
  };
  __device__ __forceinline__ Tile tile(int t) const {
    return {static_cast<uint32_t>(head(t)) << 16 | static_cast<uint32_t>(q_tile(t))};
  }
  __device__ __forceinline__ Tile next(Tile x) const {
    return x.qi() + 1 < i_start + n_iq ? Tile{x.v + 1} : Tile{(x.v & 0xffff0000u) + 0x10000u + i_start};
  }
  // (query head h, row) in lse and bwd_slots: [B, Hq, Nq], or [Hq, total rows] for varlen.
  __device__ __forceinline__ int64_t row_index(const BwdParams& p, int h, int row) const {
    return varlen ? h * total_q + qrow0 + row : (static_cast<int64_t>(b) * p.heads_q + h) * p.seqlen_q + row;
  }
};

// Whether the forward retained some forward tile inside backward tile (query head h, query tile i
// of BQ rows, the CTA's key tile), from BwdParams::fwd_mask (not null).  A tile it did not is
// skipped without its scores (the forward's running normaliser never exceeds the final lse).
template <int BQ, int BK>
__device__ __forceinline__ bool bwd_forward_retained(const BwdParams& p, const BwdWork& w, int h, int i) {
  const uint8_t* m = p.fwd_mask + (static_cast<int64_t>(w.b) * p.heads_q + h) * p.fwd_n_q_tiles * p.fwd_n_k_tiles;
  const int q1 = min((i * BQ + BQ - 1) / p.fwd_bq, p.fwd_n_q_tiles - 1);
  const int k1 = min((w.kb + BK - 1) / p.fwd_bk, p.fwd_n_k_tiles - 1);
  bool any = false;
  for (int q = i * BQ / p.fwd_bq; q <= q1; ++q)
    for (int k = w.kb / p.fwd_bk; k <= k1; ++k) any |= m[static_cast<int64_t>(q) * p.fwd_n_k_tiles + k] == kTileRetained;
  return any;
}
// Bit l: whether tile t0 + l of the CTA's visiting order (query tiles ascending, heads outer) may be
// retained (bwd_forward_retained); 0 past the last tile.  Every lane of the warp calls it.
template <int BQ, int BK>
__device__ __forceinline__ uint32_t bwd_forward_retained32(const BwdParams& p, const BwdWork& w, int t0, int lane) {
  const int t = t0 + lane;
  return __ballot_sync(0xffffffffu, t < w.n_iter && bwd_forward_retained<BQ, BK>(p, w, w.head(t), w.q_tile(t)));
}

// The CTA's work; kb >= klen means none (a key tile past this sequence's end).  kKeySlowest: the
// mma.sync kernel's launch order (bwd/cta_order.h).
template <int BQ, int BK, bool kKeySlowest = false>
__device__ __forceinline__ BwdWork bwd_cta_work(const BwdParams& p) {
  BwdWork w;
  // Launch order: key tile 0 of every (sequence, KV head, head split) first, then each of those with
  // its other key tiles ascending (bwd/cta_order.h says why).
  const int per_j = p.batch * p.heads_kv * p.head_splits;
  const BwdCtaSlot slot =
      kKeySlowest ? bwd_cta_slot_key_slowest(blockIdx.x, per_j) : bwd_cta_slot(blockIdx.x, p.n_k_tiles, per_j);
  w.j = slot.j;
  int rest = slot.rest;
  w.hs = rest % p.head_splits;
  rest /= p.head_splits;
  w.hk = rest % p.heads_kv;
  w.b = rest / p.heads_kv;
  w.varlen = p.cu_q != nullptr;
  w.qlen = p.seqlen_q;
  w.klen = p.seqlen_k;
  w.qrow0 = static_cast<int64_t>(w.b) * p.seqlen_q;
  w.krow0 = static_cast<int64_t>(w.b) * p.seqlen_k;
  if (w.varlen) {
    w.qrow0 = p.cu_q[w.b];
    w.qlen = p.cu_q[w.b + 1] - p.cu_q[w.b];
    w.krow0 = p.cu_k[w.b];
    w.klen = p.cu_k[w.b + 1] - p.cu_k[w.b];
  }
  w.kb = w.j * BK;
  w.kn = min(BK, w.klen - w.kb);
  w.i_start = p.causal ? max(w.kb - (w.klen - w.qlen), 0) / BQ : 0;  // first row seeing key kb
  w.n_iq = max(rule::ceil_div(w.qlen, BQ) - w.i_start, 0);
  w.heads_per_cta = p.heads_per_cta;
  w.n_iter = p.heads_per_cta * w.n_iq;
  w.h0 = w.hk * p.group + w.hs * p.heads_per_cta;
  w.total_q = w.varlen ? static_cast<int64_t>(p.cu_q[p.batch]) : 0;
  return w;
}

// The CTA's input rows: this sequence's first Q and dO row, this key tile's first K and V row (of KV
// head hk).
template <typename T>
struct BwdRows {
  const T *q, *dout, *k, *v;
};
template <typename T>
__device__ __forceinline__ BwdRows<T> bwd_rows(const BwdParams& p, const BwdWork& w) {
  BwdRows<T> r;
  r.q = static_cast<const T*>(p.q) + (w.varlen ? w.qrow0 * p.q_r : w.b * p.q_b);
  r.dout = static_cast<const T*>(p.dout) + (w.varlen ? w.qrow0 * p.do_r : w.b * p.do_b);
  r.k = static_cast<const T*>(p.k) + (w.varlen ? w.krow0 * p.k_r : w.b * p.k_b) + static_cast<int64_t>(w.kb) * p.k_r +
        w.hk * p.k_h;
  r.v = static_cast<const T*>(p.v) + (w.varlen ? w.krow0 * p.v_r : w.b * p.v_b) + static_cast<int64_t>(w.kb) * p.v_r +
        w.hk * p.v_h;
  return r;
}

// The per-row scalars of query tile (head h, rows r0 .., `valid` of them): lse in log2 units (with Q,
// by cp.async) and, when THR, log2(tau / L_q) (a plain store: read after the next top barrier; rows
// without legal keys get +inf, which never constrains); D = rowsum(dO * O) (with dO).  The mma.sync
// kernel writes the threshold at tau = 0 too, unused: leaving it out made ptxas spill 44 bytes in
// its d = 256 instance.
template <int BQ, bool THR>
__device__ __forceinline__ void bwd_load_lse_thr(const BwdParams& p, const BwdWork& w, int h, int r0, int valid,
                                                 uint32_t lse_dst, float* thr_dst) {
  const int tid = threadIdx.x;
  if (tid < BQ) {
    const bool ok = tid < valid;
    const float* l2 = p.lse2 + h * p.rows_q_cap + w.qrow0 + r0 + tid;  // finite (preprocess kernel)
    bwd_cp_async_4(lse_dst + tid * 4, ok ? l2 : p.lse2, ok);
    if (THR) {
      const int L = ok ? rule::visible_keys(r0 + tid, w.qlen, w.klen, p.causal) : 0;
      thr_dst[tid] = row_log2_threshold_or_inf(p.log2_tau, rule::threshold_length(L, r0 + tid, p.rows_before));
    }
  }
}
template <int BQ>
__device__ __forceinline__ void bwd_load_dsum(const BwdParams& p, const BwdWork& w, int h, int r0, int valid,
                                              uint32_t dst) {
  const int tid = threadIdx.x;
  if (tid < BQ) {
    const bool ok = tid < valid;
    const float* src = ok ? p.dsum + h * p.rows_q_cap + w.qrow0 + r0 + tid : p.dsum;
    bwd_cp_async_4(dst + tid * 4, src, ok);
  }
}

// The optional outputs of one decision (tile mask, slot counters) for iteration t.
// tid: the thread's index among the kernel's math threads (threadIdx.x, or the consumer index of the
// warp-specialized kernel).
template <int BQ, int BK>
__device__ __forceinline__ void bwd_record_tile(const BwdParams& p, const BwdWork& w, int h, int i, bool keep,
                                                int tid) {
  if (p.tile_mask != nullptr && tid == 0)
    p.tile_mask[((static_cast<int64_t>(w.b) * p.heads_q + h) * p.n_q_tiles + i) * p.n_k_tiles + w.j] =
        keep ? kTileRetained : kTileSkipped;
  if (keep && p.bwd_slots != nullptr && tid < BQ) {
    const int r = i * BQ + tid;
    if (r < w.qlen && rule::visible_keys(r, w.qlen, w.klen, p.causal) > 0)
      atomicAdd(p.bwd_slots + w.row_index(p, h, r), BK);
  }
}
template <int BQ, int BK>
__device__ __forceinline__ void bwd_record(const BwdParams& p, const BwdWork& w, int t, bool keep) {
  bwd_record_tile<BQ, BK>(p, w, w.head(t), w.q_tile(t), keep, static_cast<int>(threadIdx.x));
}

// The loads a retained tile t issues (the pipeline both main kernels share; Q stages nqs, LA = nqs - 1
// tiles of Q lookahead): dO_t unless it was prefetched, dO_{t+1} speculatively (right when the next
// tile is retained too, as on dense inputs), Q_{t+2} with three Q stages.  A dO_t issued here is
// followed by (t + 1 < n_iter) + (q_late) groups: bwd_wait_do's count.
template <typename LoadDo, typename LoadQ>
__device__ __forceinline__ void bwd_issue_retained(int t, int n_iter, int nqs, bool do_ready, LoadDo&& load_do,
                                                  LoadQ&& load_q) {
  const bool spec = t + 1 < n_iter, q_late = nqs == 3 && t + 2 < n_iter;
  if (!do_ready) {
    load_do(t, t & 1);
    cp_async_commit();
  }
  if (spec) {
    load_do(t + 1, (t + 1) & 1);
    cp_async_commit();
  }
  if (q_late) {
    load_q(t + 2, (t + 2) % nqs);
    cp_async_commit();
  }
}
// Waits for a dO_t that was not prefetched (`newer` groups were issued after it).
__device__ __forceinline__ void bwd_wait_do(int newer) {
  if (newer == 2)
    cp_async_wait<2>();
  else if (newer == 1)
    cp_async_wait<1>();
  else
    cp_async_wait<0>();
}

// dK (scaled) and dV of key row r (< kn) of the tile, NF pairs of head-dim columns col0 + 8n, +1:
// into the fp32 workspace (query-head group split over CTAs) or straight to the outputs.  frag(n)
// gives {dk, dk, dv, dv} of pair n (each kernel has its own fragment layout).
template <typename T, int D, int NF, typename Frag>
__device__ __forceinline__ void bwd_store_dkdv_row(const BwdParams& p, const BwdWork& w, int r, int col0, Frag&& frag) {
  if (p.dk_acc != nullptr) {
    const int64_t at = (w.hk * p.rows_k_cap + w.krow0 + w.kb + r) * D + col0 + w.hs * p.kv_slice;
    float* dka = p.dk_acc + at;
    float* dva = p.dv_acc + at;
#pragma unroll
    for (int n = 0; n < NF; ++n) {
      const float4 v = frag(n);
      if (p.kv_slice > 0) {
        *reinterpret_cast<float2*>(dka + n * 8) = make_float2(v.x * p.scale, v.y * p.scale);
        *reinterpret_cast<float2*>(dva + n * 8) = make_float2(v.z, v.w);
      } else {
        bwd_red_add2(dka + n * 8, v.x * p.scale, v.y * p.scale);
        bwd_red_add2(dva + n * 8, v.z, v.w);
      }
    }
  } else {
    T* dkp = static_cast<T*>(p.dk) + (w.varlen ? w.krow0 * p.dk_r : w.b * p.dk_b) +
             static_cast<int64_t>(w.kb + r) * p.dk_r + w.hk * p.dk_h + col0;
    T* dvp = static_cast<T*>(p.dv) + (w.varlen ? w.krow0 * p.dv_r : w.b * p.dv_b) +
             static_cast<int64_t>(w.kb + r) * p.dv_r + w.hk * p.dv_h + col0;
#pragma unroll
    for (int n = 0; n < NF; ++n) {
      const float4 v = frag(n);
      *reinterpret_cast<uint32_t*>(dkp + n * 8) = pack2<T>(v.x * p.scale, v.y * p.scale);
      *reinterpret_cast<uint32_t*>(dvp + n * 8) = pack2<T>(v.z, v.w);
    }
  }
}

}  // namespace cuda
}  // namespace mala
