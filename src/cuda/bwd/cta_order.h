// The backward main kernels' launch order, in one place that bwd_cta_work (bwd/common.cuh) and a CPU
// test (tests/cpu/test_bwd_cta_order.cpp) both use.  Plain C++ (no CUDA types).
//
// A launch has n_k_tiles x per_j CTAs, per_j = sequences x KV heads x head splits.  CTA x gets key
// tile j and the index `rest` of its (sequence, KV head, head split), head split fastest:
//   x < per_j:  j = 0, rest = x                 (key tile 0 of every rest first)
//   else:       rest = (x - per_j) / (n_k_tiles - 1), j = 1 + (x - per_j) % (n_k_tiles - 1)
// The GPU runs neighbouring CTAs together, so after the first per_j the resident ones share one or
// two rests, that is their query heads, and the dQ rows they add to stay within the L2 however far
// apart their skips carry them (with key tiles slowest the resident CTAs covered every query head
// and, at tau > 0, the dQ reduce-adds went to DRAM: docs/kernels.md, "Launch order").  Key tile 0
// comes first because, causal, it has the most query tiles, and where attention has a sink every row
// keeps it: where the rest is skipped it is the critical path, and one launched late would end last.
#pragma once

#include "common/rule.h"  // MALA_HD

namespace mala {
namespace cuda {

struct BwdCtaSlot {
  int j;     // key tile
  int rest;  // (sequence, KV head, head split), head split fastest
};
MALA_HD BwdCtaSlot bwd_cta_slot(unsigned x, int n_k_tiles, int per_j) {
  if (static_cast<int>(x) < per_j) return {0, static_cast<int>(x)};
  const int y = x - per_j, others = n_k_tiles - 1;  // others >= 1 here: the grid has n_k_tiles x per_j CTAs
  return {1 + y % others, y / others};
}
// The mma.sync kernel (bwd/kernel_sm80.cuh) keeps key tiles slowest (j = x / per_j): the order above
// is measured only on the wgmma kernels (H100, H200), and it cost that kernel's d = 256 instance 20
// bytes of register spills (sm_80), which only a timing there could clear.
MALA_HD BwdCtaSlot bwd_cta_slot_key_slowest(unsigned x, int per_j) {
  return {static_cast<int>(x / per_j), static_cast<int>(x % per_j)};
}

}  // namespace cuda
}  // namespace mala
