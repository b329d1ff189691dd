// Internal (not part of include/mala/mala.h): the argument checks of mala::check() without the
// memory-overlap test of outputs against inputs.  For callers that check shapes and flags before
// the tensors exist (the CLI checks its flags before allocating anything); every entry point runs
// the full mala::check().
#pragma once

#include "mala/mala.h"

namespace mala {
namespace internal {

Status check_arguments(const ForwardArgs& args);
Status check_arguments(const BackwardArgs& args);
Status check_arguments(const DecodeArgs& args);

// The memory-overlap part of mala::check() (src/overlap.cpp).
Status check_overlap(const ForwardArgs& args);
Status check_overlap(const BackwardArgs& args);
Status check_overlap(const DecodeArgs& args);

}  // namespace internal
}  // namespace mala
