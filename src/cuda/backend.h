// The CUDA backend as seen from plain C++ (api.cpp).  No CUDA types here.  Implemented by the .cu
// files in this folder, or by backend_stub.cpp when the library is built without CUDA.
#pragma once

#include <string>

#include "mala/mala.h"

namespace mala {
namespace cuda_backend {

bool available();
std::string device_name();
// Ok when p is memory the current CUDA device can read (device or managed); names `what` otherwise.
Status check_device_pointer(const void* p, const char* what);

// Arguments arrive checked by mala::check().
Status forward(const ForwardArgs& args);
Tiles forward_tiles(const ForwardArgs& args);

Status backward(const BackwardArgs& args);
Tiles backward_tiles(const BackwardArgs& args);
size_t backward_workspace_size(const BackwardArgs& args);

Status decode(const DecodeArgs& args);
Tiles decode_tiles(const DecodeArgs& args);
int decode_num_splits(const DecodeArgs& args);
size_t decode_workspace_size(const DecodeArgs& args);
// Benchmark-only: while non-null, decode kernels write globaltimer stamps to `trace` (12 per split
// CTA, then 12 per combine CTA; see decode_kernel.cuh), for `mala_bench --op decode --overhead`.
void set_decode_trace(unsigned long long* trace);

}  // namespace cuda_backend
}  // namespace mala
