// Built instead of the kernels when MALA_CUDA is off: every CUDA call says so.
#include "cuda/backend.h"

namespace mala {
namespace cuda_backend {

static Status no_cuda() { return Status::error("device: mala was built without CUDA (MALA_CUDA=OFF)"); }

bool available() { return false; }
std::string device_name() { return "none (built without CUDA)"; }
Status check_device_pointer(const void*, const char*) { return no_cuda(); }
Status forward(const ForwardArgs&) { return no_cuda(); }
Tiles forward_tiles(const ForwardArgs&) { return {}; }
Status backward(const BackwardArgs&) { return no_cuda(); }
Tiles backward_tiles(const BackwardArgs&) { return {}; }
size_t backward_workspace_size(const BackwardArgs&) { return 0; }
bool backward_reads_forward_tile_mask(const BackwardArgs&) { return false; }
Status decode(const DecodeArgs&) { return no_cuda(); }
Tiles decode_tiles(const DecodeArgs&) { return {}; }
int decode_num_splits(const DecodeArgs&) { return 1; }
size_t decode_workspace_size(const DecodeArgs&) { return 0; }

}  // namespace cuda_backend
}  // namespace mala
