// The d = 256 backward's shapes (bwd/sm90_256_kernel.cuh): the key-major kernel's (BwdWs256: its
// tiles from its row of the tile table, bwd/tiles.h; the per-row scalars' slots; its shared memory)
// and the dQ kernel's (BwdDq256).  Every role file reads them.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/bwd/common.cuh"
#include "cuda/bwd/params.cuh"
#include "cuda/bwd/tiles.h"
#include "cuda/core/smem_tile.cuh"

namespace mala {
namespace cuda {

// The key-major kernel: dK, dV and the decisions.
struct BwdWs256 {
  static constexpr BwdTiles kTiles = bwd_tiles(BwdKernelKind::sm90_ws, 256);  // bwd/tiles.h
  static constexpr int D = 256, BQ = kTiles.bq, BK = kTiles.bk, BH = kTiles.dec_rows, kThreads = 384,
                       kStages = kTiles.q_stages;
  static_assert(BH == 32 && BQ == 2 * BH, "decision tile: a warpgroup's 32 rows x 64 keys");
  using KTile = GmmaTile<BK, D>;
  using QTile = GmmaTile<BQ, D>;
  using STile = GmmaTile<BK, BQ>;  // P^T, dS^T [key][query]
  // Per-row scalars of a query tile by TMA, as in bwd/sm90_traits.cuh (BwdWs): kVec floats from the
  // 16-byte boundary at or before the tile's first row, kVecStride floats per slot.
  static constexpr int kVec = BQ + 4, kVecStride = 96;
  // The kernel's shared memory from a 1024-byte aligned base (swizzled tiles need it; every tile is
  // a multiple of 1024 bytes, so each starts aligned, as the asserts below check).
  struct Storage {
    unsigned char k[KTile::kBytes];
    unsigned char v[KTile::kBytes];
    unsigned char q[kStages][QTile::kBytes];
    unsigned char dout[kStages][QTile::kBytes];
    unsigned char p[STile::kBytes];
    unsigned char ds[STile::kBytes];
    float lse[kStages][kVecStride];    // TMA boxes: 16-byte aligned
    float bound[kStages][kVecStride];
    float dsum[kStages][kVecStride];
    // The mbarriers: K's and V's (one, both loads' bytes); the Q and dO rings (full[], then empty[]:
    // MbarRing::at); the P^T / dS^T tiles free again (each consumer warp, once it has read a tile's).
    uint64_t kv_bar;
    uint64_t q_bar[2 * kStages];
    uint64_t do_bar[2 * kStages];
    uint64_t st_free_bar;
    uint32_t vote[2][8];   // each consumer warp's verdict, by tile parity
  };
  static_assert(offsetof(Storage, v) % 1024 == 0 && offsetof(Storage, q) % 1024 == 0 &&
                    offsetof(Storage, dout) % 1024 == 0 && offsetof(Storage, p) % 1024 == 0 &&
                    offsetof(Storage, ds) % 1024 == 0,
                "BwdWs256::Storage: swizzled tiles at 1024-byte boundaries");
  static_assert(offsetof(Storage, lse) % 16 == 0 && offsetof(Storage, bound) % 16 == 0 &&
                    offsetof(Storage, dsum) % 16 == 0 && (kVecStride * 4) % 16 == 0,
                "BwdWs256::Storage: TMA boxes at 16-byte boundaries");
  static_assert(offsetof(Storage, q_bar) == offsetof(Storage, kv_bar) + 8 &&
                    offsetof(Storage, do_bar) == offsetof(Storage, q_bar) + 16 * kStages &&
                    offsetof(Storage, st_free_bar) == offsetof(Storage, do_bar) + 16 * kStages &&
                    offsetof(Storage, vote) == offsetof(Storage, st_free_bar) + 8,
                "BwdWs256::Storage: the mbarriers packed");
  static constexpr int kSmem = sizeof(Storage) + 1024;  // + the base's alignment
  // Named barrier of the consumers (0 is __syncthreads): both warpgroups' P^T, dS^T stored and
  // verdicts in.
  static constexpr int kBarStored = 1, kConsumers = 256;
  // First row of tile x (head h, query tile qi) in the per-row vectors (lse, bound, D).
  __device__ __forceinline__ static int vec_at(const BwdParams& p, const BwdWork& w, const BwdWork::Tile& x) {
    return static_cast<int>(x.h() * p.rows_q_cap + w.qrow0 + x.qi() * BQ);
  }
};

// The query-major kernel: dQ.
struct BwdDq256 {
  static constexpr int D = 256, BQ = 128, BKS = 32, BK = 64, BH = 32, kThreads = 384, kStages = 2;
  static_assert(BwdConfig<256>::BQ == BH && BwdConfig<256>::BK == BK, "decision tile: 32 rows x 64 keys");
  using QTile = GmmaTile<64, D>;   // a warpgroup's Q or dO rows
  using KTile = GmmaTile<BKS, D>;  // a step's K or V
  // The kernel's shared memory from a 1024-byte aligned base (swizzled tiles need it; every tile is
  // a multiple of 1024 bytes, so each starts aligned, as the asserts below check).
  struct Storage {
    unsigned char q[2][QTile::kBytes];         // per warpgroup
    unsigned char dout[2][QTile::kBytes];
    unsigned char k[kStages][KTile::kBytes];
    unsigned char v[kStages][KTile::kBytes];
    // The mbarriers: Q's and dO's (one, all four loads' bytes); the K and V rings (full[], then
    // empty[]: MbarRing::at).
    uint64_t qdo_bar;
    uint64_t k_bar[2 * kStages];
    uint64_t v_bar[2 * kStages];
    int step[kStages];   // (step << 4) | decisions of the slot's step, or -1
  };
  static_assert(offsetof(Storage, dout) % 1024 == 0 && offsetof(Storage, k) % 1024 == 0 &&
                    offsetof(Storage, v) % 1024 == 0,
                "BwdDq256::Storage: swizzled tiles at 1024-byte boundaries");
  static_assert(offsetof(Storage, k_bar) == offsetof(Storage, qdo_bar) + 8 &&
                    offsetof(Storage, v_bar) == offsetof(Storage, k_bar) + 16 * kStages &&
                    offsetof(Storage, step) == offsetof(Storage, v_bar) + 16 * kStages,
                "BwdDq256::Storage: the mbarriers packed");
  static constexpr int kSmem = sizeof(Storage) + 1024;  // + the base's alignment
};

}  // namespace cuda
}  // namespace mala
