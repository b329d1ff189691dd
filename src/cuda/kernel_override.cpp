// The internal kernel override (backend.h).  Plain C++: built with and without CUDA.
#include "cuda/backend.h"

namespace mala {
namespace cuda_backend {

namespace {
KernelOverride g_override;
}  // namespace

void set_kernel_override(const KernelOverride& o) { g_override = o; }
const KernelOverride& kernel_override() { return g_override; }

const char* variant_name(FwdVariant v) {
  switch (v) {
    case FwdVariant::mma_sync: return "mma_sync";
    default: return "auto";
  }
}
const char* variant_name(BwdVariant v) {
  switch (v) {
    case BwdVariant::mma_sync: return "mma_sync";
    default: return "auto";
  }
}
const char* variant_name(DecodeVariant v) { return v == DecodeVariant::small_smem ? "small_smem" : "auto"; }

bool parse_variant(const std::string& s, FwdVariant* v) {
  for (FwdVariant x : {FwdVariant::automatic, FwdVariant::mma_sync})
    if (s == variant_name(x)) return *v = x, true;
  return false;
}
bool parse_variant(const std::string& s, BwdVariant* v) {
  for (BwdVariant x : {BwdVariant::automatic, BwdVariant::mma_sync})
    if (s == variant_name(x)) return *v = x, true;
  return false;
}
bool parse_variant(const std::string& s, DecodeVariant* v) {
  for (DecodeVariant x : {DecodeVariant::automatic, DecodeVariant::small_smem})
    if (s == variant_name(x)) return *v = x, true;
  return false;
}

}  // namespace cuda_backend
}  // namespace mala
