// Public entry points: check the arguments once, then hand them to the CPU implementation or the
// CUDA backend according to args.device.  No exception leaves them: a failed allocation is a Status.
#include <omp.h>

#include "cpu/common.h"
#include "cpu/cpu.h"
#include "cuda/backend.h"
#include "mala/mala.h"

namespace mala {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "?";
}

const char* split_rule_name(SplitRule r) {
  switch (r) {
    case SplitRule::per_split: return "per_split";
    case SplitRule::seeded: return "seeded";
  }
  return "?";
}

size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

bool cuda_available() { return cuda_backend::available(); }

std::string device_name() {
  if (cuda_available()) return cuda_backend::device_name();
  return "cpu (" + std::to_string(omp_get_max_threads()) + " threads)";
}

Tiles forward_tiles(const ForwardArgs& a) {
  return a.device == Device::cuda ? cuda_backend::forward_tiles(a) : cpu::forward_tiles(a);
}
Tiles backward_tiles(const BackwardArgs& a) {
  return a.device == Device::cuda ? cuda_backend::backward_tiles(a) : cpu::backward_tiles(a);
}
Tiles decode_tiles(const DecodeArgs& a) {
  return a.device == Device::cuda ? cuda_backend::decode_tiles(a) : cpu::decode_tiles(a);
}
int decode_num_splits(const DecodeArgs& a) {
  return a.device == Device::cuda ? cuda_backend::decode_num_splits(a) : cpu::decode_num_splits(a);
}
size_t backward_workspace_size(const BackwardArgs& a) {
  return a.device == Device::cuda ? cuda_backend::backward_workspace_size(a) : 0;
}
bool backward_reads_forward_tile_mask(const BackwardArgs& a) {
  return a.device == Device::cuda && cuda_backend::backward_reads_forward_tile_mask(a);
}
size_t decode_workspace_size(const DecodeArgs& a) {
  return a.device == Device::cuda ? cuda_backend::decode_workspace_size(a) : 0;
}

Status forward(const ForwardArgs& a) {
  Status s = check(a);
  if (!s) return s;
  return cpu::detail::guard_oom([&] { return a.device == Device::cuda ? cuda_backend::forward(a) : cpu::forward(a); });
}

Status backward(const BackwardArgs& a) {
  Status s = check(a);
  if (!s) return s;
  return cpu::detail::guard_oom([&] { return a.device == Device::cuda ? cuda_backend::backward(a) : cpu::backward(a); });
}

Status decode(const DecodeArgs& a) {
  Status s = check(a);
  if (!s) return s;
  return cpu::detail::guard_oom([&] { return a.device == Device::cuda ? cuda_backend::decode(a) : cpu::decode(a); });
}

}  // namespace mala
