// mala::reference: plain dense softmax attention in double precision — no tiles, no online state,
// no skipping.  The yardstick the tiled implementations are compared with.  fp32 in/out only.
#include <cmath>
#include <vector>

#include "common/rule.h"
#include "cpu/common.h"
#include "mala/mala.h"

namespace mala {
namespace reference {

namespace {

Status reference_only(Device device, DType dtype) {
  if (device != Device::cpu) return Status::error("device: the dense reference runs on cpu memory only");
  if (dtype != DType::f32)
    return Status::error(std::string("dtype: the dense reference takes float32 only (got ") + dtype_name(dtype) + ")");
  return Status::success();
}

// Dense softmax of one query row over its L visible keys, in double: p (size L) and the lse.
void softmax_row(const float* q, const float* K, int64_t key_stride, int64_t L, int64_t d, double scale,
                 std::vector<double>& p, double* lse) {
  p.resize(static_cast<size_t>(L));
  double mx = -INFINITY;
  for (int64_t k = 0; k < L; ++k) {
    const float* kr = K + k * key_stride;
    double s = 0;
    for (int64_t x = 0; x < d; ++x) s += static_cast<double>(q[x]) * kr[x];
    p[k] = scale * s;
    mx = rule::nan_max(mx, p[k]);
  }
  double sum = 0;
  for (int64_t k = 0; k < L; ++k) {
    p[k] = std::exp(p[k] - mx);
    sum += p[k];
  }
  for (int64_t k = 0; k < L; ++k) p[k] /= sum;
  *lse = mx + std::log(sum);
}

}  // namespace

Status dense_forward(const ForwardArgs& a) {
  Status s = check(a);
  if (!s) return s;
  s = reference_only(a.device, a.dtype);
  if (!s) return s;
  using cpu::detail::Geometry;
  const Geometry g{a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.head_dim,
                   a.cu_seqlens_q, a.cu_seqlens_k, a.causal};
  const int64_t d = g.head_dim, hq = g.heads_q, hkv = g.heads_kv;
  const double scale = cpu::detail::resolve_scale(a.softmax_scale, d);
  const auto Q = cpu::detail::gather(a.q, a.dtype, a.q_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  const auto K = cpu::detail::gather(a.k, a.dtype, a.k_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  const auto V = cpu::detail::gather(a.v, a.dtype, a.v_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  std::vector<float> O(Q.size(), 0.f);
  const int64_t n_tasks = g.batch * hq;
#pragma omp parallel for schedule(dynamic, 1) if (cpu::detail::parallel_worth(g.rows_q() * hq * g.seqlen_k * d))
  for (int64_t task = 0; task < n_tasks; ++task) {
    const int64_t b = task / hq, h = task % hq, hk = h / g.group();
    const layout::Seq sq = g.seq_q(b), sk = g.seq_k(b);
    std::vector<double> p, o(static_cast<size_t>(d));
    for (int64_t r = 0; r < sq.len; ++r) {
      const int64_t L = rule::visible_keys(static_cast<int>(r), static_cast<int>(sq.len),
                                           static_cast<int>(sk.len), a.causal);
      const int64_t qrow = (sq.row0 + r) * hq + h;
      if (L == 0) {
        if (a.lse) a.lse[g.row_index(b, h, r)] = -INFINITY;
        continue;
      }
      double lse;
      softmax_row(&Q[qrow * d], &K[(sk.row0 * hkv + hk) * d], hkv * d, L, d, scale, p, &lse);
      std::fill(o.begin(), o.end(), 0.0);
      for (int64_t k = 0; k < L; ++k) {
        const float* vr = &V[((sk.row0 + k) * hkv + hk) * d];
        for (int64_t x = 0; x < d; ++x) o[x] += p[k] * vr[x];
      }
      for (int64_t x = 0; x < d; ++x) O[qrow * d + x] = static_cast<float>(o[x]);
      if (a.lse) a.lse[g.row_index(b, h, r)] = static_cast<float>(lse);
    }
  }
  cpu::detail::scatter(O, a.o, a.dtype, a.o_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  return Status::success();
}

// Gradients of dense attention for the scalar loss sum(dout * O), recomputing P and O in double
// from q, k, v (the o and lse arguments are required by check() but not read).
Status dense_backward(const BackwardArgs& a) {
  Status s = check(a);
  if (!s) return s;
  s = reference_only(a.device, a.dtype);
  if (!s) return s;
  using cpu::detail::Geometry;
  const Geometry g{a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.head_dim,
                   a.cu_seqlens_q, a.cu_seqlens_k, a.causal};
  const int64_t d = g.head_dim, hq = g.heads_q, hkv = g.heads_kv, group = g.group();
  const double scale = cpu::detail::resolve_scale(a.softmax_scale, d);
  const auto Q = cpu::detail::gather(a.q, a.dtype, a.q_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  const auto K = cpu::detail::gather(a.k, a.dtype, a.k_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  const auto V = cpu::detail::gather(a.v, a.dtype, a.v_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  const auto dO = cpu::detail::gather(a.dout, a.dtype, a.dout_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  std::vector<float> dQ(Q.size(), 0.f), dK(K.size(), 0.f), dV(V.size(), 0.f);
  const int64_t n_tasks = g.batch * hkv;  // one task owns a KV head: dK/dV sums stay in the task
#pragma omp parallel for schedule(dynamic, 1) if (cpu::detail::parallel_worth(g.rows_q() * hq * g.seqlen_k * d))
  for (int64_t task = 0; task < n_tasks; ++task) {
    const int64_t b = task / hkv, hk = task % hkv;
    const layout::Seq sq = g.seq_q(b), sk = g.seq_k(b);
    std::vector<double> dk(static_cast<size_t>(sk.len * d), 0.0), dv(static_cast<size_t>(sk.len * d), 0.0);
    std::vector<double> p, ds, o(static_cast<size_t>(d)), dq(static_cast<size_t>(d));
    for (int64_t gi = 0; gi < group; ++gi) {
      const int64_t h = hk * group + gi;
      for (int64_t r = 0; r < sq.len; ++r) {
        const int64_t L = rule::visible_keys(static_cast<int>(r), static_cast<int>(sq.len),
                                             static_cast<int>(sk.len), a.causal);
        if (L == 0) continue;
        const int64_t qrow = (sq.row0 + r) * hq + h;
        const float* qr = &Q[qrow * d];
        const float* dor = &dO[qrow * d];
        double lse;
        softmax_row(qr, &K[(sk.row0 * hkv + hk) * d], hkv * d, L, d, scale, p, &lse);
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t k = 0; k < L; ++k) {
          const float* vr = &V[((sk.row0 + k) * hkv + hk) * d];
          for (int64_t x = 0; x < d; ++x) o[x] += p[k] * vr[x];
        }
        double D = 0;
        for (int64_t x = 0; x < d; ++x) D += static_cast<double>(dor[x]) * o[x];
        std::fill(dq.begin(), dq.end(), 0.0);
        for (int64_t k = 0; k < L; ++k) {
          const float* kr = &K[((sk.row0 + k) * hkv + hk) * d];
          const float* vr = &V[((sk.row0 + k) * hkv + hk) * d];
          double dp = 0;
          for (int64_t x = 0; x < d; ++x) dp += static_cast<double>(dor[x]) * vr[x];
          const double dsk = p[k] * (dp - D);
          for (int64_t x = 0; x < d; ++x) {
            dq[x] += dsk * kr[x];
            dk[k * d + x] += dsk * qr[x];
            dv[k * d + x] += p[k] * dor[x];
          }
        }
        for (int64_t x = 0; x < d; ++x) dQ[qrow * d + x] = static_cast<float>(scale * dq[x]);
      }
    }
    for (int64_t k = 0; k < sk.len; ++k)
      for (int64_t x = 0; x < d; ++x) {
        dK[((sk.row0 + k) * hkv + hk) * d + x] = static_cast<float>(scale * dk[k * d + x]);
        dV[((sk.row0 + k) * hkv + hk) * d + x] = static_cast<float>(dv[k * d + x]);
      }
  }
  cpu::detail::scatter(dQ, a.dq, a.dtype, a.dq_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  cpu::detail::scatter(dK, a.dk, a.dtype, a.dk_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  cpu::detail::scatter(dV, a.dv, a.dtype, a.dv_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  return Status::success();
}

}  // namespace reference
}  // namespace mala
