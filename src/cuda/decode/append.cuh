// The decode's append kernel: k_new / v_new written into the cache before the split kernel reads it.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/decode/params.h"

namespace mala {
namespace cuda {

// k_new / v_new -> cache rows cache_seqlens[b] + t.  Block: 2 * D/8 threads (K then V), 16 B each.
template <typename T, int D>
__global__ void decode_append_kernel(const DecodeParams p) {
  constexpr int DCH = D / 8;
  const int t = blockIdx.x / p.Hkv, h = blockIdx.x % p.Hkv, b = blockIdx.y;
  const int which = threadIdx.x / DCH, ch = threadIdx.x % DCH;
  const int pos = p.cache_seqlens[b] + t;
  if (pos < 0 || pos >= p.capacity) return;
  const T* src = static_cast<const T*>(which ? p.v_new : p.k_new) +
                 b * (which ? p.vn_sb : p.kn_sb) + t * (which ? p.vn_sr : p.kn_sr) + h * (which ? p.vn_sh : p.kn_sh) +
                 ch * 8;
  const int64_t sb = which ? p.v_sb : p.k_sb, sr = which ? p.v_sr : p.k_sr, sh = which ? p.v_sh : p.k_sh;
  int64_t off;
  if (p.block_table) {
    const int page = p.block_table[b * p.bt_stride + pos / p.page_size];
    off = static_cast<int64_t>(page) * sb + static_cast<int64_t>(pos % p.page_size) * sr;
  } else {
    off = static_cast<int64_t>(b) * sb + static_cast<int64_t>(pos) * sr;
  }
  T* dst = static_cast<T*>(which ? p.v_cache : p.k_cache) + off + h * sh + ch * 8;
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}

}  // namespace cuda
}  // namespace mala
