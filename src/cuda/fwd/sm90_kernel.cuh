// The sm_90 forward (wgmma + TMA), every head dim, sm_90a: every tau wherever the TMA can describe K
// and V (fwd/dispatch.cu).  Its decision tile is kDecRows query rows x BK keys (BK: 128, 64 at
// d = 256, where Q stays in shared memory; kDecRows: a warp's 16 rows at d = 128, a warp pair's 32 at
// d = 64 and 256), one test and one vote per key tile (forward_tiles reports it).  Two 32 x 64
// decisions per 128-key tile cost more than 64-key tiles save: the second test waits for the first
// half's exponentials (docs/kernels.md, "128-key forward").
//
// A CTA is three warpgroups over 128 query rows (causal: the longest query tiles first), by role:
//   shell (this file): shared memory (FwdK128::Storage, fwd/sm90_traits.cuh), the mbarriers' init,
//     the warp roles, the launcher;
//   producer (warpgroup 0, 24 registers; this file): one thread issues every TMA load, K(t) and V(t)
//     into rings of kStages slots (MbarRing, core/pipeline.cuh), in the consumers' order: K(top),
//     then K(t - 1) before V(t).  Dense, and d = 64 (FwdK128::kVSkip): V(t) always.  tau > 0: V(t)
//     at once while the newest decision the consumers have published (read without waiting; each
//     warp at d = 128, each warpgroup otherwise, publishes per tile whether it runs it, through a
//     ring of 8 slots: DecisionRing, core/pipeline.cuh) says some ran; otherwise it waits for tile
//     t's decisions and loads V(t) only where some warp runs it, else completes the slot's full
//     barrier with a plain arrival (no bytes).  A producer that always waited for the decision was
//     slower where every tile is kept: it stalled V behind every vote (docs/journal.md);
//   consumers (warpgroups 1 and 2, 240 registers; fwd/sm90_consumer.cuh): S = Q K^T, the test and
//     the vote, the online softmax, O += P V;
//   epilogue (the consumers; fwd/sm90_epilogue.cuh): O, lse, the slots, the dense instance's mask.
// The producer stays in the kernel's body: moved into a function of its own (its lambdas kept, or
// as functions without them), it changed the SASS of 1 to 4 of the 15 instances, through the same
// phi order of the consumers' ring positions that fwd/sm90_consumer.cuh describes.
//
// The template flags, in this order everywhere (the kernel, fwd_sm90_consume, the launcher,
// FwdLaunch, instance.cuh):
//   kDense: tau = 0 (no test, no vote; every legal tile retained).
//   kSeeded: a seeded split (FwdParams::seed_lse, fwd/common.cuh): the test's denominator starts
//     from the anchor mass and the anchor tiles the split holds are retained untested.
//   kRecord (tau > 0): the instance for calls that ask for the tile mask or the slots; the others
//     carry no per-tile code for them (the mask's predicated store and the retained count: 11
//     instructions a warp per tile, 8 of them between the vote and the exponentials).  The dense
//     instance records after its loop and always has it.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/core/pipeline.cuh"
#include "cuda/core/tma.cuh"
#include "cuda/core/wgmma.cuh"
#include "cuda/fwd/common.cuh"
#include "cuda/fwd/sm90_consumer.cuh"
#include "cuda/fwd/sm90_traits.cuh"

namespace mala {
namespace cuda {

template <typename T, int D, bool kDense, bool kSeeded, bool kRecord>
__global__ void __launch_bounds__(384, 1)
    mala_fwd_kernel_sm90_k128(const FwdParams p, const __grid_constant__ CUtensorMap tmap_k,
                              const __grid_constant__ CUtensorMap tmap_v) {
#ifdef MALA_WGMMA_ENABLED
  static_assert(!(kDense && kSeeded), "a seeded split tests");
  static_assert(kRecord || !kDense, "the dense instance records after its loop");
  using C = FwdK128<D>;
  constexpr int BQ = C::BQ, BK = C::BK, NS = C::kStages;
  using KVTile = typename C::KVTile;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  uint32_t sbase;
  unsigned char* const smem = smem_align_1024(smem_raw, sbase);
  // The decision ring's flag bytes, which the producer reads through DecisionRing::retained.
  const volatile unsigned char* const s_flags = smem + offsetof(typename C::Storage, dec_flag);
  const int tid = threadIdx.x, b = blockIdx.z, h = blockIdx.y;
  const int qtile = longest_first_query_tile(p.causal);
  const FwdSeq<T> sq = fwd_seq<T>(p, b, h);
  const int Nq = sq.Nq, Nk = sq.Nk;
  const int row_cta = qtile * BQ;
  // Tiles are visited from `top` down; tile t is the (top - t)-th use of the rings.
  const int n_tiles = sq.key_tiles(row_cta, BQ, BK, p.causal);
  const int top = n_tiles - 1;
  using Sm = typename C::Storage;
  const uint32_t sK0 = sbase + offsetof(Sm, k), sV0 = sbase + offsetof(Sm, v), sQ0 = sbase + offsetof(Sm, q);
  // The K ring's full and empty mbarriers, then the V ring's.
  const MbarRing<NS> kring = MbarRing<NS>::at(sbase + offsetof(Sm, mbar)),
                     vring = MbarRing<NS>::at(kring.empty0 + 8 * NS);
  // The K ring's base for the consumers' issue_s, which waits through MbarRing<NS>::at(k_mbar): a
  // step that captures the ring itself instead reorders the phi nodes of kr and vr in the PTX, which
  // reached ptxas's schedule in 7 of the 15 instances (the SROA order of the kernel's locals).
  const uint32_t k_mbar = kring.full0;
  // tau > 0: the decision ring (core/pipeline.cuh); the consumers build it from sbase as well.
  const typename C::DecRing dring = C::dec_ring(sbase);
  if (tid == 0) {
    for (int i = 0; i < NS; ++i) {
      kring.init_slot(i, 1, 8);  // the producer's arrival; one arrival per consumer warp
      vring.init_slot(i, 1, 8);
    }
    if constexpr (!kDense && C::kVSkip) dring.init();
    fence_mbarrier_init();
  }
  __syncthreads();
  const int hk = h / p.group;
  const int k_row0 = sq.k_off, k_batch = p.cu_k ? 0 : b;  // varlen maps the packed rows as one batch entry
  if (tid < 128) {  // producer warpgroup: one thread issues every load
    setmaxnreg_dec24();
    if (tid == 0 && n_tiles > 0) {
      auto load = [&](uint32_t s0, const CUtensorMap* map, const MbarRing<NS>& ring, int i) {
        const RingPos r = RingPos::at<NS>(i);
        if (i >= NS) ring.producer_wait(r);
        tma_load_tile<BK, D>(s0 + r.slot * KVTile::kBytes, map, ring.full(r.slot), k_row0 + (top - i) * BK, hk, k_batch);
      };
      load(sK0, &tmap_k, kring, 0);
      if constexpr (kDense || !C::kVSkip) {
        for (int i = 0; i <= top; ++i) {
          if (i < top) load(sK0, &tmap_k, kring, i + 1);
          load(sV0, &tmap_v, vring, i);
        }
      } else {
        // V(i) (use i) at once while the newest decision published so far (read without waiting)
        // says some publisher retained; otherwise once use i's own decision is out, and only if some
        // publisher retains it (its warpgroup then runs P V): else the slot's full barrier completes
        // with a plain arrival (no bytes), so the consumers' waits and the ring's phases are as with a
        // load.  Nobody reads the slot.
        // Progress: a publisher publishes use i's decision after waiting only for K(<= i),
        // V(<= i - 1) and its warpgroup's other warps at a vote (on use i, or with kWarpVote on use
        // i - 1; above its first tile: after K(i), before V(i)), all issued before V(i) here.
        // Ring (dring, ND = C::kDecSlots slots, use u in slot u % ND): use u's decision is
        // published only once K(u) is full.  `seen` (the next decision to read) is > i - NS after
        // V(i)'s empty wait (every consumer warp gives V(i - NS) back after its publisher published
        // use i - NS's decision), and during step i no decision past use i + 1 can be out
        // (K(i + 1) is the newest K issued): a slot read in step i (use >= i - NS) is not reused
        // while ND >= NS + 2, and use u - ND's phase has completed before use u's is tested (parity
        // waits are exact).  One publisher cannot arrive twice on a slot before every other arrived
        // once: it publishes use u + ND after K(u + ND), issued after every consumer warp gave
        // K(u + ND - NS) back, by which time each publisher had published use u (ND >= NS + 1).
        // dring.test(u): use u's decisions all out (acquire), without waiting; dring.wait(u);
        // dring.retained(s_flags, u): whether some publisher retains use u.
        uint32_t seen = 0;
        bool last = true;  // nothing decided yet: load
        for (int i = 0; i <= top; ++i) {
          if (i < top) load(sK0, &tmap_k, kring, i + 1);
          const RingPos r = RingPos::at<NS>(i);
          if (i >= NS) vring.producer_wait(r);
          for (; seen <= static_cast<uint32_t>(i) && dring.test(seen); ++seen) last = dring.retained(s_flags, seen);
          if (!last) {
            dring.wait(i);
            last = dring.retained(s_flags, i);
            seen = i + 1;
          }
          const uint32_t full = vring.full(r.slot);
          if (last)
            tma_load_tile<BK, D>(sV0 + r.slot * KVTile::kBytes, &tmap_v, full, k_row0 + (top - i) * BK, hk, k_batch);
          else
            vring.fill_empty(r.slot);
        }
      }
    }
    return;
  }  fwd_sm90_consume<T, D, kDense, kSeeded, kRecord>(p, sq, Nq, Nk, b, h, tid, row_cta, top, kring, vring, sK0, sV0, sQ0,
                                                   sbase, k_mbar);
#endif
}

// Launches the instance (dense, seeded, record) names (grid: query tiles of 128 rows, heads, batch).
// The tensor maps' boxes are FwdK128<D>::BK rows.
template <typename T, int D>
cudaError_t launch_fwd_sm90_k128(const FwdParams& p, bool dense, bool seeded, bool record, const CUtensorMap& tk,
                                 const CUtensorMap& tv, cudaStream_t stream) {
  using C = FwdK128<D>;
  auto kernel = dense    ? mala_fwd_kernel_sm90_k128<T, D, true, false, true>
                : seeded ? (record ? mala_fwd_kernel_sm90_k128<T, D, false, true, true>
                                   : mala_fwd_kernel_sm90_k128<T, D, false, true, false>)
                         : (record ? mala_fwd_kernel_sm90_k128<T, D, false, false, true>
                                   : mala_fwd_kernel_sm90_k128<T, D, false, false, false>);
  const int smem = !dense && C::kVSkip ? C::kSmemRing : C::kSmem;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  dim3 grid(rule::ceil_div(p.seqlen_q, C::BQ), p.heads_q, p.batch);
  kernel<<<grid, C::kThreads, smem, stream>>>(p, tk, tv);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mala
