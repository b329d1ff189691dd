// The CUDA backend as seen from plain C++ (api.cpp, tests, benchmarks, the CLI).  No CUDA types
// here.  Implemented by the .cu files under this folder (each op's dispatch.cu), or by
// backend_stub.cpp when the library is built without CUDA.
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
bool backward_reads_forward_tile_mask(const BackwardArgs& args);

Status decode(const DecodeArgs& args);
Tiles decode_tiles(const DecodeArgs& args);
int decode_num_splits(const DecodeArgs& args);
size_t decode_workspace_size(const DecodeArgs& args);

// ---- internal: kernel override ---------------------------------------------------------------------
// Each op's dispatch.cu picks its kernel from the device, the head dim and the arguments.  The
// override makes it pick another kernel that serves the same call where one exists, so that the
// GPU tests cover every kernel on one device and benchmarks can compare them.  Results are the same
// up to rounding (the same tiles and decisions).  Not part of the public API (include/mala/mala.h);
// process-wide, not synchronised: set it between calls, not during them.
enum class FwdVariant {
  automatic,  // the dispatch's choice
  mma_sync,   // the mma.sync kernel (fwd/kernel_sm80.cuh) on sm_90 too
};
enum class BwdVariant {
  automatic,
  mma_sync,  // the mma.sync backward (bwd/kernel_sm80.cuh) on sm_90 too
};
enum class DecodeVariant {
  automatic,
  small_smem,  // the instance sized for sm_80's 163 KB of shared memory, on any device
};
struct KernelOverride {
  FwdVariant fwd = FwdVariant::automatic;
  BwdVariant bwd = BwdVariant::automatic;
  DecodeVariant decode = DecodeVariant::automatic;
  int bwd_q_stages = 0;     // 0: 3 where the device's shared memory holds them, else 2; or 2, 3
  int bwd_head_splits = 0;  // 0: the occupancy heuristic; else CTAs per query-head group (a divisor)
};
void set_kernel_override(const KernelOverride& o);
const KernelOverride& kernel_override();
// Names for flags and test parameters ("auto", "mma_sync", ...); parse_* return false on an unknown name.
const char* variant_name(FwdVariant v);
const char* variant_name(BwdVariant v);
const char* variant_name(DecodeVariant v);
bool parse_variant(const std::string& s, FwdVariant* v);
bool parse_variant(const std::string& s, BwdVariant* v);
bool parse_variant(const std::string& s, DecodeVariant* v);

}  // namespace cuda_backend
}  // namespace mala
