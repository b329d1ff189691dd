// Internal pieces of the CPU implementation: problem geometry (dense or varlen batches), fp32
// staging copies of the strided inputs, and the fp32 dot product every score is computed with.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "common/rule.h"
#include "common/layout.h"
#include "mala/mala.h"

namespace mala {
namespace cpu {
namespace detail {

// s = dot(a, b) in fp32 with eight fixed partial sums (vectorizable, deterministic, independent of
// tiling and threading, so a score recomputed anywhere has the same bits).
inline float dot(const float* a, const float* b, int64_t d) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t c = 0;
  for (; c + 8 <= d; c += 8)
    for (int u = 0; u < 8; ++u) acc[u] += a[c + u] * b[c + u];
  float tail = 0.f;
  for (; c < d; ++c) tail += a[c] * b[c];
  return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

// The score of query row q against key row k: softmax_scale * dot(q, k) in fp32.
inline float score(const float* q, const float* k, int64_t d, float scale) { return scale * dot(q, k, d); }

// Threads only pay off past some work: an OpenMP region costs microseconds, far more when the
// machine is oversubscribed.  `work` is a rough count of multiply-adds or elements touched.
inline bool parallel_worth(int64_t work) { return work >= (int64_t(1) << 20) && omp_get_max_threads() > 1; }

inline float resolve_scale(float softmax_scale, int64_t head_dim) {
  return softmax_scale > 0.f ? softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
}

// Batches of sequences: dense ([batch, seqlen] rows) or varlen (cu_seqlens, packed rows).
struct Geometry {
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  const int32_t* cu_q;
  const int32_t* cu_k;
  bool causal;

  bool varlen() const { return cu_q != nullptr; }
  int64_t group() const { return heads_q / heads_kv; }
  int64_t rows_q() const { return varlen() ? cu_q[batch] : batch * seqlen_q; }
  int64_t rows_k() const { return varlen() ? cu_k[batch] : batch * seqlen_k; }
  layout::Seq seq_q(int64_t b) const { return layout::sequence(cu_q, b, seqlen_q); }
  layout::Seq seq_k(int64_t b) const { return layout::sequence(cu_k, b, seqlen_k); }
  // Index of (b, h, row) in the lse / slot tensors: [batch, heads_q, seqlen_q] or [heads_q, total_q].
  int64_t row_index(int64_t b, int64_t h, int64_t row) const {
    if (varlen()) return h * rows_q() + cu_q[b] + row;
    return (b * heads_q + h) * seqlen_q + row;
  }
};

// A failed allocation of the CPU path's fp32 staging, with its size: the entry points turn it into
// a Status (guard_oom) instead of letting std::bad_alloc escape the API.
struct OutOfMemory : std::bad_alloc {
  size_t bytes;
  explicit OutOfMemory(size_t b) : bytes(b) {}
  const char* what() const noexcept override { return "mala: out of memory"; }
};

// n zeroed floats; the large buffers (whole tensors) are allocated here, outside the OpenMP
// regions, so that a failure is reported with its size.
inline std::vector<float> staging(int64_t n) {
  try {
    return std::vector<float>(static_cast<size_t>(n), 0.f);
  } catch (const std::bad_alloc&) {
    throw OutOfMemory(static_cast<size_t>(n) * sizeof(float));
  }
}

// f() with the allocation failures of the CPU path returned as a Status.
template <class F>
Status guard_oom(F f) {
  try {
    return f();
  } catch (const OutOfMemory& e) {
    return Status::error("out of memory: the CPU implementation could not allocate " + std::to_string(e.bytes) +
                         " bytes (" + std::to_string(e.bytes >> 20) + " MiB) for the fp32 staging of a tensor");
  } catch (const std::bad_alloc&) {
    return Status::error("out of memory: an allocation of the CPU implementation failed");
  }
}

// fp32 copy of a strided [batch, seqlen, heads, d] (or varlen [total, heads, d]) tensor as
// contiguous [rows, heads, d] where rows is the packed/dense row space.
inline std::vector<float> gather(const void* base, DType t, const Strides& s, int64_t batch, int64_t seqlen,
                                 const int32_t* cu, int64_t heads, int64_t d) {
  const layout::Resolved st = layout::resolve(s, seqlen, heads, d);
  const int64_t rows = cu ? cu[batch] : batch * seqlen;
  std::vector<float> out = staging(rows * heads * d);
#pragma omp parallel for schedule(static) if (parallel_worth(rows * heads * d))
  for (int64_t g = 0; g < rows; ++g) {
    // Dense rows: g = b * seqlen + r (batch stride applies); varlen rows are packed.
    const int64_t base_off = cu ? g * st.row : (g / seqlen) * st.batch + (g % seqlen) * st.row;
    for (int64_t h = 0; h < heads; ++h)
      layout::load(base, t, base_off + h * st.head, d, &out[static_cast<size_t>((g * heads + h) * d)]);
  }
  return out;
}

// Inverse of gather: writes contiguous fp32 [rows, heads, d] into the strided output.
inline void scatter(const std::vector<float>& src, void* base, DType t, const Strides& s, int64_t batch,
                    int64_t seqlen, const int32_t* cu, int64_t heads, int64_t d) {
  const layout::Resolved st = layout::resolve(s, seqlen, heads, d);
  const int64_t rows = cu ? cu[batch] : batch * seqlen;
#pragma omp parallel for schedule(static) if (parallel_worth(rows * heads * d))
  for (int64_t g = 0; g < rows; ++g) {
    const int64_t base_off = cu ? g * st.row : (g / seqlen) * st.batch + (g % seqlen) * st.row;
    for (int64_t h = 0; h < heads; ++h)
      layout::store(base, t, base_off + h * st.head, d, &src[static_cast<size_t>((g * heads + h) * d)]);
  }
}

inline int64_t n_tiles(int64_t n, int64_t block) { return (n + block - 1) / block; }

}  // namespace detail
}  // namespace cpu
}  // namespace mala
