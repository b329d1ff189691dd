// Placeholder until the decode kernel lands (issue 4).
#include "cuda/backend.h"
namespace mala { namespace cuda_backend {
Status decode(const DecodeArgs&) { return Status::error("device: CUDA decode not implemented yet"); }
Tiles decode_tiles(const DecodeArgs&) { return {64, 128}; }
int decode_num_splits(const DecodeArgs&) { return 1; }
size_t decode_workspace_size(const DecodeArgs&) { return 0; }
} }
