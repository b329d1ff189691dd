// The fused MALA backward kernel (offline rule), hand-written mma.sync m16n8k16, one source for
// sm_80 and sm_90a.  Launched through bwd/instance.cuh; bwd/dispatch.cu chooses it.
// On sm_90 the warp-specialized kernels run instead wherever the TMA can describe the tensors (same
// work split and rule; the pieces they share are in common.cuh).
//
// One CTA (8 warps) owns one key tile J_j (BK keys) of one KV head of one sequence, and a set of
// `heads_per_cta` query heads of that KV head's group.  K_j and V_j stay in shared memory, dK and dV
// accumulate in registers.  The CTA walks (head, query tile) pairs, query tiles ascending from the
// first one with a legal entry.  Per visited tile (BQ query rows):
//   1. S^T = K_j Q_i^T (warp w: 16 keys x BQ queries, fp32 C fragments), scaled to log2 units.
//   2. The offline test, entry by entry with rule::row_allows_skip(s, lse, log(tau/L_q)) in base 2
//      (equivalent to the row-max form: every legal entry must allow the skip), voted over the CTA
//      with __syncthreads_or.  A skipped tile stops here: no dO, no D, no exp, no further matmul.
//   3. Retained: P^T = exp2(S^T - lse), dP^T = V_j dO_i^T, dS^T = P^T (dP^T - D), P^T and dS^T are
//      repacked in registers as A fragments: dV += P^T dO_i, dK += dS^T Q_i; dS^T also goes to shared
//      memory (two buffers) for dQ_i += dS K_j (warps split dQ's rows/cols), computed at the start of
//      the next iteration (after its top barrier, so no extra barrier) and added to the fp32
//      workspace with red.global.add (v2 on sm_90).
// Pipelining: Q_{t+1} (with its lse; log2(tau/L) is computed into shared memory) is prefetched with
// cp.async while tile t is processed.  dO/D of tile t are loaded only once tile t is retained, except
// for a speculative prefetch of dO_{t+1} issued when tile t was retained (always right with tau = 0
// and on dense inputs; on sparse inputs it is rarely issued because a skipped tile issues none).
// The first tile of every CTA has its dO prefetched too (it is usually retained).  So dO is loaded
// for a skipped tile only when it directly follows a retained one (or is a CTA's first tile).
// Barriers per tile: 1 (tau = 0: template kDense, no test code), tau > 0: + the vote through an
// mbarrier (every warp arrives; a warp that would skip waits, a warp that retains goes on: its vote
// already decides the tile), +1 when dO_t was not prefetched.  The deferred dQ of the previous tile
// runs before S (after the top barrier): run between the vote's arrive and wait it overlapped the
// vote but kept S live and spilled.
// Q stages: 3 where the opt-in shared memory allows (sm_90), else 2 (sm_80 at d = 128).
// The scale is applied once at the end (dK in the epilogue, dQ in the convert kernel).
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/rule.h"
#include "cuda/bwd/common.cuh"
#include "cuda/bwd/params.cuh"
#include "cuda/core/ptx.cuh"
#include "cuda/core/smem_tile.cuh"

namespace mala {
namespace cuda {

template <typename T, int D>
struct BwdKernel {
  using Cfg = BwdConfig<D>;
  static constexpr int BQ = Cfg::BQ, BK = Cfg::BK, WD = Cfg::WARPS_D;
  static constexpr int kThreads = 256, kWarps = 8;
  static constexpr int kKeyWarps = kWarps / WD;  // 16-key slabs
  static_assert(kKeyWarps * 16 == BK, "BK must be 16 keys per key slab");
  static constexpr int DW = D / WD;   // dK/dV columns per warp
  static constexpr int NT = BQ / 8;   // n8 tiles of S^T per warp
  static constexpr int KQ = BQ / 16;  // k16 steps over the query rows
  static constexpr int KD = D / 16;   // k16 steps over the head dim
  static constexpr int NDW = DW / 8;  // n8 tiles of dK/dV per warp
  // dQ = dS K: each warp owns MQ m16 tiles of query rows and DQN columns.  MQ = 2 (fewer warps along
  // the rows, so each warp's K fragments cover fewer columns: 32 instead of 40 ldmatrix per warp
  // and tile at d = 128) is faster for the tau > 0 instance at d = 128 but spills registers in the
  // kDense instance, so the layout is chosen per instance (dq_mt below); d = 64 and 256 keep MQ = 1.
  template <int MQ>
  struct DqLayout {
    static constexpr int WQ = BQ / (16 * MQ);  // warps along query rows
    static constexpr int WDQ = kWarps / WQ;
    static constexpr int DQN = D / WDQ;  // columns per warp
    static constexpr int NDQ = DQN / 8;
    static_assert(BQ % (16 * MQ) == 0 && NDQ % 2 == 0, "dQ layout");
  };
  static constexpr int dq_mt(bool dense) { return !dense && D == 128 ? 2 : 1; }
  static_assert(NT % 2 == 0 && NDW % 2 == 0, "fragment pairs");

  using KTile = SmemTile<BK, D>;
  using QTile = SmemTile<BQ, D>;
  using STile = SmemTile<BK, BQ>;  // dS^T [key][query]

  // Shared memory: K, V, dO (2 stages), dS^T (2 buffers), D (2 stages), lse and log2(tau/L_q)
  // (3 stages each), the vote's two mbarriers and flags, then Q (q_stages = 2 or 3 stages), after
  // the struct so that its size can vary.
  struct Storage {
    unsigned char k[KTile::kBytes];
    unsigned char v[KTile::kBytes];
    unsigned char dout[2][QTile::kBytes];
    unsigned char ds[2][STile::kBytes];
    float dsum[2][BQ];
    float lse[3][BQ];
    float thr[3][BQ];
    uint64_t mbar[2];
    uint32_t vote[2];
    uint32_t pad[26];  // to 112 bytes from mbar: the Q tiles start 128-aligned
  };
  static constexpr int kQ = sizeof(Storage);  // the Q stages
  static_assert(kQ % 128 == 0, "Q tiles aligned");
  static constexpr int smem_bytes(int q_stages) { return kQ + q_stages * QTile::kBytes; }
  static_assert(smem_bytes(3) == bwd_smem_bytes<D>(3), "bwd_smem_bytes (params.cuh) out of date");
};

template <typename T, int D, bool kDense>
__global__ void __launch_bounds__(256, 1) bwd_main_kernel(const BwdParams p) {
  // kDense (tau = 0): every visited tile is retained; the test, the vote and their code are compiled out.
  using KC = BwdKernel<T, D>;
  constexpr int BQ = KC::BQ, BK = KC::BK;
  constexpr int NT = KC::NT, KQ = KC::KQ, KD = KC::KD, NDW = KC::NDW;
  using KTile = typename KC::KTile;
  using QTile = typename KC::QTile;
  using STile = typename KC::STile;
  using Sm = typename KC::Storage;

  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const BwdWork w = bwd_cta_work<BQ, BK, true>(p);
  if (w.kb >= w.klen) return;
  const int qlen = w.qlen, klen = w.klen, kb = w.kb, kn = w.kn, n_iter = w.n_iter, h0 = w.h0, n_iq = w.n_iq,
            i_start = w.i_start;
  const int64_t qrow0 = w.qrow0;

  const BwdRows<T> rows = bwd_rows<T>(p, w);
  const T *q_base = rows.q, *do_base = rows.dout, *k_ptr = rows.k, *v_ptr = rows.v;

  const uint32_t sbase = smem_addr(smem);
  const uint32_t sK = sbase + offsetof(Sm, k), sV = sbase + offsetof(Sm, v), sQ = sbase + KC::kQ,
                 sDO = sbase + offsetof(Sm, dout), sDS = sbase + offsetof(Sm, ds);
  const float* lse_s = reinterpret_cast<const float*>(smem + offsetof(Sm, lse));
  const float* dsum_s = reinterpret_cast<const float*>(smem + offsetof(Sm, dsum));

  KTile::template load_async<256>(sK, k_ptr, p.k_r, kn, tid);
  KTile::template load_async<256>(sV, v_ptr, p.v_r, kn, tid);
  cp_async_commit();

  auto load_q = [&](int t, int stage) {
    const int h = h0 + t / n_iq, r0 = (i_start + t % n_iq) * BQ, valid = min(BQ, qlen - r0);
    QTile::template load_async<256>(sQ + stage * QTile::kBytes, q_base + static_cast<int64_t>(r0) * p.q_r + h * p.q_h,
                                    p.q_r, valid, tid);
    bwd_load_lse_thr<BQ, true>(p, w, h, r0, valid, sbase + offsetof(Sm, lse) + stage * BQ * 4,
                               reinterpret_cast<float*>(smem + offsetof(Sm, thr)) + stage * BQ);
  };
  auto load_do = [&](int t, int stage) {
    const int h = h0 + t / n_iq, r0 = (i_start + t % n_iq) * BQ, valid = min(BQ, qlen - r0);
    QTile::template load_async<256>(sDO + stage * QTile::kBytes,
                                    do_base + static_cast<int64_t>(r0) * p.do_r + h * p.do_h, p.do_r, valid, tid);
    bwd_load_dsum<BQ>(p, w, h, r0, valid, sbase + offsetof(Sm, dsum) + stage * BQ * 4);
  };

  const int kw = warp % KC::kKeyWarps;  // key slab of this warp
  const int dwi = warp / KC::kKeyWarps;  // head-dim part of dK/dV of this warp
  const int key0 = kw * 16;
  const int g = lane >> 2, tq = lane & 3;

  float dk[NDW][4], dv[NDW][4];
#pragma unroll
  for (int n = 0; n < NDW; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

  // dQ_i (+)= dS K for a retained tile whose dS^T sits in buffer `buf`: warp (wq, wdq) owns rows
  // wq*16*MQ.. and columns wdq*DQN..  Deferred to the next iteration (after its top barrier) so
  // that no extra barrier is needed between writing dS^T and reading it.
  auto do_dq = [&](int h, int q0, int buf) {
    constexpr int MQ = KC::dq_mt(kDense);
    using DQL = typename KC::template DqLayout<MQ>;
    constexpr int NDQ = DQL::NDQ;
    const uint32_t sDSb = sDS + buf * STile::kBytes;
    const int wq = warp % DQL::WQ, wdq = warp / DQL::WQ;
    float dq[MQ][NDQ][4];
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
      for (int n = 0; n < NDQ; ++n) dq[mq][n][0] = dq[mq][n][1] = dq[mq][n][2] = dq[mq][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t a[MQ][4];
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, STile::bt_addr(sDSb, kk * 16, (wq * MQ + mq) * 16, lane));
        a[mq][0] = r[0];
        a[mq][1] = r[2];
        a[mq][2] = r[1];
        a[mq][3] = r[3];
      }
#pragma unroll
      for (int n2 = 0; n2 < NDQ / 2; ++n2) {
        uint32_t bk[4];
        ldmatrix_x4_trans(bk, KTile::bt_addr(sK, kk * 16, wdq * DQL::DQN + n2 * 16, lane));
#pragma unroll
        for (int mq = 0; mq < MQ; ++mq) {
          mma_16816<T>(dq[mq][2 * n2], a[mq], bk);
          mma_16816<T>(dq[mq][2 * n2 + 1], a[mq], bk + 2);
        }
      }
    }
    float* dqa = p.dq_acc + (h * p.rows_q_cap + qrow0 + q0) * D;
#pragma unroll
    for (int mq = 0; mq < MQ; ++mq)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = (wq * MQ + mq) * 16 + g + hh * 8;
        if (q0 + r < qlen) {
#pragma unroll
          for (int n = 0; n < NDQ; ++n)
            bwd_red_add2(dqa + r * D + wdq * DQL::DQN + n * 8 + 2 * tq, dq[mq][n][2 * hh], dq[mq][n][2 * hh + 1]);
        }
      }
  };
  bool pend = false;
  int pend_h = 0, pend_q0 = 0, pend_buf = 0;
  // Vote state of the mbarrier vote (tau > 0): two mbarriers + two flags.
  uint32_t* vote_s = reinterpret_cast<uint32_t*>(smem + offsetof(Sm, vote));
  const uint32_t mbar_s = sbase + offsetof(Sm, mbar);
  if (!kDense && tid == 0) {
    mbar_init(mbar_s, KC::kWarps);
    mbar_init(mbar_s + 8, KC::kWarps);
    vote_s[0] = vote_s[1] = 0u;
  }

  // Q_{t+LA} is prefetched during tile t.  LA = 1: issued at the top of the iteration.  LA = 2: issued
  // after the decision (so that the cp.async groups complete in the order they are waited for).
  const int nqs = p.q_stages, LA = nqs - 1;
  bool do_ready = false;
  if (n_iter > 0) {
    load_q(0, 0);
    cp_async_commit();
    load_do(0, 0);  // the first tile of a key tile is usually retained
    cp_async_commit();
    do_ready = true;
    if (LA == 2 && n_iter > 1) {
      load_q(1, 1);
      cp_async_commit();
    }
  }

  // The optional outputs of a decision (tile mask, slot counters).  With tau > 0 they are written one
  // iteration late, where the scores are not live: written right after the vote they cost register
  // spills (ptxas -v, d = 128).
  bool last_retain = false;
  const bool recording = !kDense && (p.tile_mask != nullptr || p.bwd_slots != nullptr);
  auto record = [&](int tt, bool keep) { bwd_record<BQ, BK>(p, w, tt, keep); };

  for (int t = 0; t < n_iter; ++t) {
    const int st = t & 1, qs = t % nqs;
    const int h = h0 + t / n_iq, q0 = (i_start + t % n_iq) * BQ;
    if (LA == 2 && t + 1 < n_iter)
      cp_async_wait<1>();  // Q_{t+1} may stay in flight
    else
      cp_async_wait<0>();
    __syncthreads();
    if (LA == 1 && t + 1 < n_iter) {
      load_q(t + 1, (t + 1) % nqs);
      cp_async_commit();
    }
    const uint32_t sQs = sQ + qs * QTile::kBytes, sDOs = sDO + st * QTile::kBytes;
    if (!kDense && tid == 0) vote_s[st ^ 1] = 0u;  // last read before this barrier, next written after the next
    if (recording && t > 0) record(t - 1, last_retain);
    if (pend) {  // before S: the scores are not live yet (no register spills)
      do_dq(pend_h, pend_q0, pend_buf);
      pend = false;
    }

    // ---- 1. S^T = K Q^T -------------------------------------------------------------------------
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, KTile::a_addr(sK, key0, kk * 16, lane));
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        uint32_t bq[4];
        ldmatrix_x4(bq, QTile::b_addr(sQs, n2 * 16, kk * 16, lane));
        mma_16816<T>(s[2 * n2], a, bq);
        mma_16816<T>(s[2 * n2 + 1], a, bq + 2);
      }
    }

    // ---- 2. mask + offline test -----------------------------------------------------------------
    const bool need_mask = keys_x_rows_needs_mask(q0, BQ, kb, BK, qlen, klen, p.causal);
    const float* lse_t = lse_s + qs * BQ;
    const float* thr_t = reinterpret_cast<const float*>(smem + offsetof(Sm, thr)) + qs * BQ;
    // Scale to log2 units and mask (both instances), then the test (tau > 0).
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        int L = BK + kb;  // only compared when masking
        if (need_mask) {
          const int qr = q0 + n * 8 + 2 * tq + c;
          L = qr < qlen ? rule::visible_keys(qr, qlen, klen, p.causal) : 0;
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int e = hh * 2 + c;
          float x = s[n][e] * p.scale_log2;
          if (need_mask && kb + key0 + g + hh * 8 >= L) x = -INFINITY;
          s[n][e] = x;
        }
      }
    // The test of this lane's two entries of each query column (keys g and g + 8) on their maximum:
    // the same decision as testing each entry (x - l2 < thr is monotone in x), half the work.
    // (No early stop once some lane of the warp retains: a warp vote per column group costs sparse
    // inputs more than it saves random ones.)
    bool allow = true;
    if (!kDense) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = n * 8 + 2 * tq + c;
          allow &= rule::row_allows_skip(rule::nan_max(s[n][c], s[n][c + 2]), lse_t[col], thr_t[col]);
        }
      }
    }
    bool retain = true;
    if (!kDense) {
      retain = cta_vote_mbarrier(__any_sync(0xffffffffu, !allow), vote_s, mbar_s, st, t);
    }
    const bool q_late = LA == 2 && t + 2 < n_iter;
    if (kDense) record(t, true);  // (no scores-live pressure problem without the test)
    last_retain = retain;
    if (!retain) {
      if (q_late) {
        load_q(t + 2, (t + 2) % nqs);
        cp_async_commit();
      }
      do_ready = false;
      continue;
    }
    // ---- 3. retained: dO, P, dP, dS, dV, dK, dQ -----------------------------------------------------
    const bool spec = t + 1 < n_iter;
    bwd_issue_retained(t, n_iter, nqs, do_ready, load_do, load_q);
    // P = exp2(S - lse) (masked entries are -inf; rows without legal keys may have lse = -inf)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float l2 = lse_t[n * 8 + 2 * tq + c];  // log2 units, -inf mapped to 0 (masked rows: P = 0)
        s[n][c] = exp2f(s[n][c] - l2);
        s[n][c + 2] = exp2f(s[n][c + 2] - l2);
      }
    if (!do_ready) {  // (a prefetched dO_t arrived before the top barrier)
      bwd_wait_do((spec ? 1 : 0) + (q_late ? 1 : 0));
      __syncthreads();
    }
    do_ready = spec;

    float dp[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, KTile::a_addr(sV, key0, kk * 16, lane));
#pragma unroll
      for (int n2 = 0; n2 < NT / 2; ++n2) {
        uint32_t bo[4];
        ldmatrix_x4(bo, QTile::b_addr(sDOs, n2 * 16, kk * 16, lane));
        mma_16816<T>(dp[2 * n2], a, bo);
        mma_16816<T>(dp[2 * n2 + 1], a, bo + 2);
      }
    }
    const float* dsum_t = dsum_s + st * BQ;
    uint32_t pa[KQ][4], da[KQ][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float dd = dsum_t[n * 8 + 2 * tq + c];
        dp[n][c] = s[n][c] * (dp[n][c] - dd);
        dp[n][c + 2] = s[n][c + 2] * (dp[n][c + 2] - dd);
      }
#pragma unroll
    for (int kq = 0; kq < KQ; ++kq) {
      pa[kq][0] = pack2<T>(s[2 * kq][0], s[2 * kq][1]);
      pa[kq][1] = pack2<T>(s[2 * kq][2], s[2 * kq][3]);
      pa[kq][2] = pack2<T>(s[2 * kq + 1][0], s[2 * kq + 1][1]);
      pa[kq][3] = pack2<T>(s[2 * kq + 1][2], s[2 * kq + 1][3]);
      da[kq][0] = pack2<T>(dp[2 * kq][0], dp[2 * kq][1]);
      da[kq][1] = pack2<T>(dp[2 * kq][2], dp[2 * kq][3]);
      da[kq][2] = pack2<T>(dp[2 * kq + 1][0], dp[2 * kq + 1][1]);
      da[kq][3] = pack2<T>(dp[2 * kq + 1][2], dp[2 * kq + 1][3]);
    }
    if (dwi == 0) {
#pragma unroll
      for (int kq = 0; kq < KQ; ++kq) {
        const int r = key0 + g, c = kq * 16 + 2 * tq;
        *reinterpret_cast<uint32_t*>(smem + offsetof(Sm, ds) + st * STile::kBytes + STile::offset_elem(r, c)) = da[kq][0];
        *reinterpret_cast<uint32_t*>(smem + offsetof(Sm, ds) + st * STile::kBytes + STile::offset_elem(r + 8, c)) = da[kq][1];
        *reinterpret_cast<uint32_t*>(smem + offsetof(Sm, ds) + st * STile::kBytes + STile::offset_elem(r, c + 8)) = da[kq][2];
        *reinterpret_cast<uint32_t*>(smem + offsetof(Sm, ds) + st * STile::kBytes + STile::offset_elem(r + 8, c + 8)) = da[kq][3];
      }
    }
    // dV += P^T dO, dK += dS^T Q  (this warp's keys x its head-dim part)
#pragma unroll
    for (int kq = 0; kq < KQ; ++kq) {
#pragma unroll
      for (int n2 = 0; n2 < NDW / 2; ++n2) {
        uint32_t bo[4];
        ldmatrix_x4_trans(bo, QTile::bt_addr(sDOs, kq * 16, dwi * KC::DW + n2 * 16, lane));
        mma_16816<T>(dv[2 * n2], pa[kq], bo);
        mma_16816<T>(dv[2 * n2 + 1], pa[kq], bo + 2);
      }
#pragma unroll
      for (int n2 = 0; n2 < NDW / 2; ++n2) {
        uint32_t bq[4];
        ldmatrix_x4_trans(bq, QTile::bt_addr(sQs, kq * 16, dwi * KC::DW + n2 * 16, lane));
        mma_16816<T>(dk[2 * n2], da[kq], bq);
        mma_16816<T>(dk[2 * n2 + 1], da[kq], bq + 2);
      }
    }
    pend = true;
    pend_h = h;
    pend_q0 = q0;
    pend_buf = st;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (pend) do_dq(pend_h, pend_q0, pend_buf);
  if (recording && n_iter > 0) record(n_iter - 1, last_retain);

  // ---- epilogue: dK (scaled), dV ------------------------------------------------------------------
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = key0 + g + hh * 8;
    if (r >= kn) continue;
    bwd_store_dkdv_row<T, D, NDW>(p, w, r, dwi * KC::DW + 2 * tq, [&](int n) {
      return make_float4(dk[n][2 * hh], dk[n][2 * hh + 1], dv[n][2 * hh], dv[n][2 * hh + 1]);
    });
  }
}

// Launches the instance `dense` names (grid: key tiles x batch x KV heads x head splits).
template <typename T, int D>
cudaError_t launch_bwd_sm80(const BwdParams& p, bool dense, cudaStream_t stream) {
  using KC = BwdKernel<T, D>;
  const int smem = KC::smem_bytes(p.q_stages);
  auto kernel = dense ? bwd_main_kernel<T, D, true> : bwd_main_kernel<T, D, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int64_t grid = static_cast<int64_t>(p.n_k_tiles) * p.batch * p.heads_kv * p.head_splits;
  if (grid <= 0) return cudaSuccess;
  kernel<<<static_cast<unsigned>(grid), KC::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala
