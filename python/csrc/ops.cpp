// The PyTorch custom operators of the `mala` package (TORCH_LIBRARY(mala)).
//
// Each operator checks its tensors (errors name the Python argument), allocates the outputs, and
// calls mala::forward / mala::backward / mala::decode on the tensors' device:
//   CUDA tensors (float16, bfloat16) -> Device::cuda on PyTorch's current CUDA stream,
//   CPU tensors (float32, float16, bfloat16) -> Device::cpu, the exact CPU implementation.
// Workspaces come from PyTorch's allocator, so the operators can be captured in CUDA graphs.
// Autograd and the fake (meta) implementations used by torch.compile live in python/mala/_ops.py.
//
// Schemas (softmax_scale 0 = 1/sqrt(head_dim); return_stats adds per-row slots and tile masks,
// otherwise those outputs are empty):
//   fwd(q, k, v, tau, causal, softmax_scale, return_stats, deterministic, record_for_backward)
//       -> (out, lse, fwd_slots, tile_mask)
//       record_for_backward (autograd, when gradients are needed): tile_mask is also recorded where
//       the backward reads it (forward_mask_tiles), and handed to bwd's fwd_tile_mask
//   bwd(dout, q, k, v, out, lse, tau, causal, softmax_scale, return_stats, deterministic, fwd_tile_mask?)
//       -> (dq, dk, dv, bwd_slots, tile_mask)
//       fwd_tile_mask: the forward's tile_mask of these tensors; the backward skips, without scoring
//       them, the tiles the forward skipped (mala::BackwardArgs::forward_tile_mask)
//   fwd_split(q, k, v, seed_lse?, rows_before, owns_tile0, owns_newest, tau, causal, softmax_scale,
//             block_q, block_k, return_stats) -> (out, lse, fwd_slots, tile_mask)
//   bwd_split(dout, q, k, v, out, lse, rows_before, tau, causal, softmax_scale, block_q, block_k,
//             return_stats, deterministic) -> (dq, dk, dv, bwd_slots, tile_mask)
//       the call as one split of a longer causal sequence (context parallelism; mala.h,
//       ForwardArgs::rows_before and after); block_q/block_k 0 = the implementation's tiles
//   fwd_varlen / bwd_varlen: the same with cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
//   kvcache(q, k_cache!, v_cache!, cache_seqlens, k?, v?, block_table?, tau, causal, softmax_scale,
//           num_splits, return_stats, split_rule='seeded') -> (out, lse, fwd_slots)
//       split_rule: "seeded" or "per_split" (mala::SplitRule)
//   tile_sizes(kernel, device, dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal,
//              num_splits) -> [block_q, block_k, num_splits]
//   forward_mask_tiles(device, dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, tau,
//                      deterministic) -> [block_q, block_k] of the mask fwd records for the backward, or []
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>

#ifdef MALA_TORCH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "mala/mala.h"

namespace mala_torch {
namespace {

using at::Tensor;

// ---- argument checks (messages start with the Python argument's name) ------------------------

mala::DType storage_type(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return mala::DType::f16;
    case at::kBFloat16: return mala::DType::bf16;
    case at::kFloat:
      TORCH_CHECK_TYPE(!t.is_cuda(), name, ": float32 is not supported on cuda (use float16 or bfloat16)");
      return mala::DType::f32;
    default:
      TORCH_CHECK_TYPE(false, name, ": dtype must be float16 or bfloat16 (float32 also on cpu), got ",
                       t.scalar_type());
  }
  return mala::DType::f32;  // unreachable
}

mala::Device device_of(const Tensor& t, const char* name) {
  if (t.is_cuda()) {
#ifdef MALA_TORCH_CUDA
    return mala::Device::cuda;
#else
    TORCH_CHECK_VALUE(false, name, ": this build of mala has no CUDA support");
#endif
  }
  TORCH_CHECK_VALUE(t.is_cpu(), name, ": must be a cuda or cpu tensor (got ", t.device(), ")");
  return mala::Device::cpu;
}

void* stream_for(const Tensor& t) {
#ifdef MALA_TORCH_CUDA
  if (t.is_cuda()) return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
  (void)t;
  return nullptr;
}

void check_dim(const Tensor& t, int64_t dim, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": must have ", dim, " dimensions ", layout, " (got shape ",
                    t.sizes(), ")");
}

void check_like(const Tensor& t, const Tensor& ref, const char* name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, ": must be on the same device as q (", ref.device(),
                    "), got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, ": must have the dtype of q (",
                   ref.scalar_type(), "), got ", t.scalar_type());
}

void check_last_dim_contiguous(const Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, name,
                    ": the last dimension (head_dim) must be contiguous (stride 1), got strides ",
                    t.strides(), "; call .contiguous() first");
}

// A stride of 0 on a dimension longer than 1 (an expanded tensor) cannot be expressed to the
// library, where 0 means "contiguous": such tensors are copied.
Tensor without_broadcast_strides(const Tensor& t) {
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1 && t.stride(i) == 0) return t.contiguous();
  return t;
}

// Inputs: last dim contiguous (error otherwise), broadcast strides materialized.
Tensor input_tensor(const Tensor& t, const char* name) {
  check_last_dim_contiguous(t, name);
  return without_broadcast_strides(t);
}

// Internal tensors (dout, saved outputs): made acceptable silently.
Tensor internal_tensor(const Tensor& t) {
  if (t.size(-1) > 1 && t.stride(-1) != 1) return t.contiguous();
  return without_broadcast_strides(t);
}

mala::Strides strides_bnhd(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }
// Varlen [total, heads, head_dim]: the batch stride is not used.
mala::Strides strides_thd(const Tensor& t) { return {0, t.stride(0), t.stride(1)}; }

float check_tau(double tau) {
  TORCH_CHECK_VALUE(std::isfinite(tau) && tau >= 0.0, "tau: must be finite and >= 0 (got ", tau, ")");
  return static_cast<float>(tau);
}

float check_scale(double softmax_scale) {
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale) && softmax_scale >= 0.0,
                    "softmax_scale: must be finite and > 0, or None/0 for 1/sqrt(head_dim) (got ",
                    softmax_scale, ")");
  return static_cast<float>(softmax_scale);
}

void check_heads(int64_t heads_q, int64_t heads_kv) {
  TORCH_CHECK_VALUE(heads_kv > 0 && heads_q % heads_kv == 0,
                    "k: number of KV heads (", heads_kv, ") must divide the number of query heads (",
                    heads_q, ")");
}

// max_seqlen_q / max_seqlen_k: checked here, where the caller's name is known (the library would
// name its own seqlen_q).
void check_max_seqlen(int64_t v, const char* name) {
  TORCH_CHECK_VALUE(v > 0 && v <= INT32_MAX, name, ": must be in [1, 2^31) (got ", v, ")");
}

// num_splits before its narrowing to int (2^32 used to become 0, automatic).
void check_num_splits(int64_t v) {
  TORCH_CHECK_VALUE(v >= 0 && v <= mala::kMaxNumSplits, "num_splits: must be in [0, ", mala::kMaxNumSplits,
                    "], 0 meaning automatic (got ", v, ")");
}

void check_cu_seqlens(const Tensor& cu, const Tensor& q, int64_t batch, const char* name) {
  TORCH_CHECK_VALUE(cu.device() == q.device(), name, ": must be on the same device as q (", q.device(),
                    "), got ", cu.device());
  TORCH_CHECK_TYPE(cu.scalar_type() == at::kInt, name, ": dtype must be int32, got ", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 2, name,
                    ": must be a 1-D tensor of batch + 1 >= 2 offsets (got shape ", cu.sizes(), ")");
  if (batch >= 0)
    TORCH_CHECK_VALUE(cu.size(0) == batch + 1, name, ": must have ", batch + 1,
                      " entries like cu_seqlens_q (got ", cu.size(0), ")");
  TORCH_CHECK_VALUE(cu.is_contiguous(), name, ": must be contiguous");
}

mala::SplitRule check_split_rule(c10::string_view split_rule) {
  if (split_rule == "per_split") return mala::SplitRule::per_split;
  TORCH_CHECK_VALUE(split_rule == "seeded", "split_rule: must be 'per_split' or 'seeded' (got '",
                    std::string(split_rule), "')");
  return mala::SplitRule::seeded;
}

void check_status(const mala::Status& st, const char* op) {
  TORCH_CHECK(st.ok, "mala.", op, ": ", st.message);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Tensor workspace(size_t bytes, const Tensor& like) {
  if (bytes == 0) return Tensor();
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

// The ops' outputs, allocated with the decode call's latency in mind (the host time of a decode step
// adds to the step, whose batch-1 kernels are short): an output on CUDA comes straight from
// at::detail::empty_cuda, where at::empty ends, without going through the dispatcher again (the
// op already runs at its backend's key).
Tensor new_empty(at::IntArrayRef shape, at::ScalarType type, const Tensor& like) {
#ifdef MALA_TORCH_CUDA
  if (like.is_cuda()) return at::detail::empty_cuda(shape, type, like.device(), std::nullopt);
#endif
  return at::empty(shape, like.options().dtype(type));
}

// An optional output: zeros of `shape` (counters the kernels add into) when wanted, else an empty
// tensor.
Tensor empty_or(bool wanted, at::IntArrayRef shape, const Tensor& like, at::ScalarType type) {
  if (!wanted) return new_empty({0}, type, like);
  return at::zeros(shape, like.options().dtype(type));
}

// Scratch for the call alone: a block of PyTorch's allocator, no tensor around it.  On CUDA the
// caching allocator serves it on the current device and stream (the op's device guard and launch
// stream) and, under graph capture, from the graph's pool; it goes back when the DataPtr is
// destroyed, after the launches, as a temporary tensor's storage would.
c10::DataPtr scratch(size_t bytes, const Tensor& like) {
  if (bytes == 0) return c10::DataPtr(nullptr, like.device());
#ifdef MALA_TORCH_CUDA
  if (like.is_cuda()) return c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
#endif
  return c10::GetAllocator(like.device().type())->allocate(bytes);
}

// ---- the forward's tile mask for the backward ---------------------------------------------

// The arguments a forward and its backward share (shapes, layout of varlen calls, the rule).
template <typename Dst, typename Src>
void copy_shared_args(Dst& d, const Src& s) {
  d.device = s.device;
  d.dtype = s.dtype;
  d.batch = s.batch;
  d.seqlen_q = s.seqlen_q;
  d.seqlen_k = s.seqlen_k;
  d.heads_q = s.heads_q;
  d.heads_kv = s.heads_kv;
  d.head_dim = s.head_dim;
  d.causal = s.causal;
  d.tau = s.tau;
  d.softmax_scale = s.softmax_scale;
  d.cu_seqlens_q = s.cu_seqlens_q;
  d.cu_seqlens_k = s.cu_seqlens_k;
  d.total_q = s.total_q;
  d.total_k = s.total_k;
}

// The backward of a forward with arguments f (and the backward's `deterministic`) reads the
// forward's tile mask where mala::backward_reads_forward_tile_mask says so; then the mask has the
// forward's tiles, else {0, 0}.  (Autograd asks the forward to record the mask only there.)
mala::Tiles forward_mask_tiles_for(const mala::ForwardArgs& f, bool deterministic, int64_t total_q) {
  mala::BackwardArgs b;
  copy_shared_args(b, f);
  b.deterministic = deterministic;
  b.total_q = total_q;
  if (!mala::backward_reads_forward_tile_mask(b)) return {0, 0};
  return mala::forward_tiles(f);
}

// ---- forward --------------------------------------------------------------------------------

struct Varlen {
  const Tensor* cu_q = nullptr;
  const Tensor* cu_k = nullptr;
  int64_t max_q = 0, max_k = 0;
};

// One split of a longer causal sequence (fwd_split / bwd_split; ForwardArgs::rows_before and after).
struct Split {
  int64_t rows_before = -1;
  const Tensor* seed_lse = nullptr;  // forward only
  bool owns_tile0 = false, owns_newest = false;
  int64_t block_q = 0, block_k = 0;
};

std::tuple<Tensor, Tensor, Tensor, Tensor> forward_impl(const Tensor& q_in, const Tensor& k_in,
                                                        const Tensor& v_in, const Varlen* varlen,
                                                        double tau, bool causal, double softmax_scale,
                                                        bool return_stats, const Split* split = nullptr,
                                                        bool record_for_backward = false,
                                                        bool deterministic = false) {
  const bool is_varlen = varlen != nullptr;
  const char* layout = is_varlen ? "[total, heads, head_dim]" : "[batch, seqlen, heads, head_dim]";
  const int64_t rank = is_varlen ? 3 : 4;
  check_dim(q_in, rank, "q", layout);
  check_dim(k_in, rank, "k", layout);
  check_dim(v_in, rank, "v", layout);
  mala::ForwardArgs a;
  a.device = device_of(q_in, "q");
  a.dtype = storage_type(q_in, "q");
  check_like(k_in, q_in, "k");
  check_like(v_in, q_in, "v");
  TORCH_CHECK_VALUE(k_in.sizes() == v_in.sizes(), "v: must have the shape of k ", k_in.sizes(), " (got ",
                    v_in.sizes(), ")");
  const int64_t d = q_in.size(-1);
  TORCH_CHECK_VALUE(k_in.size(-1) == d, "k: head_dim ", k_in.size(-1), " differs from q's ", d);
  const int64_t hq = q_in.size(-2), hkv = k_in.size(-2);
  check_heads(hq, hkv);
  a.tau = check_tau(tau);
  a.softmax_scale = check_scale(softmax_scale);
  Tensor q = input_tensor(q_in, "q"), k = input_tensor(k_in, "k"), v = input_tensor(v_in, "v");

  c10::OptionalDeviceGuard guard(q.device());
  a.heads_q = hq;
  a.heads_kv = hkv;
  a.head_dim = d;
  a.causal = causal;
  a.stream = stream_for(q);
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  Tensor out = at::empty(q.sizes(), q.options());
  a.o = out.data_ptr();
  Tensor lse;
  if (is_varlen) {
    const Tensor& cu_q = *varlen->cu_q;
    const Tensor& cu_k = *varlen->cu_k;
    check_cu_seqlens(cu_q, q, -1, "cu_seqlens_q");
    check_cu_seqlens(cu_k, q, cu_q.size(0) - 1, "cu_seqlens_k");
    check_max_seqlen(varlen->max_q, "max_seqlen_q");
    check_max_seqlen(varlen->max_k, "max_seqlen_k");
    a.batch = cu_q.size(0) - 1;
    a.seqlen_q = varlen->max_q;
    a.seqlen_k = varlen->max_k;
    a.cu_seqlens_q = cu_q.data_ptr<int32_t>();
    a.cu_seqlens_k = cu_k.data_ptr<int32_t>();
    a.total_q = q.size(0);  // bounds cu_seqlens_q (checked where the offsets are readable: the CPU)
    a.total_k = k.size(0);  // lets the Hopper forward load K and V by TMA
    a.q_strides = strides_thd(q);
    a.k_strides = strides_thd(k);
    a.v_strides = strides_thd(v);
    a.o_strides = strides_thd(out);
    lse = at::empty({hq, q.size(0)}, q.options().dtype(at::kFloat));
  } else {
    TORCH_CHECK_VALUE(k.size(0) == q.size(0), "k: batch ", k.size(0), " differs from q's ", q.size(0));
    a.batch = q.size(0);
    a.seqlen_q = q.size(1);
    a.seqlen_k = k.size(1);
    a.q_strides = strides_bnhd(q);
    a.k_strides = strides_bnhd(k);
    a.v_strides = strides_bnhd(v);
    a.o_strides = strides_bnhd(out);
    lse = at::empty({a.batch, hq, a.seqlen_q}, q.options().dtype(at::kFloat));
  }
  a.lse = lse.data_ptr<float>();
  Tensor seed;
  if (split) {
    a.rows_before = split->rows_before;
    a.owns_tile0 = split->owns_tile0;
    a.owns_newest = split->owns_newest;
    a.block_q = static_cast<int>(split->block_q);
    a.block_k = static_cast<int>(split->block_k);
    if (split->seed_lse) {
      const Tensor& sl = *split->seed_lse;
      TORCH_CHECK_TYPE(sl.scalar_type() == at::kFloat, "seed_lse: dtype must be float32 (got ", sl.scalar_type(), ")");
      TORCH_CHECK_VALUE(sl.device() == q.device(), "seed_lse: must be on the device of q (", q.device(), "), got ",
                        sl.device());
      TORCH_CHECK_VALUE(sl.sizes() == lse.sizes(), "seed_lse: must have shape [batch, heads_q, seqlen_q] = ",
                        lse.sizes(), " (got ", sl.sizes(), ")");
      seed = sl.contiguous();
      a.seed_lse = seed.data_ptr<float>();
    }
  }

  Tensor slots = empty_or(return_stats, lse.sizes(), q, at::kInt);
  Tensor tile_mask = at::empty({0}, q.options().dtype(at::kByte));
  // The mask is recorded for the stats, and for a backward that reads it (record_for_backward: the
  // autograd forward of a call that needs gradients); t.block_q = 0: not recorded.
  mala::Tiles t{0, 0};
  if (return_stats)
    t = mala::forward_tiles(a);
  else if (record_for_backward && !split)
    t = forward_mask_tiles_for(a, deterministic, is_varlen ? q.size(0) : 0);
  if (t.block_q > 0) {
    tile_mask = at::zeros({a.batch, hq, ceil_div(a.seqlen_q, t.block_q), ceil_div(a.seqlen_k, t.block_k)},
                          q.options().dtype(at::kByte));
    a.tile_mask = tile_mask.data_ptr<uint8_t>();
  }
  if (return_stats) a.fwd_slots = slots.data_ptr<int32_t>();
  // Empty sequences: nothing to compute (the library asks for positive lengths).
  if (q.numel() == 0 || k.numel() == 0) {
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse, slots, tile_mask};
  }
  check_status(mala::forward(a), is_varlen ? "fwd_varlen" : split ? "fwd_split" : "fwd");
  return {out, lse, slots, tile_mask};
}

// One split of a longer causal sequence (context parallelism, python/mala/distributed.py).  No
// autograd: the caller pairs it with bwd_split.
std::tuple<Tensor, Tensor, Tensor, Tensor> fwd_split(const Tensor& q, const Tensor& k, const Tensor& v,
                                                     const std::optional<Tensor>& seed_lse, int64_t rows_before,
                                                     bool owns_tile0, bool owns_newest, double tau, bool causal,
                                                     double softmax_scale, int64_t block_q, int64_t block_k,
                                                     bool return_stats) {
  Split sp;
  sp.rows_before = rows_before;
  sp.seed_lse = seed_lse.has_value() ? &*seed_lse : nullptr;
  sp.owns_tile0 = owns_tile0;
  sp.owns_newest = owns_newest;
  sp.block_q = block_q;
  sp.block_k = block_k;
  return forward_impl(q, k, v, nullptr, tau, causal, softmax_scale, return_stats, &sp);
}

// `deterministic` is the backward's (autograd saves it with the forward's inputs, as flash_attn);
// record_for_backward: the call needs gradients, so record the tile mask where the backward reads
// it (returned as tile_mask; autograd hands it to bwd's fwd_tile_mask).
std::tuple<Tensor, Tensor, Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, double tau,
                                               bool causal, double softmax_scale, bool return_stats,
                                               bool deterministic, bool record_for_backward) {
  return forward_impl(q, k, v, nullptr, tau, causal, softmax_scale, return_stats, nullptr, record_for_backward,
                      deterministic);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fwd_varlen(const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                                      int64_t max_seqlen_q, int64_t max_seqlen_k, double tau,
                                                      bool causal, double softmax_scale, bool return_stats,
                                                      bool deterministic, bool record_for_backward) {
  Varlen vl{&cu_seqlens_q, &cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  return forward_impl(q, k, v, &vl, tau, causal, softmax_scale, return_stats, nullptr, record_for_backward,
                      deterministic);
}

// ---- backward -------------------------------------------------------------------------------

// Checks the forward's tile mask m (fwd's tile_mask output for these same tensors) and, where the
// backward reads one, points a at it; returns the tensor to keep alive.
Tensor attach_forward_mask(mala::BackwardArgs& a, const Tensor& m, const Tensor& q) {
  mala::ForwardArgs f;
  copy_shared_args(f, a);
  f.q = a.q;
  f.k = a.k;
  f.v = a.v;
  f.q_strides = a.q_strides;
  f.k_strides = a.k_strides;
  f.v_strides = a.v_strides;
  const mala::Tiles t = mala::forward_tiles(f);
  TORCH_CHECK_TYPE(m.scalar_type() == at::kByte, "fwd_tile_mask: dtype must be uint8 (got ", m.scalar_type(), ")");
  TORCH_CHECK_VALUE(m.device() == q.device(), "fwd_tile_mask: must be on the device of q (", q.device(), "), got ",
                    m.device());
  const std::vector<int64_t> shape{a.batch, a.heads_q, ceil_div(a.seqlen_q, t.block_q), ceil_div(a.seqlen_k, t.block_k)};
  TORCH_CHECK_VALUE(m.sizes() == at::IntArrayRef(shape), "fwd_tile_mask: must be the forward's tile mask of shape ",
                    at::IntArrayRef(shape), " (got ", m.sizes(), ")");
  if (!mala::backward_reads_forward_tile_mask(a)) return Tensor();
  Tensor mc = m.contiguous();
  a.forward_tile_mask = mc.data_ptr<uint8_t>();
  a.forward_block_q = t.block_q;
  a.forward_block_k = t.block_k;
  return mc;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> backward_impl(
    const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& out_in,
    const Tensor& lse, const Varlen* varlen, double tau, bool causal, double softmax_scale, bool return_stats,
    bool deterministic, const Split* split = nullptr, const std::optional<Tensor>& fwd_tile_mask = std::nullopt) {
  const bool is_varlen = varlen != nullptr;
  const char* layout = is_varlen ? "[total, heads, head_dim]" : "[batch, seqlen, heads, head_dim]";
  const int64_t rank = is_varlen ? 3 : 4;
  check_dim(q_in, rank, "q", layout);
  check_dim(k_in, rank, "k", layout);
  check_dim(v_in, rank, "v", layout);
  const mala::Device device = device_of(q_in, "q");
  const mala::DType dtype = storage_type(q_in, "q");
  check_like(k_in, q_in, "k");
  check_like(v_in, q_in, "v");
  check_like(out_in, q_in, "out");
  check_like(dout_in, q_in, "dout");
  TORCH_CHECK_VALUE(out_in.sizes() == q_in.sizes(), "out: must have the shape of q");
  TORCH_CHECK_VALUE(dout_in.sizes() == q_in.sizes(), "dout: must have the shape of q");
  TORCH_CHECK_VALUE(k_in.sizes() == v_in.sizes(), "v: must have the shape of k");
  TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "lse: dtype must be float32");
  TORCH_CHECK_VALUE(lse.device() == q_in.device(), "lse: must be on the device of q");
  mala::BackwardArgs a;
  a.device = device;
  a.dtype = dtype;
  const int64_t d = q_in.size(-1), hq = q_in.size(-2), hkv = k_in.size(-2);
  TORCH_CHECK_VALUE(k_in.size(-1) == d, "k: head_dim ", k_in.size(-1), " differs from q's ", d);
  check_heads(hq, hkv);
  a.tau = check_tau(tau);
  a.softmax_scale = check_scale(softmax_scale);
  Tensor q = input_tensor(q_in, "q"), k = input_tensor(k_in, "k"), v = input_tensor(v_in, "v");
  Tensor out = internal_tensor(out_in), dout = internal_tensor(dout_in);
  a.deterministic = deterministic;
  if (split) {
    a.rows_before = split->rows_before;
    a.block_q = static_cast<int>(split->block_q);
    a.block_k = static_cast<int>(split->block_k);
  }
  Tensor lse_c = lse.contiguous();

  c10::OptionalDeviceGuard guard(q.device());
  a.heads_q = hq;
  a.heads_kv = hkv;
  a.head_dim = d;
  a.causal = causal;
  a.stream = stream_for(q);
  Tensor dq = at::empty(q.sizes(), q.options());
  Tensor dk = at::empty(k.sizes(), k.options());
  Tensor dv = at::empty(v.sizes(), v.options());
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.o = out.data_ptr();
  a.dout = dout.data_ptr();
  a.lse = lse_c.data_ptr<float>();
  a.dq = dq.data_ptr();
  a.dk = dk.data_ptr();
  a.dv = dv.data_ptr();
  auto set_strides = [&](mala::Strides (*f)(const Tensor&)) {
    a.q_strides = f(q);
    a.k_strides = f(k);
    a.v_strides = f(v);
    a.o_strides = f(out);
    a.dout_strides = f(dout);
    a.dq_strides = f(dq);
    a.dk_strides = f(dk);
    a.dv_strides = f(dv);
  };
  if (is_varlen) {
    const Tensor& cu_q = *varlen->cu_q;
    const Tensor& cu_k = *varlen->cu_k;
    check_cu_seqlens(cu_q, q, -1, "cu_seqlens_q");
    check_cu_seqlens(cu_k, q, cu_q.size(0) - 1, "cu_seqlens_k");
    check_max_seqlen(varlen->max_q, "max_seqlen_q");
    check_max_seqlen(varlen->max_k, "max_seqlen_k");
    a.batch = cu_q.size(0) - 1;
    a.seqlen_q = varlen->max_q;
    a.seqlen_k = varlen->max_k;
    a.cu_seqlens_q = cu_q.data_ptr<int32_t>();
    a.cu_seqlens_k = cu_k.data_ptr<int32_t>();
    a.total_q = q.size(0);  // let the Hopper backward load by TMA
    a.total_k = k.size(0);
    TORCH_CHECK_VALUE(lse_c.dim() == 2 && lse_c.size(0) == hq && lse_c.size(1) == q.size(0),
                      "lse: must have shape [heads_q, total_q] = [", hq, ", ", q.size(0), "] (got ",
                      lse_c.sizes(), ")");
    set_strides(strides_thd);
  } else {
    TORCH_CHECK_VALUE(k.size(0) == q.size(0), "k: batch ", k.size(0), " differs from q's ", q.size(0));
    a.batch = q.size(0);
    a.seqlen_q = q.size(1);
    a.seqlen_k = k.size(1);
    TORCH_CHECK_VALUE(lse_c.dim() == 3 && lse_c.size(0) == a.batch && lse_c.size(1) == hq &&
                          lse_c.size(2) == a.seqlen_q,
                      "lse: must have shape [batch, heads_q, seqlen_q] (got ", lse_c.sizes(), ")");
    set_strides(strides_bnhd);
  }
  Tensor fwd_mask;
  if (fwd_tile_mask.has_value() && fwd_tile_mask->numel() > 0) fwd_mask = attach_forward_mask(a, *fwd_tile_mask, q);
  Tensor slots = empty_or(return_stats, lse_c.sizes(), q, at::kInt);
  Tensor tile_mask = at::empty({0}, q.options().dtype(at::kByte));
  if (return_stats) {
    mala::Tiles t = mala::backward_tiles(a);
    tile_mask = at::zeros({a.batch, hq, ceil_div(a.seqlen_q, t.block_q), ceil_div(a.seqlen_k, t.block_k)},
                          q.options().dtype(at::kByte));
    a.bwd_slots = slots.data_ptr<int32_t>();
    a.tile_mask = tile_mask.data_ptr<uint8_t>();
  }
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, slots, tile_mask};
  }
  Tensor ws = workspace(mala::backward_workspace_size(a), q);
  if (ws.defined()) {
    a.workspace = ws.data_ptr();
    a.workspace_bytes = static_cast<size_t>(ws.numel());
  }
  check_status(mala::backward(a), is_varlen ? "bwd_varlen" : split ? "bwd_split" : "bwd");
  return {dq, dk, dv, slots, tile_mask};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                       const Tensor& v, const Tensor& out, const Tensor& lse,
                                                       double tau, bool causal, double softmax_scale,
                                                       bool return_stats, bool deterministic,
                                                       const std::optional<Tensor>& fwd_tile_mask) {
  return backward_impl(dout, q, k, v, out, lse, nullptr, tau, causal, softmax_scale, return_stats, deterministic,
                       nullptr, fwd_tile_mask);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_split(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                             const Tensor& v, const Tensor& out, const Tensor& lse,
                                                             int64_t rows_before, double tau, bool causal,
                                                             double softmax_scale, int64_t block_q, int64_t block_k,
                                                             bool return_stats, bool deterministic) {
  Split sp;
  sp.rows_before = rows_before;
  sp.block_q = block_q;
  sp.block_k = block_k;
  return backward_impl(dout, q, k, v, out, lse, nullptr, tau, causal, softmax_scale, return_stats, deterministic, &sp);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_varlen(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double tau,
    bool causal, double softmax_scale, bool return_stats, bool deterministic,
    const std::optional<Tensor>& fwd_tile_mask) {
  Varlen vl{&cu_seqlens_q, &cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  return backward_impl(dout, q, k, v, out, lse, &vl, tau, causal, softmax_scale, return_stats, deterministic,
                       nullptr, fwd_tile_mask);
}

// ---- decode against a KV cache ------------------------------------------------------------

// The decode call behind both entry points: the operator (every output) and kvcache_direct (the eager
// fast path: no lse unless asked for, no stats).  Undefined outputs are those not wanted.
std::tuple<Tensor, Tensor, Tensor> kvcache_core(const Tensor& q_in, const Tensor& k_cache, const Tensor& v_cache,
                                                const Tensor& cache_seqlens, const std::optional<Tensor>& k_new_in,
                                                const std::optional<Tensor>& v_new_in,
                                                const std::optional<Tensor>& block_table, double tau, bool causal,
                                                double softmax_scale, int64_t num_splits, bool want_lse,
                                                bool return_stats, c10::string_view split_rule) {
  check_dim(q_in, 4, "q", "[batch, seqlen, heads, head_dim]");
  const bool paged = block_table.has_value();
  check_dim(k_cache, 4, "k_cache",
            paged ? "[num_blocks, page_size, heads_kv, head_dim]" : "[batch, capacity, heads_kv, head_dim]");
  mala::DecodeArgs a;
  a.device = device_of(q_in, "q");
  a.dtype = storage_type(q_in, "q");
  check_like(k_cache, q_in, "k_cache");
  check_like(v_cache, q_in, "v_cache");
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache: must have the shape of k_cache ",
                    k_cache.sizes(), " (got ", v_cache.sizes(), ")");
  const int64_t batch = q_in.size(0), d = q_in.size(3), hq = q_in.size(2), hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == d, "k_cache: head_dim ", k_cache.size(3), " differs from q's ", d);
  check_heads(hq, hkv);
  a.tau = check_tau(tau);
  a.softmax_scale = check_scale(softmax_scale);
  check_num_splits(num_splits);
  a.split_rule = check_split_rule(split_rule);
  TORCH_CHECK_VALUE(cache_seqlens.device() == q_in.device(), "cache_seqlens: must be on the device of q (",
                    q_in.device(), "), got ", cache_seqlens.device());
  TORCH_CHECK_TYPE(cache_seqlens.scalar_type() == at::kInt, "cache_seqlens: dtype must be int32, got ",
                   cache_seqlens.scalar_type());
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == batch,
                    "cache_seqlens: must have shape [batch] = [", batch, "] (got ", cache_seqlens.sizes(), ")");
  TORCH_CHECK_VALUE(cache_seqlens.is_contiguous(), "cache_seqlens: must be contiguous");
  check_last_dim_contiguous(k_cache, "k_cache");
  check_last_dim_contiguous(v_cache, "v_cache");
  for (int64_t i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(k_cache.size(i) <= 1 || k_cache.stride(i) != 0, "k_cache: must not be an expanded view");
    TORCH_CHECK_VALUE(v_cache.size(i) <= 1 || v_cache.stride(i) != 0, "v_cache: must not be an expanded view");
  }
  TORCH_CHECK_VALUE(k_new_in.has_value() == v_new_in.has_value(),
                    k_new_in.has_value() ? "v" : "k", ": k and v must be given together");
  Tensor q = input_tensor(q_in, "q");
  Tensor k_new, v_new;
  if (k_new_in.has_value()) {
    check_dim(*k_new_in, 4, "k", "[batch, seqlen_new, heads_kv, head_dim]");
    check_like(*k_new_in, q_in, "k");
    check_like(*v_new_in, q_in, "v");
    TORCH_CHECK_VALUE(v_new_in->sizes() == k_new_in->sizes(), "v: must have the shape of k ", k_new_in->sizes(),
                      " (got ", v_new_in->sizes(), ")");
    TORCH_CHECK_VALUE(k_new_in->size(0) == batch && k_new_in->size(2) == hkv && k_new_in->size(3) == d,
                      "k: must have shape [batch, seqlen_new, heads_kv, head_dim] = [", batch, ", *, ", hkv, ", ",
                      d, "] (got ", k_new_in->sizes(), ")");
    k_new = input_tensor(*k_new_in, "k");
    v_new = input_tensor(*v_new_in, "v");
  }

  c10::OptionalDeviceGuard guard(q.device());
  a.batch = batch;
  a.seqlen_q = q.size(1);
  a.heads_q = hq;
  a.heads_kv = hkv;
  a.head_dim = d;
  a.causal = causal;
  a.num_splits = static_cast<int>(num_splits);
  a.stream = stream_for(q);
  a.q = q.data_ptr();
  a.q_strides = strides_bnhd(q);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.k_cache_strides = strides_bnhd(k_cache);
  a.v_cache_strides = strides_bnhd(v_cache);
  a.cache_seqlens = cache_seqlens.data_ptr<int32_t>();
  if (paged) {
    const Tensor& bt = *block_table;
    TORCH_CHECK_VALUE(bt.device() == q.device(), "block_table: must be on the device of q");
    TORCH_CHECK_TYPE(bt.scalar_type() == at::kInt, "block_table: dtype must be int32, got ", bt.scalar_type());
    TORCH_CHECK_VALUE(bt.dim() == 2 && bt.size(0) == batch, "block_table: must have shape [batch, max_pages] (got ",
                      bt.sizes(), ")");
    TORCH_CHECK_VALUE(bt.stride(1) == 1, "block_table: rows must be contiguous");
    a.block_table = bt.data_ptr<int32_t>();
    a.max_pages = bt.size(1);
    a.block_table_stride = bt.stride(0);
    a.page_size = k_cache.size(1);
    a.num_pages = k_cache.size(0);
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) == batch, "k_cache: batch ", k_cache.size(0), " differs from q's ", batch);
    a.cache_capacity = k_cache.size(1);
  }
  if (k_new.defined()) {
    a.k_new = k_new.data_ptr();
    a.v_new = v_new.data_ptr();
    a.seqlen_new = k_new.size(1);
    a.k_new_strides = strides_bnhd(k_new);
    a.v_new_strides = strides_bnhd(v_new);
  }
  Tensor out = new_empty(q.sizes(), q.scalar_type(), q);
  a.o = out.data_ptr();
  a.o_strides = strides_bnhd(out);
  Tensor lse, slots;
  if (want_lse) {
    lse = new_empty({batch, hq, a.seqlen_q}, at::kFloat, q);
    a.lse = lse.data_ptr<float>();
  }
  if (return_stats) {
    slots = empty_or(true, {batch, hq, a.seqlen_q}, q, at::kInt);
    a.fwd_slots = slots.data_ptr<int32_t>();
  }
  if (q.numel() == 0) return {out, lse, slots};
  const size_t ws_bytes = mala::decode_workspace_size(a);
  c10::DataPtr ws = scratch(ws_bytes, q);
  if (ws_bytes > 0) {
    a.workspace = ws.get();
    a.workspace_bytes = ws_bytes;
  }
  check_status(mala::decode(a), "kvcache");
  return {out, lse, slots};
}

std::tuple<Tensor, Tensor, Tensor> kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                           const Tensor& cache_seqlens, const std::optional<Tensor>& k_new,
                                           const std::optional<Tensor>& v_new,
                                           const std::optional<Tensor>& block_table, double tau, bool causal,
                                           double softmax_scale, int64_t num_splits, bool return_stats,
                                           c10::string_view split_rule) {
  auto r = kvcache_core(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, tau, causal, softmax_scale,
                        num_splits, /*want_lse=*/true, return_stats, split_rule);
  if (!return_stats) std::get<2>(r) = empty_or(false, {0}, q, at::kInt);
  return r;
}

// ---- tile sizes (no tensors: answered from shapes alone) ------------------------------------

// The arguments of a call of these shapes, as far as the tile queries read them.
template <typename Args>
void fill_shape(Args& a, c10::Device device, c10::ScalarType dtype, int64_t batch, int64_t seqlen_q,
                int64_t heads_q, int64_t heads_kv, int64_t head_dim, bool causal) {
  a.device = device.is_cuda() ? mala::Device::cuda : mala::Device::cpu;
  a.dtype = dtype == at::kHalf ? mala::DType::f16 : dtype == at::kBFloat16 ? mala::DType::bf16 : mala::DType::f32;
  a.batch = batch;
  a.seqlen_q = seqlen_q;
  a.heads_q = heads_q;
  a.heads_kv = heads_kv;
  a.head_dim = head_dim;
  a.causal = causal;
}

std::vector<int64_t> tile_sizes(c10::string_view kernel, c10::Device device, c10::ScalarType dtype, int64_t batch,
                                int64_t seqlen_q, int64_t seqlen_k, int64_t heads_q, int64_t heads_kv,
                                int64_t head_dim, bool causal, int64_t num_splits) {
  auto fill = [&](auto& a) { fill_shape(a, device, dtype, batch, seqlen_q, heads_q, heads_kv, head_dim, causal); };
  if (kernel == "forward") {
    mala::ForwardArgs a;
    fill(a);
    a.seqlen_k = seqlen_k;
    mala::Tiles t = mala::forward_tiles(a);
    return {t.block_q, t.block_k, 1};
  }
  if (kernel == "backward") {
    mala::BackwardArgs a;
    fill(a);
    a.seqlen_k = seqlen_k;
    mala::Tiles t = mala::backward_tiles(a);
    return {t.block_q, t.block_k, 1};
  }
  TORCH_CHECK_VALUE(kernel == "decode", "kernel: must be 'forward', 'backward' or 'decode' (got '",
                    std::string(kernel), "')");
  mala::DecodeArgs a;
  fill(a);
  a.cache_capacity = seqlen_k;
  check_num_splits(num_splits);
  a.num_splits = static_cast<int>(num_splits);
  mala::Tiles t = mala::decode_tiles(a);
  return {t.block_q, t.block_k, mala::decode_num_splits(a)};
}

// The forward tiles of the mask autograd's forward records for the backward of these shapes (fwd's
// record_for_backward), or [] where the backward reads none: the fake implementations' answer.
std::vector<int64_t> forward_mask_tiles(c10::Device device, c10::ScalarType dtype, int64_t batch, int64_t seqlen_q,
                                        int64_t seqlen_k, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
                                        bool causal, double tau, bool deterministic) {
  mala::ForwardArgs f;
  fill_shape(f, device, dtype, batch, seqlen_q, heads_q, heads_kv, head_dim, causal);
  f.seqlen_k = seqlen_k;
  f.tau = static_cast<float>(tau);
  const mala::Tiles t = forward_mask_tiles_for(f, deterministic, 0);
  if (t.block_q == 0) return {};
  return {t.block_q, t.block_k};
}

// ---- the eager decode call without the dispatcher ------------------------------------------

// A tensor the direct path may take: exactly torch.Tensor (no subclass, so no __torch_function__),
// strided, and none of the dispatch keys through which PyTorch reroutes an operator (Python
// subclasses and FakeTensor, functorch's vmap and grad wrappers, functionalization).
bool plain_tensor(PyObject* obj, const Tensor** out) {
  if (!THPVariable_CheckExact(obj)) return false;
  const Tensor& t = THPVariable_Unpack(obj);
  constexpr c10::DispatchKeySet rerouted({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                          c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                          c10::DispatchKey::Functionalize, c10::DispatchKey::BatchedNestedTensor});
  if (!t.defined() || t.layout() != at::kStrided || t.key_set().has_any(rerouted)) return false;
  *out = &t;
  return true;
}

// mala._C.kvcache_direct(q, k_cache, v_cache, cache_seqlens, k, v, block_table, tau, causal,
//                        softmax_scale, num_splits, split_rule, return_lse)
//     -> out, or (out, lse) with return_lse; NotImplemented where the operator must run instead.
// mala.attention_with_kvcache's eager call.  A decode step's host time adds to its latency, and
// torch.ops' argument parsing and dispatch are a large part of a decode call's host time
// (python/benchmarks/decode_host_overhead.py measures it); this entry point parses 13 positional arguments and runs the operator's
// own checks and launches (kvcache_core), without allocating the lse and stats outputs nobody asked
// for.  It declines (NotImplemented) whatever the dispatcher would treat differently: a tensor that
// is not a plain torch.Tensor (plain_tensor), an active TorchDispatchMode or torch function mode.
// The caller routes torch.compile's tracing to the operator itself.
PyObject* kvcache_direct(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 13) {
    PyErr_Format(PyExc_TypeError, "kvcache_direct: takes 13 positional arguments (%zd given)", nargs);
    return nullptr;
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled())
    Py_RETURN_NOTIMPLEMENTED;
  const Tensor *q, *k_cache, *v_cache, *lens;
  if (!plain_tensor(args[0], &q) || !plain_tensor(args[1], &k_cache) || !plain_tensor(args[2], &v_cache) ||
      !plain_tensor(args[3], &lens))
    Py_RETURN_NOTIMPLEMENTED;
  std::optional<Tensor> opt[3];
  for (int i = 0; i < 3; ++i) {
    if (args[4 + i] == Py_None) continue;
    const Tensor* t;
    if (!plain_tensor(args[4 + i], &t)) Py_RETURN_NOTIMPLEMENTED;
    opt[i] = *t;
  }
  const double tau = PyFloat_AsDouble(args[7]);
  const int causal = PyObject_IsTrue(args[8]);
  const double scale = PyFloat_AsDouble(args[9]);
  const long long num_splits = PyLong_AsLongLong(args[10]);
  Py_ssize_t rule_len = 0;
  const char* rule = PyUnicode_Check(args[11]) ? PyUnicode_AsUTF8AndSize(args[11], &rule_len) : nullptr;
  const int want_lse = PyObject_IsTrue(args[12]);
  if (PyErr_Occurred()) return nullptr;
  if (rule == nullptr) {
    PyErr_SetString(PyExc_TypeError, "split_rule: must be a str");
    return nullptr;
  }
  auto r = kvcache_core(*q, *k_cache, *v_cache, *lens, opt[0], opt[1], opt[2], tau, causal != 0, scale, num_splits,
                        want_lse != 0, /*return_stats=*/false, c10::string_view(rule, rule_len));
  // The append wrote into the caches in place: bump their versions as the operator's mutation
  // annotations (Tensor(a!)) would, so that autograd notices a saved cache was modified.  Inference
  // tensors have no version counter.
  if (opt[0].has_value()) {
    if (!k_cache->is_inference()) torch::autograd::impl::bump_version(*k_cache);
    if (!v_cache->is_inference()) torch::autograd::impl::bump_version(*v_cache);
  }
  if (!want_lse) return THPVariable_Wrap(std::move(std::get<0>(r)));
  PyObject* out = THPVariable_Wrap(std::move(std::get<0>(r)));
  if (out == nullptr) return nullptr;
  PyObject* lse = THPVariable_Wrap(std::move(std::get<1>(r)));
  if (lse == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  PyObject* tup = PyTuple_Pack(2, out, lse);  // (its own references: null on failure, error set)
  Py_DECREF(out);
  Py_DECREF(lse);
  return tup;
  END_HANDLE_TH_ERRORS
}

}  // namespace
}  // namespace mala_torch

TORCH_LIBRARY(mala, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, float tau, bool causal, float softmax_scale, bool return_stats,"
        " bool deterministic=False, bool record_for_backward=False)"
        " -> (Tensor out, Tensor lse, Tensor fwd_slots, Tensor tile_mask)");
  m.def("fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q,"
        " int max_seqlen_k, float tau, bool causal, float softmax_scale, bool return_stats,"
        " bool deterministic=False, bool record_for_backward=False)"
        " -> (Tensor out, Tensor lse, Tensor fwd_slots, Tensor tile_mask)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float tau, bool causal,"
        " float softmax_scale, bool return_stats, bool deterministic=False, Tensor? fwd_tile_mask=None)"
        " -> (Tensor dq, Tensor dk, Tensor dv, Tensor bwd_slots, Tensor tile_mask)");
  m.def("bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q,"
        " Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float tau, bool causal, float softmax_scale,"
        " bool return_stats, bool deterministic=False, Tensor? fwd_tile_mask=None)"
        " -> (Tensor dq, Tensor dk, Tensor dv, Tensor bwd_slots, Tensor tile_mask)");
  m.def("fwd_split(Tensor q, Tensor k, Tensor v, Tensor? seed_lse, int rows_before, bool owns_tile0,"
        " bool owns_newest, float tau, bool causal, float softmax_scale, int block_q, int block_k,"
        " bool return_stats) -> (Tensor out, Tensor lse, Tensor fwd_slots, Tensor tile_mask)");
  m.def("bwd_split(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, int rows_before, float tau,"
        " bool causal, float softmax_scale, int block_q, int block_k, bool return_stats, bool deterministic)"
        " -> (Tensor dq, Tensor dk, Tensor dv, Tensor bwd_slots, Tensor tile_mask)");
  m.def("kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k, Tensor? v,"
        " Tensor? block_table, float tau, bool causal, float softmax_scale, int num_splits, bool return_stats,"
        " str split_rule='seeded') -> (Tensor out, Tensor lse, Tensor fwd_slots)");
  m.def("tile_sizes(str kernel, Device device, ScalarType dtype, int batch, int seqlen_q, int seqlen_k,"
        " int heads_q, int heads_kv, int head_dim, bool causal, int num_splits) -> int[]",
        &mala_torch::tile_sizes);
  m.def("forward_mask_tiles(Device device, ScalarType dtype, int batch, int seqlen_q, int seqlen_k, int heads_q,"
        " int heads_kv, int head_dim, bool causal, float tau, bool deterministic) -> int[]",
        &mala_torch::forward_mask_tiles);
}

TORCH_LIBRARY_IMPL(mala, CPU, m) {
  m.impl("fwd", &mala_torch::fwd);
  m.impl("fwd_varlen", &mala_torch::fwd_varlen);
  m.impl("bwd", &mala_torch::bwd);
  m.impl("bwd_varlen", &mala_torch::bwd_varlen);
  m.impl("kvcache", &mala_torch::kvcache);
  m.impl("fwd_split", &mala_torch::fwd_split);
  m.impl("bwd_split", &mala_torch::bwd_split);
}

#ifdef MALA_TORCH_CUDA
TORCH_LIBRARY_IMPL(mala, CUDA, m) {
  m.impl("fwd", &mala_torch::fwd);
  m.impl("fwd_varlen", &mala_torch::fwd_varlen);
  m.impl("bwd", &mala_torch::bwd);
  m.impl("bwd_varlen", &mala_torch::bwd_varlen);
  m.impl("kvcache", &mala_torch::kvcache);
  m.impl("fwd_split", &mala_torch::fwd_split);
  m.impl("bwd_split", &mala_torch::bwd_split);
}
#endif

// `import mala._C` loads this library, which registers the operators above.
static PyMethodDef mala_c_methods[] = {
    {"kvcache_direct", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&mala_torch::kvcache_direct)),
     METH_FASTCALL, "mala.attention_with_kvcache's eager call without the dispatcher (see ops.cpp)"},
    {nullptr, nullptr, 0, nullptr}};
static PyModuleDef mala_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                    "mala's PyTorch operators (torch.ops.mala)", -1, mala_c_methods};
extern "C" PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&mala_c_module); }
