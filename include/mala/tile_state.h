// The values of the tile masks (ForwardArgs::tile_mask and the others, mala.h), in a header of their
// own so that the CUDA kernels, which write them, include no host API.  Part of the public API:
// mala.h includes it.
#pragma once

#include <stdint.h>

namespace mala {

// Per-tile decisions, written to the optional tile_mask outputs (tests and analysis).
enum TileState : uint8_t {
  kTileIllegal = 0,   // no row of the query tile sees any key of the key tile (never visited)
  kTileSkipped = 1,   // post-score work skipped (QK computed, except where a backward given the
                      // forward's tile mask knew the skip from it: BackwardArgs::forward_tile_mask)
  kTileRetained = 2,  // post-score work executed
};

}  // namespace mala
