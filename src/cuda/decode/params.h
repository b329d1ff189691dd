// Parameters and shared-memory configuration of the split-KV decode kernels (decode/kernel.cuh),
// filled by decode/dispatch.cu.  Plain data, no CUDA types.
#pragma once

#include <stdint.h>

namespace mala {
namespace cuda {

// Decode query tile height: one m16 mma fragment of packed rows (token * G + g) or tokens.
constexpr int kDecodeBlockQ = 16;

// Key tile of the decode kernels for a head dim: part of the semantics (one skip decision per tile;
// the CPU path reproduces it through decode_tiles).  128 keys at d <= 128: smaller tiles would put
// more (K, V) stages in flight without making batch-1 decode faster, while the sparse variant would
// pay its exposed V latency on twice as many tiles.
constexpr int decode_block_k(int head_dim) { return head_dim == 256 ? 64 : 128; }

// Warps of the split kernel's CTA (one CTA per SM): the warps split a tile's keys for QK^T and the
// head dims for PV, each in slices of at least 16.  One warp per scheduler leaves every dependent
// instruction's latency exposed (the kernel is issue-bound when tiles are skipped), so d = 128 takes
// 8 warps; d = 64 (16 dims per warp at 4) and d = 256 (16 keys of a 64-key tile at 4) take 4.
constexpr int decode_warps(int head_dim) { return head_dim == 128 ? 8 : 4; }

// kLargeSmem: the sm_90 opt-in shared memory (227 KB per block); otherwise sm_80's 163 KB.  The
// host picks the instance from the device's cudaDevAttrMaxSharedMemoryPerBlockOptin.
template <int D, bool kLargeSmem>
struct DecodeConfig {
  static constexpr int BK = decode_block_k(D);
  static constexpr int WARPS = decode_warps(D), THREADS = 32 * WARPS;
  static constexpr int TILE_BYTES = BK * D * 2;
  static constexpr int P_BYTES = kDecodeBlockQ * BK * 2;
  static constexpr int SMEM_BUDGET = (kLargeSmem ? 227 : 163) * 1024;
  // Sparse variant: V of a retained tile is read after its test, into the slot its K has just left,
  // and consumed DEFER tiles later (its P and m wait in NP = DEFER + 1 shared-memory slots), so the V
  // latency hides behind the next tiles' QK while K streams AHEAD tiles ahead of the test.
  static constexpr int DEFER = kLargeSmem ? 2 : 1, NP = DEFER + 1;
  // Q, P (NP slots sparse, 1 dense), the [WARPS][16 rows] row-max exchange, the row-sum exchange
  // (two parities sparse, one dense) and, sparse, the m of each P slot.
  static constexpr int extra_bytes(bool dense) {
    return kDecodeBlockQ * D * 2 + (dense ? 1 : NP) * P_BYTES + WARPS * kDecodeBlockQ * 4 +
           (dense ? 1 : 2) * WARPS * kDecodeBlockQ * 4 + (dense ? 0 : NP * kDecodeBlockQ * 4);
  }
  // Tile buffers, as many as fit (decode is memory-bound: they are the bytes in flight per SM).
  // Dense: NBUF_DENSE / 2 (K, V) stages, loaded NBUF_DENSE / 2 - 1 tiles ahead.  Sparse: NBUF_SPARSE
  // slots, each holding a tile's K and then, if it is retained, its V until the PV; the slot is free
  // for the K of the tile NBUF_SPARSE later once that PV is done, so K runs AHEAD_SPARSE =
  // NBUF_SPARSE - DEFER tiles ahead (at most 8: the cp.async group counts the waits name stay <= 15).
  static constexpr int NBUF_DENSE = (SMEM_BUDGET - extra_bytes(true)) / TILE_BYTES / 2 * 2;
  static constexpr int NBUF_SPARSE = (SMEM_BUDGET - extra_bytes(false)) / TILE_BYTES;
  static constexpr int AHEAD_SPARSE = NBUF_SPARSE - DEFER < 8 ? NBUF_SPARSE - DEFER : 8;
  static constexpr int smem_bytes(bool dense) {
    return (dense ? NBUF_DENSE : NBUF_SPARSE) * TILE_BYTES + extra_bytes(dense);
  }
};

struct DecodeParams {
  const void* q;
  void* k_cache;
  void* v_cache;
  const int32_t* cache_seqlens;
  const int32_t* block_table;  // paged when non-null
  int64_t bt_stride;
  int page_size;
  int page_shift;    // log2(page_size) when it is a power of two, else -1
  int page_in_tile;  // paged and page_size % block_k == 0: a key tile never crosses a page
  int capacity;  // keys one sequence can hold (contiguous: cache_capacity; paged: page_size*max_pages)
  const void* k_new;
  const void* v_new;
  void* o;
  float* lse;         // optional [B, Hq, Nq] natural log
  int32_t* slots;     // optional [B, Hq, Nq]
  uint8_t* tile_mask; // optional [B, HS, NQT, n_cap]

  // Split partials (num_splits > 1): index ((b*HS + hs)*NQT + qt)*S + s
  float* ws_o;    // [.., 16, D] fp32, normalized by the split's l
  float* ws_lse;  // [.., 16] log2 domain, -inf when the split saw nothing for the row
  int* ws_cnt;    // [..] retained tiles of the split

  int B, Nq, seqlen_new, Hq, Hkv, G;
  int HS;    // query-tile owners per sequence: Hkv (packed) or Hq
  int R;     // rows per owner: Nq*G (packed) or Nq
  int NQT;   // query tiles per owner
  int S;     // splits
  int n_cap; // key tiles of the capacity (tile_mask width)
  int causal, pack;
  int seeded;  // split_rule = seeded and S > 1 (S = 1: the forward rule, nothing seeded or forced)
  float scale_log2;  // softmax_scale * log2(e)
  float log2_tau;    // log2(tau), -inf for tau = 0

  // Element strides (resolved).  Cache: contiguous [B, cap, Hkv, D] or paged [pages, page_size, Hkv, D].
  int64_t q_sb, q_sr, q_sh;
  int64_t o_sb, o_sr, o_sh;
  int64_t k_sb, k_sr, k_sh;
  int64_t v_sb, v_sr, v_sh;
  int64_t kn_sb, kn_sr, kn_sh;
  int64_t vn_sb, vn_sr, vn_sh;
};

}  // namespace cuda
}  // namespace mala
