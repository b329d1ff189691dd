// CPU tile sizes: the defaults when an argument struct leaves block_q/block_k at 0.  Any positive
// size is accepted so the CPU can reproduce the decisions of any kernel's tiles.
#include "cpu/cpu.h"

namespace mala {
namespace cpu {

namespace {
Tiles pick(int block_q, int block_k, Tiles defaults) {
  return {block_q > 0 ? block_q : defaults.block_q, block_k > 0 ? block_k : defaults.block_k};
}
}  // namespace

Tiles forward_tiles(const ForwardArgs& a) { return pick(a.block_q, a.block_k, {128, 128}); }
Tiles backward_tiles(const BackwardArgs& a) { return pick(a.block_q, a.block_k, {128, 128}); }
Tiles decode_tiles(const DecodeArgs& a) { return pick(a.block_q, a.block_k, {64, 128}); }
int decode_num_splits(const DecodeArgs& a) { return a.num_splits > 0 ? a.num_splits : 1; }

}  // namespace cpu
}  // namespace mala
