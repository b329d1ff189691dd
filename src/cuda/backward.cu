// Placeholder until the backward kernel lands (issue 3).
#include "cuda/backend.h"
namespace mala { namespace cuda_backend {
Status backward(const BackwardArgs&) { return Status::error("device: CUDA backward not implemented yet"); }
Tiles backward_tiles(const BackwardArgs&) { return {128, 128}; }
size_t backward_workspace_size(const BackwardArgs&) { return 0; }
} }
