// The backward's tile table: for each main kernel and head dim, the key tile a CTA owns, the query
// rows of a step, the decision tile and the Q stages.  The kernels' layout structs, dispatch.cu (the
// decision tile backward_tiles and tile_sizes report, the tensor maps' boxes) and bwd_smem_bytes
// read it; no other place states a backward tile.  Plain C++ (no CUDA types).
#pragma once

namespace mala {
namespace cuda {

enum class BwdKernelKind {
  sm80,     // mma.sync (bwd/kernel_sm80.cuh): every device, every head dim; on sm_90 where the TMA
            // cannot describe the tensors
  sm90_ws,  // warp-specialized wgmma + TMA: sm_90a, d = 64 and 128 (bwd/sm90_kernel.cuh), d = 256
            // (bwd/sm90_256_kernel.cuh, then the dQ kernel of bwd/sm90_256_dq_kernel.cuh)
};

struct BwdTiles {
  int bk;        // keys of the CTA's key tile (the K and V tensor maps' box rows where the TMA loads them)
  int bq;        // query rows of a step
  int dec_rows;  // the decision tile: dec_rows x bk (what backward_tiles reports; every kernel of a
                 // head dim decides on the same one)
  int q_stages;  // Q stages in shared memory; 0: per call (sm80: BwdParams::q_stages, 2 or 3)
};

// The table (each value's reason: the kernel's layout struct, BwdKernel, BwdWs, BwdWs256).
// d = 256, warp-specialized: each consumer warpgroup's 32 rows of a 64-row step are a decision tile.
// Head dims outside 64, 128 and 256 read d = 128's row.
constexpr BwdTiles bwd_tiles(BwdKernelKind k, int d) {
  switch (k) {
    case BwdKernelKind::sm90_ws:
      return d == 256 ? BwdTiles{64, 64, 32, 2} : BwdTiles{128, 64, 64, 4};
    default:
      return d == 256 ? BwdTiles{64, 32, 32, 0} : BwdTiles{128, 64, 64, 0};
  }
}
constexpr bool bwd_same_decisions(int d) {
  return bwd_tiles(BwdKernelKind::sm90_ws, d).dec_rows == bwd_tiles(BwdKernelKind::sm80, d).dec_rows &&
         bwd_tiles(BwdKernelKind::sm90_ws, d).bk == bwd_tiles(BwdKernelKind::sm80, d).bk;
}
static_assert(bwd_same_decisions(64) && bwd_same_decisions(128) && bwd_same_decisions(256),
              "the backward's decision tile depends on the head dim only");

// The mma.sync kernel's tiles for a head dim, from its row of the table (see kernel_sm80.cuh for the
// warp layout).  BQ: query rows per visited tile, BK: keys per CTA, WARPS_D: warps that share one
// 16-key slab and split the head dim of its dK/dV accumulators (d = 256 only).
template <int D>
struct BwdConfig {
  static constexpr int BQ = bwd_tiles(BwdKernelKind::sm80, D).bq, BK = bwd_tiles(BwdKernelKind::sm80, D).bk;
  static constexpr int WARPS_D = D == 256 ? 2 : 1;
};

}  // namespace cuda
}  // namespace mala
