// The decode's automatic split count (DecodeArgs::num_splits = 0), a pure function of the launch
// geometry so that the CPU tests can check it without a device.
#pragma once

#include <stdint.h>

#include <algorithm>

#include "mala/mala.h"

namespace mala {
namespace splits {

// At most one wave of CTAs (one CTA per SM; a second partial wave would double the time): sms / ctas
// splits, where ctas = the split kernel's CTAs per split (batch * query-tile owners * query tiles),
// no more than the cache's key tiles, and within the bound a caller may ask for (kMaxNumSplits: the
// automatic choice never picks a count the API would refuse).  At least 1.
inline int auto_num_splits(int64_t ctas, int64_t key_tiles, int sms) {
  int64_t want = static_cast<int64_t>(sms) / std::max<int64_t>(1, ctas);
  want = std::min<int64_t>(want, key_tiles);
  want = std::min<int64_t>(want, kMaxNumSplits);
  return static_cast<int>(std::max<int64_t>(want, 1));
}

}  // namespace splits
}  // namespace mala
