// The exact CPU implementation (the reference every kernel is tested against).  Arguments arrive
// checked by mala::check(); block_q/block_k of 0 mean the CPU defaults (cpu::*_tiles).
#pragma once

#include "mala/mala.h"

namespace mala {
namespace cpu {

Tiles forward_tiles(const ForwardArgs& args);
Tiles backward_tiles(const BackwardArgs& args);
Tiles decode_tiles(const DecodeArgs& args);
int decode_num_splits(const DecodeArgs& args);

Status forward(const ForwardArgs& args);
Status backward(const BackwardArgs& args);
Status decode(const DecodeArgs& args);

}  // namespace cpu
}  // namespace mala
