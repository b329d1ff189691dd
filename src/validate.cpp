// mala::check(): every argument of every entry point is checked here before anything is read or
// written; each message starts with the name of the offending argument.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "cpu/cpu.h"
#include "common/checked.h"
#include "common/layout.h"
#include "cuda/backend.h"
#include "mala/mala.h"
#include "validate.h"
#include "validate_util.h"

namespace mala {
namespace {

using internal::ceil_div;
using internal::fail;
using internal::flat_bytes;
using internal::str;

constexpr int64_t kMaxSeqlen = 0x7fffffff;  // the rule works with int row/key indices
constexpr int64_t kMaxCpuHeadDim = 512;

Status check_device(Device d) {
  if (d != Device::cpu && d != Device::cuda) return fail("device", "unknown device " + str(static_cast<int>(d)));
  return Status::success();
}

Status check_dtype(Device d, DType t) {
  if (t != DType::f32 && t != DType::f16 && t != DType::bf16)
    return fail("dtype", "must be float32, float16 or bfloat16 (got " + str(static_cast<int>(t)) + ")");
  if (d == Device::cuda && t == DType::f32)
    return fail("dtype", "float32 is not supported on cuda (use float16 or bfloat16)");
  return Status::success();
}

Status require(const void* p, const char* name) {
  if (!p) return fail(name, "must not be null");
  return Status::success();
}

Status positive(int64_t v, const char* name) {
  if (v <= 0) return fail(name, "must be > 0 (got " + str(v) + ")");
  return Status::success();
}

Status check_seqlen(int64_t v, const char* name) {
  MALA_TRY(positive(v, name));
  if (v > kMaxSeqlen) return fail(name, "must be < 2^31 (got " + str(v) + ")");
  return Status::success();
}

Status check_heads(int64_t heads_q, int64_t heads_kv) {
  MALA_TRY(positive(heads_q, "heads_q"));
  MALA_TRY(positive(heads_kv, "heads_kv"));
  if (heads_q % heads_kv != 0)
    return fail("heads_q", "must be a multiple of heads_kv (got heads_q=" + str(heads_q) +
                               ", heads_kv=" + str(heads_kv) + ")");
  return Status::success();
}

Status check_head_dim(Device d, int64_t head_dim) {
  MALA_TRY(positive(head_dim, "head_dim"));
  if (d == Device::cuda) {
    if (head_dim != 64 && head_dim != 128 && head_dim != 256)
      return fail("head_dim", "must be 64, 128 or 256 on cuda (got " + str(head_dim) + ")");
  } else if (head_dim > kMaxCpuHeadDim) {
    return fail("head_dim", "must be <= " + str(kMaxCpuHeadDim) + " on cpu (got " + str(head_dim) + ")");
  }
  return Status::success();
}

Status check_scalars(float softmax_scale, float tau) {
  if (!(tau >= 0.f) || std::isinf(tau)) return fail("tau", "must be finite and >= 0 (got " + str(tau) + ")");
  if (!(softmax_scale >= 0.f) || std::isinf(softmax_scale))
    return fail("softmax_scale", "must be finite and >= 0, 0 meaning 1/sqrt(head_dim) (got " +
                                     str(softmax_scale) + ")");
  return Status::success();
}

// CPU: any positive block (0 = default).  CUDA: 0 or exactly the kernel's tile.
Status check_block(Device d, int v, int cuda_value, const char* name) {
  if (v < 0) return fail(name, "must be >= 0, 0 meaning the implementation's tile (got " + str(v) + ")");
  if (d == Device::cuda && v != 0 && v != cuda_value)
    return fail(name, "the cuda kernel uses " + str(cuda_value) + " (got " + str(v) + "); pass 0 or " +
                          str(cuda_value));
  return Status::success();
}

// Element strides of a [count_batch, rows, heads, head_dim] tensor: no negative stride, and no two
// (batch, row, head) positions may share an element.  Sufficient test: sorted by stride, every
// dimension must step past the whole extent of the dimensions inside it.
// The tensor's byte extent must fit in int64 (elem bytes per element), so that every element and
// byte offset the implementations compute from these strides is exact.
Status check_strides(const char* name, const Strides& s, int64_t batch, int64_t seqlen, int64_t heads,
                     int64_t head_dim, size_t elem) {
  if (s.batch < 0 || s.row < 0 || s.head < 0)
    return fail(name, "strides must be >= 0 (got batch=" + str(s.batch) + ", row=" + str(s.row) +
                          ", head=" + str(s.head) + ")");
  // The default strides may not wrap: heads * head and seqlen * row.
  const std::string tensor = std::string(name).substr(0, std::string(name).rfind("_strides"));
  layout::Resolved r;
  if (!layout::resolve_checked(s, seqlen, heads, head_dim, &r))
    return fail(tensor, "its shape [" + str(batch) + ", " + str(seqlen) + ", " + str(heads) + ", " + str(head_dim) +
                            "] and strides overflow int64 element offsets");
  struct Dim {
    const char* what;
    int64_t count, stride;
  };
  // At most three dimensions: a fixed array and an insertion sort, so that the check allocates
  // nothing (it runs on every call).  The sort is stable: equal strides keep the order batch, row,
  // head, which decides the dimension an error names.
  Dim dims[3];
  int n = 0;
  if (batch > 1) dims[n++] = {"batch", batch, r.batch};
  if (seqlen > 1) dims[n++] = {"row", seqlen, r.row};
  if (heads > 1) dims[n++] = {"head", heads, r.head};
  for (int i = 1; i < n; ++i)
    for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) std::swap(dims[j], dims[j - 1]);
  int64_t span = head_dim;  // elements covered by the dimensions inside the current one
  for (int i = 0; i < n; ++i) {
    const Dim& dm = dims[i];
    if (dm.stride > (INT64_MAX - span) / std::max<int64_t>(dm.count - 1, 1))
      return fail(name, std::string(dm.what) + " stride " + str(dm.stride) + " is too large");
    if (dm.stride < span)
      return fail(name, std::string(dm.what) + " stride " + str(dm.stride) +
                            " makes elements overlap (needs >= " + str(span) + " with head_dim=" +
                            str(head_dim) + ")");
    span += (dm.count - 1) * dm.stride;
  }
  if (span > INT64_MAX / static_cast<int64_t>(elem))
    return fail(tensor, "spans " + str(span) + " elements of " + str(elem) + " bytes: more than 2^63 bytes (shape [" +
                            str(batch) + ", " + str(seqlen) + ", " + str(heads) + ", " + str(head_dim) + "])");
  return Status::success();
}


Status check_cuda_pointer(Device d, const void* p, const char* name) {
  if (d != Device::cuda || p == nullptr) return Status::success();
  return cuda_backend::check_device_pointer(p, name);
}

// Varlen offsets (CPU memory only): start at 0, non-decreasing, no sequence longer than max_len.
Status check_cu_seqlens(const int32_t* cu, int64_t batch, int64_t max_len, const char* name,
                        const char* max_name) {
  if (cu[0] != 0) return fail(name, "must start at 0 (got " + str(cu[0]) + ")");
  for (int64_t b = 0; b < batch; ++b) {
    int64_t len = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (len < 0)
      return fail(name, "must be non-decreasing (entry " + str(b + 1) + " = " + str(cu[b + 1]) +
                            " < entry " + str(b) + " = " + str(cu[b]) + ")");
    if (len > max_len)
      return fail(name, "sequence " + str(b) + " has length " + str(len) + " > " + max_name + " = " +
                            str(max_len));
  }
  return Status::success();
}

// Shared by forward and backward.
struct Shape {
  Device device;
  DType dtype;
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  float softmax_scale, tau;
  int block_q, block_k;
  const int32_t* cu_q;
  const int32_t* cu_k;
};

// Everything but the tile sizes (whose CUDA check needs sane arguments to ask the kernel).
Status check_shape(const Shape& s) {
  MALA_TRY(check_device(s.device));
  MALA_TRY(check_dtype(s.device, s.dtype));
  MALA_TRY(positive(s.batch, "batch"));
  MALA_TRY(check_seqlen(s.seqlen_q, "seqlen_q"));
  MALA_TRY(check_seqlen(s.seqlen_k, "seqlen_k"));
  MALA_TRY(check_heads(s.heads_q, s.heads_kv));
  MALA_TRY(check_head_dim(s.device, s.head_dim));
  MALA_TRY(check_scalars(s.softmax_scale, s.tau));
  if ((s.cu_q == nullptr) != (s.cu_k == nullptr))
    return fail(s.cu_q ? "cu_seqlens_k" : "cu_seqlens_q", "varlen needs both cu_seqlens_q and cu_seqlens_k");
  return Status::success();
}

// kernel_tiles is only consulted for Device::cuda.
Status check_blocks(const Shape& s, Tiles kernel_tiles) {
  MALA_TRY(check_block(s.device, s.block_q, kernel_tiles.block_q, "block_q"));
  MALA_TRY(check_block(s.device, s.block_k, kernel_tiles.block_k, "block_k"));
  return Status::success();
}

// Rows of the packed (varlen) or per-batch (dense) row space, used for the overlap test.
struct RowSpace {
  int64_t batch_count;  // 1 for varlen: the batch stride is not used
  int64_t rows_q, rows_k;
};

Status check_varlen_and_rows(const Shape& s, RowSpace* rs) {
  if (!s.cu_q) {
    *rs = {s.batch, s.seqlen_q, s.seqlen_k};
    return Status::success();
  }
  if (s.device == Device::cpu) {
    MALA_TRY(check_cu_seqlens(s.cu_q, s.batch, s.seqlen_q, "cu_seqlens_q", "seqlen_q"));
    MALA_TRY(check_cu_seqlens(s.cu_k, s.batch, s.seqlen_k, "cu_seqlens_k", "seqlen_k"));
    *rs = {1, std::max<int64_t>(s.cu_q[s.batch], 1), std::max<int64_t>(s.cu_k[s.batch], 1)};
  } else {
    // The offsets live on the device; the overlap test uses the longest sequence.
    *rs = {1, s.seqlen_q, s.seqlen_k};
  }
  return Status::success();
}


// A varlen call's optional packed row count (ForwardArgs::total_k, BackwardArgs::total_q/total_k):
// 0 = not given; else at least the longest sequence and (on the CPU, where the offsets are readable)
// cu[batch].  Given, it is the row space the strides are checked over.
Status check_total(Device device, int64_t batch, int64_t total, int64_t seqlen, const int32_t* cu, const char* name,
                   const char* cu_name, const char* seqlen_name, int64_t* rows) {
  if (total == 0) return Status::success();
  if (!cu) return fail(name, std::string("is for varlen inputs (") + cu_name + ") only");
  if (total < 0 || total > kMaxSeqlen) return fail(name, "must be in [0, 2^31) (got " + str(total) + ")");
  // The offsets are the caller's argument that is wrong here: name them.
  if (device == Device::cpu && total < cu[batch])
    return fail(cu_name, "last entry (" + str(cu[batch]) + ") is past the rows of the packed tensor (" + name +
                             " = " + str(total) + ")");
  if (total < seqlen)
    return fail(name, std::string("is below ") + seqlen_name + ", the longest sequence (" + str(total) + " < " +
                          str(seqlen) + ")");
  *rows = total;
  return Status::success();
}

// ForwardArgs/BackwardArgs::rows_before: the call as one split of a longer causal sequence.  The
// threshold length rows_before + r + 1 may not be below the keys row r sees in the call.
Status check_rows_before(int64_t rows_before, bool causal, int64_t seqlen_q, int64_t seqlen_k, bool varlen) {
  if (rows_before == -1) return Status::success();
  if (rows_before < 0 || rows_before > kMaxSeqlen)
    return fail("rows_before", "must be -1 (off) or in [0, 2^31) (got " + str(rows_before) + ")");
  if (varlen) return fail("rows_before", "is not supported with varlen inputs (cu_seqlens_q)");
  const int64_t need = causal ? seqlen_k - seqlen_q : seqlen_k - 1;
  if (rows_before < need)
    return fail("rows_before", std::string("must be >= ") + (causal ? "seqlen_k - seqlen_q" : "seqlen_k - 1") +
                                   " = " + str(need) + " so that no row sees more keys than its length (got " +
                                   str(rows_before) + ")");
  return Status::success();
}

}  // namespace

namespace internal {

Status check_arguments(const ForwardArgs& a) {
  MALA_TRY(check_device(a.device));
  Shape s{a.device, a.dtype, a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.head_dim,
          a.softmax_scale, a.tau, a.block_q, a.block_k, a.cu_seqlens_q, a.cu_seqlens_k};
  MALA_TRY(require(a.q, "q"));
  MALA_TRY(require(a.k, "k"));
  MALA_TRY(require(a.v, "v"));
  MALA_TRY(require(a.o, "o"));
  MALA_TRY(check_shape(s));
  if (a.device == Device::cuda) {
    const std::pair<const void*, const char*> ptrs[] = {
        {a.q, "q"}, {a.k, "k"}, {a.v, "v"}, {a.o, "o"}, {a.lse, "lse"}, {a.fwd_slots, "fwd_slots"},
        {a.tile_mask, "tile_mask"}, {a.cu_seqlens_q, "cu_seqlens_q"}, {a.cu_seqlens_k, "cu_seqlens_k"},
        {a.seed_lse, "seed_lse"}};
    for (const auto& p : ptrs) MALA_TRY(check_cuda_pointer(a.device, p.first, p.second));
    // The kernel's tiles only where the caller names tiles (0 accepts the kernel's): asking is the
    // dispatch's kernel choice, tensor maps included.
    MALA_TRY(check_blocks(s, a.block_q || a.block_k ? cuda_backend::forward_tiles(a) : Tiles{}));
  } else {
    MALA_TRY(check_blocks(s, Tiles{}));
  }
  RowSpace rs;
  MALA_TRY(check_varlen_and_rows(s, &rs));
  MALA_TRY(check_total(a.device, a.batch, a.total_q, a.seqlen_q, a.cu_seqlens_q, "total_q", "cu_seqlens_q",
                       "seqlen_q", &rs.rows_q));
  MALA_TRY(check_total(a.device, a.batch, a.total_k, a.seqlen_k, a.cu_seqlens_k, "total_k", "cu_seqlens_k",
                       "seqlen_k", &rs.rows_k));
  const size_t es = dtype_size(a.dtype);
  MALA_TRY(check_strides("q_strides", a.q_strides, rs.batch_count, rs.rows_q, a.heads_q, a.head_dim, es));
  MALA_TRY(check_strides("k_strides", a.k_strides, rs.batch_count, rs.rows_k, a.heads_kv, a.head_dim, es));
  MALA_TRY(check_strides("v_strides", a.v_strides, rs.batch_count, rs.rows_k, a.heads_kv, a.head_dim, es));
  MALA_TRY(check_strides("o_strides", a.o_strides, rs.batch_count, rs.rows_q, a.heads_q, a.head_dim, es));
  MALA_TRY(check_rows_before(a.rows_before, a.causal, a.seqlen_q, a.seqlen_k, a.cu_seqlens_q != nullptr));
  if (a.seed_lse && a.cu_seqlens_q) return fail("seed_lse", "is not supported with varlen inputs (cu_seqlens_q)");
  if (!a.seed_lse && (a.owns_tile0 || a.owns_newest))
    return fail(a.owns_tile0 ? "owns_tile0" : "owns_newest", "only applies with seed_lse (a seeded split)");
  return Status::success();
}

Status check_arguments(const BackwardArgs& a) {
  MALA_TRY(check_device(a.device));
  Shape s{a.device, a.dtype, a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.head_dim,
          a.softmax_scale, a.tau, a.block_q, a.block_k, a.cu_seqlens_q, a.cu_seqlens_k};
  MALA_TRY(require(a.q, "q"));
  MALA_TRY(require(a.k, "k"));
  MALA_TRY(require(a.v, "v"));
  MALA_TRY(require(a.o, "o"));
  MALA_TRY(require(a.dout, "dout"));
  MALA_TRY(require(a.lse, "lse"));
  MALA_TRY(require(a.dq, "dq"));
  MALA_TRY(require(a.dk, "dk"));
  MALA_TRY(require(a.dv, "dv"));
  MALA_TRY(check_shape(s));
  if (a.device == Device::cuda) {
    const std::pair<const void*, const char*> ptrs[] = {
        {a.q, "q"}, {a.k, "k"}, {a.v, "v"}, {a.o, "o"}, {a.dout, "dout"}, {a.lse, "lse"},
        {a.dq, "dq"}, {a.dk, "dk"}, {a.dv, "dv"}, {a.bwd_slots, "bwd_slots"}, {a.tile_mask, "tile_mask"},
        {a.cu_seqlens_q, "cu_seqlens_q"}, {a.cu_seqlens_k, "cu_seqlens_k"}, {a.workspace, "workspace"},
        {a.forward_tile_mask, "forward_tile_mask"}};
    for (const auto& p : ptrs) MALA_TRY(check_cuda_pointer(a.device, p.first, p.second));
    const Tiles bt = cuda_backend::backward_tiles(a);
    MALA_TRY(check_blocks(s, bt));
    if (a.forward_tile_mask) {
      if (a.forward_block_q <= 0 || bt.block_q % a.forward_block_q != 0)
        return fail("forward_block_q", "must divide the backward's block_q = " + str(bt.block_q) +
                                           " with forward_tile_mask (got " + str(a.forward_block_q) + ")");
      if (a.forward_block_k <= 0 || bt.block_k % a.forward_block_k != 0)
        return fail("forward_block_k", "must divide the backward's block_k = " + str(bt.block_k) +
                                           " with forward_tile_mask (got " + str(a.forward_block_k) + ")");
    }
    if (a.workspace && a.workspace_bytes < cuda_backend::backward_workspace_size(a))
      return fail("workspace_bytes", "must be >= backward_workspace_size() = " +
                                         str(cuda_backend::backward_workspace_size(a)) + " (got " +
                                         str(a.workspace_bytes) + ")");
  } else {
    MALA_TRY(check_blocks(s, Tiles{}));
  }
  RowSpace rs;
  MALA_TRY(check_varlen_and_rows(s, &rs));
  MALA_TRY(check_total(a.device, a.batch, a.total_q, a.seqlen_q, a.cu_seqlens_q, "total_q", "cu_seqlens_q",
                       "seqlen_q", &rs.rows_q));
  MALA_TRY(check_total(a.device, a.batch, a.total_k, a.seqlen_k, a.cu_seqlens_k, "total_k", "cu_seqlens_k",
                       "seqlen_k", &rs.rows_k));
  const size_t es = dtype_size(a.dtype);
  const struct {
    const char* name;
    const Strides* st;
    bool is_q;
  } tensors[] = {{"q_strides", &a.q_strides, true},       {"k_strides", &a.k_strides, false},
                 {"v_strides", &a.v_strides, false},      {"o_strides", &a.o_strides, true},
                 {"dout_strides", &a.dout_strides, true}, {"dq_strides", &a.dq_strides, true},
                 {"dk_strides", &a.dk_strides, false},    {"dv_strides", &a.dv_strides, false}};
  for (const auto& t : tensors)
    MALA_TRY(check_strides(t.name, *t.st, rs.batch_count, t.is_q ? rs.rows_q : rs.rows_k,
                           t.is_q ? a.heads_q : a.heads_kv, a.head_dim, es));
  MALA_TRY(check_rows_before(a.rows_before, a.causal, a.seqlen_q, a.seqlen_k, a.cu_seqlens_q != nullptr));
  return Status::success();
}

Status check_arguments(const DecodeArgs& a) {
  MALA_TRY(check_device(a.device));
  MALA_TRY(check_dtype(a.device, a.dtype));
  MALA_TRY(require(a.q, "q"));
  MALA_TRY(require(a.k_cache, "k_cache"));
  MALA_TRY(require(a.v_cache, "v_cache"));
  MALA_TRY(require(a.cache_seqlens, "cache_seqlens"));
  MALA_TRY(require(a.o, "o"));
  MALA_TRY(positive(a.batch, "batch"));
  MALA_TRY(check_seqlen(a.seqlen_q, "seqlen_q"));
  if (a.seqlen_new < 0) return fail("seqlen_new", "must be >= 0 (got " + str(a.seqlen_new) + ")");
  if (a.seqlen_new > kMaxSeqlen) return fail("seqlen_new", "must be < 2^31 (got " + str(a.seqlen_new) + ")");
  if ((a.k_new == nullptr) != (a.v_new == nullptr))
    return fail(a.k_new ? "v_new" : "k_new", "k_new and v_new must be given together");
  if (a.seqlen_new > 0 && a.k_new == nullptr)
    return fail("k_new", "must not be null when seqlen_new > 0 (got seqlen_new=" + str(a.seqlen_new) + ")");
  MALA_TRY(check_heads(a.heads_q, a.heads_kv));
  MALA_TRY(check_head_dim(a.device, a.head_dim));
  MALA_TRY(check_scalars(a.softmax_scale, a.tau));
  if (a.split_rule != SplitRule::per_split && a.split_rule != SplitRule::seeded)
    return fail("split_rule", "must be per_split or seeded (got " + str(static_cast<int>(a.split_rule)) + ")");
  if (a.num_splits < 0 || a.num_splits > kMaxNumSplits)
    return fail("num_splits", "must be in [0, " + str(kMaxNumSplits) + "], 0 meaning automatic (got " +
                                  str(a.num_splits) + ")");

  const bool paged = a.block_table != nullptr;
  int64_t capacity;  // keys one sequence can hold
  if (paged) {
    MALA_TRY(positive(a.page_size, "page_size"));
    MALA_TRY(positive(a.max_pages, "max_pages"));
    MALA_TRY(positive(a.num_pages, "num_pages"));
    if (a.block_table_stride < 0)
      return fail("block_table_stride", "must be >= 0 (got " + str(a.block_table_stride) + ")");
    if (a.block_table_stride != 0 && a.block_table_stride < a.max_pages)
      return fail("block_table_stride", "must be 0 or >= max_pages = " + str(a.max_pages) + " (got " +
                                            str(a.block_table_stride) + ")");
    if (!checked::mul(a.page_size, a.max_pages, &capacity))
      return fail("max_pages", "page_size * max_pages overflows int64 (page_size = " + str(a.page_size) +
                                   ", max_pages = " + str(a.max_pages) + ")");
    int64_t bt_extent;  // elements of block_table the batch rows span
    const int64_t bt_stride = a.block_table_stride ? a.block_table_stride : a.max_pages;
    if (!checked::mul(a.batch - 1, bt_stride, &bt_extent) || !checked::add(bt_extent, a.max_pages, &bt_extent) ||
        bt_extent > INT64_MAX / 4)
      return fail("block_table_stride", "the block table's extent overflows int64 (batch = " + str(a.batch) +
                                            ", stride = " + str(bt_stride) + ")");
  } else {
    if (a.page_size != 0 || a.max_pages != 0 || a.num_pages != 0 || a.block_table_stride != 0)
      return fail("block_table", "must not be null when page_size/max_pages/num_pages/block_table_stride are set");
    MALA_TRY(positive(a.cache_capacity, "cache_capacity"));
    capacity = a.cache_capacity;
  }
  if (capacity > kMaxSeqlen) return fail(paged ? "max_pages" : "cache_capacity", "cache holds >= 2^31 keys");

  if (a.device == Device::cuda) {
    const std::pair<const void*, const char*> ptrs[] = {
        {a.q, "q"}, {a.k_cache, "k_cache"}, {a.v_cache, "v_cache"}, {a.cache_seqlens, "cache_seqlens"},
        {a.block_table, "block_table"}, {a.k_new, "k_new"}, {a.v_new, "v_new"}, {a.o, "o"},
        {a.lse, "lse"}, {a.fwd_slots, "fwd_slots"}, {a.tile_mask, "tile_mask"}, {a.workspace, "workspace"}};
    for (const auto& p : ptrs) MALA_TRY(check_cuda_pointer(a.device, p.first, p.second));
    Tiles t = cuda_backend::decode_tiles(a);
    MALA_TRY(check_block(a.device, a.block_q, t.block_q, "block_q"));
    MALA_TRY(check_block(a.device, a.block_k, t.block_k, "block_k"));
    if (a.workspace && a.workspace_bytes < cuda_backend::decode_workspace_size(a))
      return fail("workspace_bytes", "must be >= decode_workspace_size() = " +
                                         str(cuda_backend::decode_workspace_size(a)) + " (got " +
                                         str(a.workspace_bytes) + ")");
  } else {
    MALA_TRY(check_block(a.device, a.block_q, 0, "block_q"));
    MALA_TRY(check_block(a.device, a.block_k, 0, "block_k"));
  }

  const size_t es = dtype_size(a.dtype);
  MALA_TRY(check_strides("q_strides", a.q_strides, a.batch, a.seqlen_q, a.heads_q, a.head_dim, es));
  MALA_TRY(check_strides("o_strides", a.o_strides, a.batch, a.seqlen_q, a.heads_q, a.head_dim, es));
  const int64_t cache_batch = paged ? a.num_pages : a.batch;
  const int64_t cache_rows = paged ? a.page_size : a.cache_capacity;
  MALA_TRY(check_strides("k_cache_strides", a.k_cache_strides, cache_batch, cache_rows, a.heads_kv, a.head_dim, es));
  MALA_TRY(check_strides("v_cache_strides", a.v_cache_strides, cache_batch, cache_rows, a.heads_kv, a.head_dim, es));
  if (a.k_new) {
    int64_t n = std::max<int64_t>(a.seqlen_new, 1);
    MALA_TRY(check_strides("k_new_strides", a.k_new_strides, a.batch, n, a.heads_kv, a.head_dim, es));
    MALA_TRY(check_strides("v_new_strides", a.v_new_strides, a.batch, n, a.heads_kv, a.head_dim, es));
  }

  if (a.device == Device::cpu) {
    const int64_t bt_stride = a.block_table_stride ? a.block_table_stride : a.max_pages;
    for (int64_t b = 0; b < a.batch; ++b) {
      int64_t len = a.cache_seqlens[b];
      if (len < 0) return fail("cache_seqlens", "entry " + str(b) + " is negative (" + str(len) + ")");
      if (len + a.seqlen_new > capacity)
        return fail("cache_seqlens", "entry " + str(b) + " = " + str(len) + " plus seqlen_new = " +
                                         str(a.seqlen_new) + " exceeds the cache capacity " + str(capacity));
      if (paged) {
        int64_t pages = (len + a.seqlen_new + a.page_size - 1) / a.page_size;
        for (int64_t p = 0; p < pages; ++p) {
          int32_t page = a.block_table[b * bt_stride + p];
          if (page < 0 || page >= a.num_pages)
            return fail("block_table", "entry [" + str(b) + ", " + str(p) + "] = " + str(page) +
                                           " is outside [0, num_pages = " + str(a.num_pages) + ")");
        }
      }
    }
  }
  return Status::success();
}

}  // namespace internal

Status check(const ForwardArgs& a) {
  MALA_TRY(internal::check_arguments(a));
  return internal::check_overlap(a);
}
Status check(const BackwardArgs& a) {
  MALA_TRY(internal::check_arguments(a));
  return internal::check_overlap(a);
}
Status check(const DecodeArgs& a) {
  MALA_TRY(internal::check_arguments(a));
  return internal::check_overlap(a);
}

}  // namespace mala
