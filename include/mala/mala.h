// mala — MassAlloc Attention (MALA): causal softmax attention that skips the post-score work of
// tiles whose largest contribution ratio is below tau / L_q.  The rules are in docs/spec.md.
//
// This is the one public header (with tile_state.h, which it includes).  Every entry point takes a
// plain argument struct and returns a Status whose message names the offending argument; nothing is
// written when a check fails.
//
// Layout conventions (as flash_attn):
//   q, o, dout, dq : [batch, seqlen_q, heads_q,  head_dim]
//   k, v, dk, dv   : [batch, seqlen_k, heads_kv, head_dim]
//   lse            : [batch, heads_q, seqlen_q] fp32          (varlen: [heads_q, total_q])
//   fwd/bwd_slots  : [batch, heads_q, seqlen_q] int32         (varlen: [heads_q, total_q])
//   tile_mask      : [batch, heads_q, n_q_tiles, n_k_tiles] uint8, values TileState
// Strides are in elements; head_dim must be contiguous.  A stride struct left at zero means the
// contiguous layout above; a zero field is filled in from the ones inside it (head = head_dim,
// row = heads * head, batch = seqlen * row).  Negative or overlapping strides are rejected.
// With cu_seqlens_q/k set (varlen), tensors are [total, heads, head_dim], `batch` is the number
// of sequences and seqlen_q/seqlen_k are the maxima over sequences (tile_mask: n_q_tiles =
// ceil(seqlen_q / block_q), n_k_tiles = ceil(seqlen_k / block_k); tiles past a sequence's end are
// kTileIllegal).  Varlen sequences may be empty.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mala/tile_state.h"  // TileState: the tile masks' values

namespace mala {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2 };
enum class Device : int { cpu = 0, cuda = 1 };

const char* dtype_name(DType);
size_t dtype_size(DType);

struct Status {
  bool ok = true;
  std::string message;  // on error: names the argument, e.g. "tau: must be >= 0 (got -1)"
  explicit operator bool() const { return ok; }
  static Status success() { return {}; }
  static Status error(std::string msg) { return {false, std::move(msg)}; }
};

// Element strides of a [batch, seqlen, heads, head_dim] tensor (head_dim stride is 1).
// All zero = contiguous.
struct Strides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;
};

// Tile sizes an implementation uses.  Part of the semantics: the CPU path accepts them so it can
// reproduce any kernel's decisions.
struct Tiles {
  int block_q = 128;
  int block_k = 128;
};

struct ForwardArgs {
  Device device = Device::cpu;
  DType dtype = DType::f32;  // q, k, v, o

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;           // optional
  int32_t* fwd_slots = nullptr;   // optional realized work per row
  uint8_t* tile_mask = nullptr;   // optional TileState per (batch, head, q tile, k tile)

  int64_t batch = 1, seqlen_q = 0, seqlen_k = 0;
  int64_t heads_q = 1, heads_kv = 1, head_dim = 0;
  Strides q_strides, k_strides, v_strides, o_strides;

  const int32_t* cu_seqlens_q = nullptr;  // varlen: [batch + 1], same device as the tensors
  const int32_t* cu_seqlens_k = nullptr;
  // Varlen, optional: the rows of the packed k and v (at least cu_seqlens_k[batch], which lives on
  // the device; flash_attn's total_k = k.shape[0]).  Given, the Hopper forward loads K and V by TMA
  // (its fastest kernel) and the stride check covers every row; 0 = not given (on Hopper the
  // mma.sync kernel then runs, which is slower: docs/kernels.md, "Known limits").  With it, a
  // sequence's last key tile also reads rows after the sequence (the next sequence's, or rows up to
  // total_k): they get zero weight, but must hold finite values, as they do in a packed tensor.
  int64_t total_k = 0;
  // Varlen, optional: the rows of the packed q and o (flash_attn's total_q = q.shape[0]); 0 = not
  // given.  Given, it bounds the q row space: on the CPU, where the offsets are readable,
  // cu_seqlens_q[batch] > total_q is refused (otherwise q is read and o written past their ends).
  // On CUDA the offsets live on the device and are not read by the checks: cu_seqlens_q[batch] <=
  // total_q (and cu_seqlens_k[batch] <= total_k) is the caller's contract there.
  int64_t total_q = 0;

  bool causal = true;          // bottom-right aligned when seqlen_q != seqlen_k
  float softmax_scale = 0.f;   // 0 = 1/sqrt(head_dim)
  float tau = 1.0f;            // 0 = exact dense attention
  int block_q = 0, block_k = 0;  // 0 = the implementation's tiles (see forward_tiles)

  // The call as one split of a longer causal sequence (context parallelism: a rank's query chunk
  // against one KV shard; docs/spec.md, "Split rules").  Masking still follows `causal`; these change
  // the tile test only.  Not with varlen.  Defaults: off.
  //   rows_before >= 0: row r's threshold uses L_q = rows_before + r + 1, its length in the whole
  //     sequence (the global position of row 0), instead of the keys it sees in this call; it must be
  //     at least that count (causal: rows_before >= seqlen_k - seqlen_q; else rows_before >= seqlen_k - 1).
  //   seed_lse: [batch, heads_q, seqlen_q] fp32, natural log of the exact mass of the row's anchor
  //     tiles that this call does not hold (-inf: none); added to the test's denominator only.  o, lse
  //     and fwd_slots then cover the call's own retained keys: a row that retains nothing gets o = 0,
  //     lse = -inf.
  //   owns_tile0 / owns_newest (with seed_lse): this call's key tile 0 is the sequence's key tile 0 /
  //     each row's newest legal key tile here is its newest in the sequence (the call holds the
  //     diagonal): those anchor tiles are retained untested.
  int64_t rows_before = -1;
  const float* seed_lse = nullptr;
  bool owns_tile0 = false, owns_newest = false;
  void* stream = nullptr;      // cudaStream_t for Device::cuda
};

struct BackwardArgs {
  Device device = Device::cpu;
  DType dtype = DType::f32;  // q, k, v, o, dout, dq, dk, dv

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;  // from forward (required)
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int32_t* bwd_slots = nullptr;  // optional
  uint8_t* tile_mask = nullptr;  // optional, [batch, heads_q, n_q_tiles, n_k_tiles]

  int64_t batch = 1, seqlen_q = 0, seqlen_k = 0;
  int64_t heads_q = 1, heads_kv = 1, head_dim = 0;
  Strides q_strides, k_strides, v_strides, o_strides, dout_strides;
  Strides dq_strides, dk_strides, dv_strides;

  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // Varlen, optional: the rows of the packed q (and o, dout, dq) and of k (and v, dk, dv), as
  // ForwardArgs::total_k.  Given both, the Hopper backward loads by TMA (its fastest kernel); else
  // the mma.sync kernel runs, which is slower, and deterministic = true is refused.
  int64_t total_q = 0, total_k = 0;

  bool causal = true;
  float softmax_scale = 0.f;
  float tau = 1.0f;
  int block_q = 0, block_k = 0;
  // The call as one split of a longer causal sequence (as ForwardArgs::rows_before; lse is then the
  // whole row's final lse): the offline test uses L_q = rows_before + r + 1.  -1 = off.
  int64_t rows_before = -1;
  // Optional: the tile mask the forward of this same attention wrote (ForwardArgs::tile_mask, same
  // inputs, tau and options), [batch, heads_q, ceil(seqlen_q / forward_block_q), ceil(seqlen_k /
  // forward_block_k)], with the forward's tiles (forward_tiles()).  A backward tile none of whose
  // forward tiles was retained is skipped without recomputing its scores: the forward tested them
  // against a running normaliser no larger than the final lse, so the offline rule skips them too
  // (docs/spec.md: backward support is nested in forward support; the decisions are the same up to
  // rounding at the threshold).  Each backward tile must be a union of forward tiles (forward_block_q
  // divides backward_tiles().block_q, forward_block_k its block_k).  Used by the Hopper backward at
  // d = 64 and 128 (deterministic or not); ignored elsewhere (the CPU backward included).
  const uint8_t* forward_tile_mask = nullptr;
  int forward_block_q = 0, forward_block_k = 0;
  // dQ, dK and dV bit-identical from run to run: dQ is added in int32 fixed point (d = 64 and 128:
  // integer sums do not depend on the order of the adds; each row's unit puts a bound on its |dQ| at
  // 2^30, so each add's rounding is at most 2^-31 of that bound) or computed by a query-major kernel
  // without atomics (d = 256), and the dK / dV partials of a split query-head group are summed in
  // split order.  CUDA: the Hopper backward (sm_90, tensors
  // the TMA can describe) only; the CPU backward is deterministic anyway.
  bool deterministic = false;
  // CUDA: scratch of backward_workspace_size() bytes (rowsum(dO*O), lse in log2, the dQ accumulator
  // -- fp32, int32 when deterministic, none at d = 256 on Hopper, whose dQ kernel adds
  // nothing -- and at d = 256 and tau > 0 a tile mask for the dQ kernel when tile_mask is null).
  // Null = allocated stream-ordered inside the call.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  void* stream = nullptr;
};

// Decode / small-query prefill against a KV cache (flash_attn_with_kvcache semantics).
//   q          : [batch, seqlen_q, heads_q, head_dim]
//   k/v_cache  : contiguous [batch, cache_capacity, heads_kv, head_dim], or paged
//                [num_blocks, page_size, heads_kv, head_dim] with block_table [batch, max_pages]
//   cache_seqlens [batch] int32: keys already in the cache (before k_new is appended)
//   k_new/v_new: optional [batch, seqlen_new, heads_kv, head_dim], written into the cache at
//                cache_seqlens[b] before attending; attention then sees cache_seqlens[b]+seqlen_new keys.
//   tile_mask  : optional [batch, heads_kv (packed) or heads_q, n_q_tiles, n_k_tiles] with
//                n_q_tiles = ceil(seqlen_q * G / block_q) packed (rows r = token * G + g, G =
//                heads_q / heads_kv) or ceil(seqlen_q / block_q), and n_k_tiles = ceil(capacity /
//                block_k), capacity = cache_capacity (contiguous) or max_pages * page_size (paged).
//   Split-KV: split s owns rule::split_tiles(ceil(Nk / block_k), num_splits, s) of the sequence's
//   key tiles, Nk = cache_seqlens[b] + seqlen_new.  split_rule picks how a split tests its tiles.
//
// How a split of split-KV decode tests its tiles (docs/spec.md, "Split rules").  With one split
// both are exactly the forward rule.  The CPU and the CUDA kernels implement both.
//   seeded:    (the default) the anchor tiles of the query tile (key tile 0 and each row's newest
//              legal key tile) are retained by the split owning them without a test; every split
//              adds the exact mass of the anchor tiles it does not own (scores only, no V) to the
//              denominator of its test.  Same bound, eps_q <= tau / (1 + tau); skips about what the
//              unsplit rule skips.  A split may retain nothing.
//   per_split: the paper's rule: each split tests against its own running retained mass (its first
//              legal tile is always kept).  Far splits hold little mass, so they keep nearly every
//              tile (99% at 132 splits where the unsplit rule keeps 1.5%).
enum class SplitRule : int { per_split = 0, seeded = 1 };
// The largest DecodeArgs::num_splits a caller may ask for (flash_attn's bound).
constexpr int kMaxNumSplits = 128;
const char* split_rule_name(SplitRule);  // "per_split", "seeded"

struct DecodeArgs {
  Device device = Device::cpu;
  DType dtype = DType::f32;

  const void* q = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int32_t* cache_seqlens = nullptr;
  const int32_t* block_table = nullptr;  // paged when non-null
  int64_t block_table_stride = 0;        // elements between batch rows (0 = max_pages)
  int64_t max_pages = 0;                 // columns of block_table
  int64_t page_size = 0;
  int64_t num_pages = 0;                 // rows of the paged cache (for bounds checks)
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  void* o = nullptr;
  float* lse = nullptr;            // optional [batch, heads_q, seqlen_q]
  int32_t* fwd_slots = nullptr;    // optional [batch, heads_q, seqlen_q]
  uint8_t* tile_mask = nullptr;    // optional

  int64_t batch = 1, seqlen_q = 1, seqlen_new = 0, cache_capacity = 0;
  int64_t heads_q = 1, heads_kv = 1, head_dim = 0;
  Strides q_strides, k_cache_strides, v_cache_strides, k_new_strides, v_new_strides, o_strides;

  bool causal = true;
  float softmax_scale = 0.f;
  float tau = 1.0f;
  int block_q = 0, block_k = 0;
  int num_splits = 0;     // 0 = heuristic (decode_num_splits); at most kMaxNumSplits
  SplitRule split_rule = SplitRule::seeded;  // see SplitRule
  bool pack_gqa = true;   // query heads sharing a KV head form one query tile
  void* workspace = nullptr;  // CUDA: decode_workspace_size() bytes; null = allocated in the call
  size_t workspace_bytes = 0;
  void* stream = nullptr;
};

// ---- entry points ----------------------------------------------------------------------------
Status forward(const ForwardArgs& args);
Status backward(const BackwardArgs& args);
Status decode(const DecodeArgs& args);

// Argument checks alone (what the entry points run first), including that no output overlaps an
// input or another output ("dq: overlaps q"; the bytes each tensor spans follow from its shape
// and strides; interleaved views of one packed tensor, such as q, k, v of a [B, N, 3, H, d]
// tensor, do not count as overlapping).  Decode appending (k_new given) writes k_cache and
// v_cache: then each cache may overlap only its own new rows (k_cache with k_new, v_cache with
// v_new); overlapping the other cache (k_cache is v_cache), the other new rows, q, cache_seqlens
// or block_table is refused.
// Sizes are checked in int64 arithmetic: a tensor whose byte extent (from its shape and strides)
// does not fit in int64 is refused, naming the tensor, before any offset is computed.
// The entry points never throw: an allocation that fails returns "out of memory" naming its size.
Status check(const ForwardArgs& args);
Status check(const BackwardArgs& args);
Status check(const DecodeArgs& args);

// Tile sizes the implementation for args.device uses (block_q/block_k of 0 resolved).
Tiles forward_tiles(const ForwardArgs& args);
Tiles backward_tiles(const BackwardArgs& args);
Tiles decode_tiles(const DecodeArgs& args);
int decode_num_splits(const DecodeArgs& args);  // resolves num_splits = 0
size_t backward_workspace_size(const BackwardArgs& args);
size_t decode_workspace_size(const DecodeArgs& args);
// Whether backward(args) would read a BackwardArgs::forward_tile_mask (the pointer itself is not
// looked at; shapes, tau, deterministic and the device decide): lets a caller such as autograd have
// the forward record its tile mask only where the backward uses it.  False on the CPU.
bool backward_reads_forward_tile_mask(const BackwardArgs& args);

bool cuda_available();        // built with CUDA and a device is present
std::string device_name();    // "cpu (N threads)" or the CUDA device name

// ---- exact references (CPU, fp32 in/out, double accumulation), kept apart from the tiled code --
namespace reference {
// Dense softmax attention (ignores tau, tiles and slot/tile outputs).
Status dense_forward(const ForwardArgs& args);
Status dense_backward(const BackwardArgs& args);
}  // namespace reference

// ---- fidelity and work ----------------------------------------------------------------------
struct Distribution {
  double mean = 0, p95 = 0, max = 0;
  int64_t count = 0;
};
// Statistics over rows with visible keys (L_q > 0). slots: [batch, heads_q, seqlen_q] (CPU memory).
Distribution slot_stats(const int32_t* slots, int64_t batch, int64_t heads_q, int64_t seqlen_q,
                        int64_t seqlen_k, bool causal);
// Fraction of legal tiles retained in a tile_mask of n entries.
double retained_fraction(const uint8_t* tile_mask, int64_t n);
// Omitted dense mass per valid row, 1 - exp(lse - lse_dense); rows with L_q = 0 are ignored.
Distribution omitted_mass(const float* lse, const float* lse_dense, int64_t n);
// ||x - ref|| / ||ref|| over n fp32 values.
double relative_l2(const float* x, const float* ref, int64_t n);

// ---- workloads (docs/workloads.md) -----------------------------------------------------------
// "random": q, k, v, dout ~ N(0, 1): near-uniform attention, MALA retains almost everything.
// "synthetic": a documented generator with a sharpness knob (0 = random-like; larger = sharper
// attention, fewer retained tiles).
struct WorkloadSpec {
  std::string regime = "synthetic";
  int64_t batch = 1, seqlen = 4096, heads_q = 8, heads_kv = 1, head_dim = 128;
  double sharpness = 1.0;
  uint64_t seed = 0;
};
// Fills contiguous fp32 q, dout [batch, seqlen, heads_q, head_dim] and k, v
// [batch, seqlen, heads_kv, head_dim]; dout may be null.
Status make_workload(const WorkloadSpec& spec, float* q, float* k, float* v, float* dout);

}  // namespace mala
