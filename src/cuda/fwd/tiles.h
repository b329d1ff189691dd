// The forward's tile table: for each kernel and head dim, its tiles, rings, decision tile, who votes
// on a decision and whether V waits on it.  The kernels' layout structs, dispatch.cu (the decision
// tile forward_tiles and tile_sizes report, the tensor maps' boxes) and the launchers read it; no
// other place states a forward tile.  Plain C++ (no CUDA types).
#pragma once

namespace mala {
namespace cuda {

enum class FwdKernelKind {
  sm80,       // mma.sync (fwd/kernel_sm80.cuh): every device, every head dim; on sm_90 where the TMA
              // cannot describe K and V
  sm90_k128,  // one S accumulator, TMA loads (fwd/sm90_kernel.cuh): sm_90a, every head dim (128-key
              // tiles, 64 at d = 256)
};
// The head dims the wgmma kernel is built for.
constexpr bool fwd_has_sm90_k128(int d) { return d == 64 || d == 128 || d == 256; }

struct FwdTiles {
  int bq;         // query rows of a CTA
  int bk;         // keys of a tile (the K and V tensor maps' box rows where the TMA loads them)
  int dec_rows;   // the decision tile: dec_rows x bk (what forward_tiles reports)
  int dec_warps;  // the warps whose rows it spans: 1 (a warp's vote) or 2 (a warp pair's)
  int k_stages;   // K tiles in shared memory (ring slots)
  int v_stages;   // V tiles in shared memory
  bool v_skip;    // at tau > 0, V waits on the decision (a skipped tile's V is not loaded)
};

// The table (each value's reason: the kernel's layout struct, FwdKernelTraits, FwdK128; the 128-key
// kernel's tiles are 64 keys at d = 256, where O's 128 registers a thread leave room for a 64-key S
// only).  Head dims outside 64, 128 and 256 read d = 128's row.
constexpr FwdTiles fwd_tiles(FwdKernelKind k, int d) {
  switch (k) {
    case FwdKernelKind::sm90_k128:
      return d == 64 ? FwdTiles{128, 128, 32, 2, 4, 4, false}
             : d == 256 ? FwdTiles{128, 64, 32, 2, 2, 2, true}
                        : FwdTiles{128, 128, 16, 1, 3, 3, true};
    default:
      return d == 256 ? FwdTiles{64, 32, 16, 1, 2, 2, true} : FwdTiles{128, 64, 32, 1, 2, 2, true};
  }
}

// The mma.sync kernel's warp layout for a head dim, from its row of the table: a CTA of kWarps
// warps owns kWarps * 16 * kMT consecutive query rows; each warp owns a contiguous aligned block of
// 16*kMT rows and decides skips for its block alone.  kDenseInstance: the kernel has a tau = 0
// instance without the test, the vote and the lazy V.  Not at d = 128, where that instance ran
// slower than the general one (its register allocation; on sm_90 the 128-key kernel serves d = 128
// wherever the TMA can describe K and V).
template <int D>
struct FwdConfig {
  static constexpr FwdTiles kTiles = fwd_tiles(FwdKernelKind::sm80, D);
  static constexpr int kMT = kTiles.dec_rows / 16, kWarps = kTiles.bq / kTiles.dec_rows, kBk = kTiles.bk;
  static constexpr bool kDenseInstance = D != 128;
};

}  // namespace cuda
}  // namespace mala
