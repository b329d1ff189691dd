// The warp-specialized backward's shape for a head dim (bwd/sm90_kernel.cuh): its tiles and Q ring
// from its row of the tile table (bwd/tiles.h), the dQ buffer's boxes, the per-row scalars' slots
// and its shared memory.  Every role file reads it.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/bwd/params.cuh"
#include "cuda/bwd/tiles.h"
#include "cuda/core/smem_tile.cuh"

namespace mala {
namespace cuda {

// kDet: the fixed-point deterministic mode (int32 dQ in the fp32 buffer's layout, and the rows' units).
template <int D_, bool kDet_ = false>
struct BwdWs {
  static constexpr BwdTiles kTiles = bwd_tiles(BwdKernelKind::sm90_ws, D_);  // bwd/tiles.h
  static constexpr int D = D_, BQ = kTiles.bq, BK = kTiles.bk, kThreads = 384;
  static constexpr bool kDet = kDet_;
  static constexpr int kQStages = kTiles.q_stages;
  static_assert(D == 64 || D == 128, "warp-specialized backward: head dim 64 or 128");
  using KTile = GmmaTile<BK, D>;
  using QTile = GmmaTile<BQ, D>;
  using STile = GmmaTile<BK, BQ>;            // dS^T [key][query]
  // dQ (fp32 or int32) in boxes of 128 bytes x 64 rows: 32 columns each.
  static constexpr int kDqBoxCols = 32, kDqBoxes = D / kDqBoxCols;
  static constexpr int kDqBytes = BQ * 128 * 4;  // (room for 4 boxes at d = 64)
  // The per-row scalars of a query tile (lse in log2 units, the skip bound, D) arrive by TMA as kVec
  // floats from the 16-byte boundary at or before the tile's first row (a box must start there): the
  // tile's rows begin (row & 3) floats in.  kVecStride floats per slot (a box lands 128-byte aligned).
  static constexpr int kVec = BQ + 4, kVecStride = 96;
  // The kernel's shared memory from a 1024-byte aligned base (swizzled tiles need it; every tile is
  // a multiple of 1024 bytes, so each starts aligned, as the asserts below check).
  struct Storage {
    unsigned char k[KTile::kBytes];
    unsigned char v[KTile::kBytes];
    unsigned char q[kQStages][QTile::kBytes];
    unsigned char dout[2][QTile::kBytes];
    // One dS^T buffer: before a warpgroup writes a tile's dS^T, the dQ writer's full barrier has
    // completed the last post, which both warpgroups make only once their dQ products (which read
    // dS^T) are complete.  (The space went to a fourth Q stage, which the skip path, loading nothing
    // else, runs on.)
    unsigned char ds[STile::kBytes];
    unsigned char dq[kDqBytes];
    float lse[kQStages][kVecStride];
    float bound[kQStages][kVecStride];
    float dsum[2][kVecStride];
    float unit[kDet ? kQStages : 0][kVecStride];  // kDet only (no bytes otherwise)
    // The mbarriers: K's and V's (one, both loads' bytes); the Q and dO rings (full[], then empty[]:
    // MbarRing::at); the CTA vote's ring (cta_vote_arrive); the dQ writer's buffer, full and empty;
    // tile u's decision for the dO producer in dec_bar[u % 8].
    uint64_t kv_bar;
    uint64_t q_bar[2 * kQStages];
    uint64_t do_bar[2 * 2];
    uint64_t vote_bar[4];
    uint64_t dq_full_bar, dq_empty_bar;
    uint64_t dec_bar[8];
    alignas(16) uint32_t vote[4];  // tagged vote words
    int dec[8];        // (u << 1) | retained, for the dO producer (the u-th scored tile in slot u % 8,
                       // published through mbarrier dec[u % 8])
    int dq_row[4];     // to the dQ writer: the tile's first accumulator row (-1: no more tiles)
    // forward_tile_mask: bit t of the CTA's tiles in the visiting order, whether tile t is scored
    // (some forward tile inside it retained); up to kBwdWsScoredTiles tiles (dispatch.cu passes the
    // mask only then).
    uint32_t scored[kBwdWsScoredTiles / 32];
  };
  static_assert(offsetof(Storage, v) % 1024 == 0 && offsetof(Storage, q) % 1024 == 0 &&
                    offsetof(Storage, dout) % 1024 == 0 && offsetof(Storage, ds) % 1024 == 0 &&
                    offsetof(Storage, dq) % 1024 == 0,
                "BwdWs::Storage: swizzled tiles and dQ boxes at 1024-byte boundaries");
  static_assert(offsetof(Storage, q_bar) == offsetof(Storage, kv_bar) + 8 &&
                    offsetof(Storage, do_bar) == offsetof(Storage, q_bar) + 16 * kQStages &&
                    offsetof(Storage, vote_bar) == offsetof(Storage, do_bar) + 32 &&
                    offsetof(Storage, dq_full_bar) == offsetof(Storage, vote_bar) + 32 &&
                    offsetof(Storage, dq_empty_bar) == offsetof(Storage, dq_full_bar) + 8 &&
                    offsetof(Storage, dec_bar) == offsetof(Storage, dq_empty_bar) + 8,
                "BwdWs::Storage: the mbarriers packed");
  static_assert(offsetof(Storage, lse) % 128 == 0 && (kVecStride * 4) % 128 == 0,
                "BwdWs::Storage: TMA boxes of the scalars at 128-byte boundaries");
  static constexpr int kSmem = sizeof(Storage) + 1024;  // + the base's alignment
  // Named barriers of the consumers (0 is __syncthreads): both warpgroups' dS^T stored; the vote after
  // a skipped tile (barrier_vote_or).
  static constexpr int kBarDs = 1, kBarVote = 2, kConsumers = 256;
};

// Phase parity of the k-th use of a ring slot or a single mbarrier (k = t / slots).
__device__ __forceinline__ uint32_t bwd_ws_parity(int use) { return static_cast<uint32_t>(use) & 1u; }

}  // namespace cuda
}  // namespace mala
