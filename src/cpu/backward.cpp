// CPU backward with the offline rule.
//   Preprocess: D = rowsum(dO * O) per (row, query head).
//   Pass 1, one task per (sequence, KV head, key tile): for every query head of the KV head's group
//     and every query tile with a legal entry (ascending), recompute S, test it against the saved
//     lse, and for retained tiles accumulate dV += P^T dO and dK += dS^T Q.  The decision is stored.
//   Pass 2, one task per (sequence, query head, query tile): dQ += dS K over the tiles pass 1
//     retained, recomputing S and dP with the same code (bit-identical scores).
// Every output element is written by exactly one task: no atomics, results are deterministic.
#include <cmath>
#include <cstring>
#include <vector>

#include "common/rule.h"
#include "cpu/common.h"
#include "cpu/cpu.h"

namespace mala {
namespace cpu {

using namespace detail;

Status backward(const BackwardArgs& a) {
  const Tiles tiles = cpu::backward_tiles(a);
  const int64_t bq = tiles.block_q, bk = tiles.block_k;
  const Geometry g{a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.head_dim,
                   a.cu_seqlens_q, a.cu_seqlens_k, a.causal};
  const int64_t d = g.head_dim, hq = g.heads_q, hkv = g.heads_kv, group = g.group();
  const float scale = resolve_scale(a.softmax_scale, d);
  const float log_tau = std::log(a.tau);

  const std::vector<float> Q = gather(a.q, a.dtype, a.q_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  const std::vector<float> K = gather(a.k, a.dtype, a.k_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  const std::vector<float> V = gather(a.v, a.dtype, a.v_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  const std::vector<float> dO = gather(a.dout, a.dtype, a.dout_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  std::vector<float> D = staging(g.rows_q() * hq);
  {
    const std::vector<float> O = gather(a.o, a.dtype, a.o_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
    const int64_t n = g.rows_q() * hq;
#pragma omp parallel for schedule(static) if (parallel_worth(n * d))
    for (int64_t x = 0; x < n; ++x) D[x] = dot(&dO[x * d], &O[x * d], d);
  }

  std::vector<float> dQ = staging(static_cast<int64_t>(Q.size()));
  std::vector<float> dK = staging(static_cast<int64_t>(K.size())), dV = staging(static_cast<int64_t>(V.size()));
  const int64_t nqt = n_tiles(g.seqlen_q, bq), nkt = n_tiles(g.seqlen_k, bk);
  std::vector<uint8_t> decision(static_cast<size_t>(g.batch * hq * nqt * nkt), kTileIllegal);
  auto decision_at = [&](int64_t b, int64_t h, int64_t i, int64_t j) -> uint8_t& {
    return decision[static_cast<size_t>(((b * hq + h) * nqt + i) * nkt + j)];
  };
  auto visible = [&](int64_t row, const layout::Seq& sq, const layout::Seq& sk) -> int64_t {
    return rule::visible_keys(static_cast<int>(row), static_cast<int>(sq.len), static_cast<int>(sk.len),
                              a.causal);
  };

  // ---- pass 1: key-major, dK and dV ------------------------------------------------------------
  const int64_t n_key_tasks = g.batch * hkv * nkt;
  const int64_t work = g.rows_q() * hq * g.seqlen_k * d;
#pragma omp parallel for schedule(dynamic, 1) if (parallel_worth(work))
  for (int64_t task = 0; task < n_key_tasks; ++task) {
    const int64_t j = task % nkt, hk = (task / nkt) % hkv, b = task / (nkt * hkv);
    const layout::Seq sq = g.seq_q(b), sk = g.seq_k(b);
    const int64_t kb = j * bk;
    if (kb >= sk.len) continue;
    const int64_t kn = std::min(bk, sk.len - kb);
    std::vector<float> dk_acc(static_cast<size_t>(kn * d), 0.f), dv_acc(static_cast<size_t>(kn * d), 0.f);
    const int64_t max_rows = std::min(bq, sq.len);
    std::vector<float> p(static_cast<size_t>(max_rows * kn)), ds(static_cast<size_t>(max_rows * kn));
    std::vector<int64_t> legal(static_cast<size_t>(max_rows));
    auto key = [&](int64_t c) { return &K[static_cast<size_t>(((sk.row0 + kb + c) * hkv + hk) * d)]; };
    auto value = [&](int64_t c) { return &V[static_cast<size_t>(((sk.row0 + kb + c) * hkv + hk) * d)]; };
    // First query row that sees key kb (causal, bottom-right): L_q > kb.
    const int64_t first_row = a.causal ? std::max<int64_t>(0, kb - sk.len + sq.len) : 0;
    for (int64_t gi = 0; gi < group; ++gi) {
      const int64_t h = hk * group + gi;
      for (int64_t i = first_row / bq; i * bq < sq.len; ++i) {
        const int64_t r0 = i * bq, rows = std::min(bq, sq.len - r0);
        bool skip = true, any_legal = false;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t L = visible(r0 + r, sq, sk);
          const int64_t n = std::max<int64_t>(0, std::min(L - kb, kn));
          legal[r] = n;
          if (n == 0) continue;
          any_legal = true;
          const float* q = &Q[static_cast<size_t>(((sq.row0 + r0 + r) * hq + h) * d)];
          const float lse = a.lse[g.row_index(b, h, r0 + r)];
          float* pr = &p[static_cast<size_t>(r * kn)];
          float mx = -INFINITY;
          for (int64_t c = 0; c < n; ++c) {
            pr[c] = score(q, key(c), d, scale);
            mx = rule::nan_max(mx, pr[c]);
          }
          // A split of a longer sequence (rows_before >= 0) tests against the row's whole length.
          const int64_t L_thr = rule::threshold_length(static_cast<int>(L), static_cast<int>(r0 + r),
                                                       static_cast<int>(a.rows_before));
          const float thr = rule::log_threshold(log_tau, std::log(static_cast<float>(L_thr)));
          if (skip && !rule::row_allows_skip(mx, lse, thr)) skip = false;
        }
        if (!any_legal) continue;
        decision_at(b, h, i, j) = skip ? kTileSkipped : kTileRetained;
        if (skip) continue;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = legal[r];
          if (n == 0) continue;
          const int64_t qrow = (sq.row0 + r0 + r) * hq + h;
          const float lse = a.lse[g.row_index(b, h, r0 + r)];
          const float* dor = &dO[static_cast<size_t>(qrow * d)];
          const float* qr = &Q[static_cast<size_t>(qrow * d)];
          float* pr = &p[static_cast<size_t>(r * kn)];
          float* dsr = &ds[static_cast<size_t>(r * kn)];
          for (int64_t c = 0; c < n; ++c) {
            pr[c] = std::exp(pr[c] - lse);
            const float dp = dot(dor, value(c), d);
            dsr[c] = pr[c] * (dp - D[qrow]);
            float* dvc = &dv_acc[static_cast<size_t>(c * d)];
            float* dkc = &dk_acc[static_cast<size_t>(c * d)];
            for (int64_t x = 0; x < d; ++x) dvc[x] += pr[c] * dor[x];
            for (int64_t x = 0; x < d; ++x) dkc[x] += dsr[c] * qr[x];
          }
        }
      }
    }
    for (int64_t c = 0; c < kn; ++c) {
      const size_t off = static_cast<size_t>(((sk.row0 + kb + c) * hkv + hk) * d);
      for (int64_t x = 0; x < d; ++x) {
        dK[off + x] = dk_acc[static_cast<size_t>(c * d + x)] * scale;
        dV[off + x] = dv_acc[static_cast<size_t>(c * d + x)];
      }
    }
  }

  // ---- pass 2: query-major, dQ and slots ---------------------------------------------------------
  const int64_t n_query_tasks = g.batch * hq * nqt;
#pragma omp parallel for schedule(dynamic, 1) if (parallel_worth(work))
  for (int64_t task = 0; task < n_query_tasks; ++task) {
    const int64_t i = task % nqt, h = (task / nqt) % hq, b = task / (nqt * hq);
    const layout::Seq sq = g.seq_q(b), sk = g.seq_k(b);
    const int64_t r0 = i * bq;
    if (r0 >= sq.len) continue;
    const int64_t rows = std::min(bq, sq.len - r0), hk = h / group;
    int64_t retained = 0;
    for (int64_t j = 0; j < nkt; ++j) {
      if (decision_at(b, h, i, j) != kTileRetained) continue;
      ++retained;
      const int64_t kb = j * bk, kn = std::min(bk, sk.len - kb);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t L = visible(r0 + r, sq, sk);
        const int64_t n = std::max<int64_t>(0, std::min(L - kb, kn));
        if (n == 0) continue;
        const int64_t qrow = (sq.row0 + r0 + r) * hq + h;
        const float lse = a.lse[g.row_index(b, h, r0 + r)];
        const float* qr = &Q[static_cast<size_t>(qrow * d)];
        const float* dor = &dO[static_cast<size_t>(qrow * d)];
        float* dqr = &dQ[static_cast<size_t>(qrow * d)];
        for (int64_t c = 0; c < n; ++c) {
          const size_t koff = static_cast<size_t>(((sk.row0 + kb + c) * hkv + hk) * d);
          const float pc = std::exp(score(qr, &K[koff], d, scale) - lse);
          const float dsc = pc * (dot(dor, &V[koff], d) - D[qrow]);
          for (int64_t x = 0; x < d; ++x) dqr[x] += dsc * K[koff + x];
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t qrow = (sq.row0 + r0 + r) * hq + h;
      float* dqr = &dQ[static_cast<size_t>(qrow * d)];
      for (int64_t x = 0; x < d; ++x) dqr[x] *= scale;
      if (a.bwd_slots) {
        const int64_t L = visible(r0 + r, sq, sk);
        a.bwd_slots[g.row_index(b, h, r0 + r)] = L > 0 ? static_cast<int32_t>(retained * bk) : 0;
      }
    }
  }

  if (a.tile_mask) std::memcpy(a.tile_mask, decision.data(), decision.size());
  scatter(dQ, a.dq, a.dtype, a.dq_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  scatter(dK, a.dk, a.dtype, a.dk_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  scatter(dV, a.dv, a.dtype, a.dv_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  return Status::success();
}

}  // namespace cpu
}  // namespace mala
