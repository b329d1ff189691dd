// The sm_90 forward's shape for a head dim (fwd/sm90_kernel.cuh): its tiles, rings and decision tile
// from its row of the tile table (fwd/tiles.h), and its shared memory.  Every role file reads it.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <type_traits>

#include "cuda/core/pipeline.cuh"
#include "cuda/core/smem_tile.cuh"
#include "cuda/fwd/tiles.h"

namespace mala {
namespace cuda {

template <int D_>
struct FwdK128 {
  static constexpr int D = D_;
  static_assert(fwd_has_sm90_k128(D), "128-key forward: head dims 64, 128 and 256 (fwd/params.h)");
  static constexpr FwdTiles kTiles = fwd_tiles(FwdKernelKind::sm90_k128, D);  // fwd/tiles.h
  static constexpr int kThreads = 384, BQ = kTiles.bq, BK = kTiles.bk;
  // d = 256: O takes 128 registers a thread, which leaves none for Q's 64; Q stays in shared memory
  // (an operand of an ss wgmma).
  static constexpr bool kQSmem = D == 256;
  // The decision tile: kDecRows x BK.  d = 128: a warp's 16 rows, and the warpgroup's vote on whether
  // to run P V waits until the next S is issued (kWarpVote).  d = 64 and 256: a warp pair's 32 rows,
  // voted on before the exponentials; per-warp decisions there ran slower on random inputs, where
  // every tile is kept (docs/journal.md).
  static constexpr int kDecRows = kTiles.dec_rows;
  static constexpr bool kWarpVote = kTiles.dec_warps == 1;
  using QTile = std::conditional_t<kQSmem, GmmaTile<64, D>, SmemTile<64, D>>;
  using KVTile = GmmaTile<BK, D>;
  // K and V rings: 3 x (32 + 32) KB at d = 128 (224 KB with Q), 4 x (16 + 16) KB at d = 64.  One slot
  // fewer ran slower at both head dims (docs/journal.md).
  static constexpr int kStages = kTiles.k_stages;
  static_assert(kTiles.v_stages == kStages, "K and V share one ring index");
  // tau > 0 only: the decision ring for the producer's V loads, kDecSlots mbarriers (one arrival per
  // publisher: each consumer warp where kWarpVote, else each consumer warpgroup) and kDecSlots flag
  // words of 8 bytes, as the mbarriers are (byte i: whether publisher i retains the tile; one offset
  // addresses both).
  // kDecSlots >= kStages + 2 keeps a slot from being reused before the producer has read it (the
  // consumers run at most kStages + 1 uses ahead of the producer's reads: see the producer).
  // kVSkip: whether V waits on the decision at tau > 0.  Not at d = 64, where a tile's products are
  // short: there the decision ring cost more where every tile is kept than it saved where few are
  // (docs/kernels.md, "V after a skip").
  static constexpr bool kVSkip = kTiles.v_skip;
  static constexpr int kDecSlots = 8;  // a power of 2
  static constexpr int kPublishers = kWarpVote ? 8 : 2;
  static_assert(kDecSlots >= kStages + 2, "decision ring: a slot reused before the producer read it");
  using DecRing = DecisionRing<kDecSlots, kPublishers>;  // core/pipeline.cuh
  // The kernel's shared memory from a 1024-byte aligned base (swizzled tiles need it; every tile is
  // a multiple of 1024 bytes, so each starts aligned, as the asserts below check).
  struct Storage {
    unsigned char k[kStages][KVTile::kBytes];
    unsigned char v[kStages][KVTile::kBytes];
    unsigned char q[2][QTile::kBytes];  // one per consumer warpgroup
    uint64_t mbar[4 * kStages];         // full_k, empty_k, full_v, empty_v [kStages]
    uint64_t dec[kDecSlots];            // the decision ring: only in kSmemRing
    uint8_t dec_flag[kDecSlots][8];
  };
  static_assert(offsetof(Storage, v) % 1024 == 0 && offsetof(Storage, q) % 1024 == 0 &&
                    QTile::kBytes % 1024 == 0,
                "FwdK128::Storage: swizzled tiles at 1024-byte boundaries");
  // The decision ring of the Storage at shared address sbase (the producer's and the consumers').
  __device__ __forceinline__ static DecRing dec_ring(uint32_t sbase) {
    return {sbase + static_cast<uint32_t>(offsetof(Storage, dec)),
            sbase + static_cast<uint32_t>(offsetof(Storage, dec_flag))};
  }
  // + the base's alignment; kSmem: no decision ring (dense, or no V skip)
  static constexpr int kSmem = offsetof(Storage, dec) + 1024, kSmemRing = sizeof(Storage) + 1024;
};

}  // namespace cuda
}  // namespace mala
