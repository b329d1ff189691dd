// Placeholder until the forward kernel lands (issue 3).
#include "cuda/backend.h"
namespace mala { namespace cuda_backend {
Status forward(const ForwardArgs&) { return Status::error("device: CUDA forward not implemented yet"); }
Tiles forward_tiles(const ForwardArgs&) { return {128, 128}; }
} }
