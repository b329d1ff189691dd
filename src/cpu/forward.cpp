// CPU forward: one task per (sequence, query head, query tile), the online rule over the legal key
// tiles from the diagonal down (src/cpu/online.h).  Inputs are staged as fp32; state is fp32.
#include <cmath>
#include <cstring>
#include <vector>

#include "common/rule.h"
#include "cpu/common.h"
#include "cpu/cpu.h"
#include "cpu/online.h"

namespace mala {
namespace cpu {

using namespace detail;

Status forward(const ForwardArgs& a) {
  const Tiles tiles = cpu::forward_tiles(a);
  const int64_t bq = tiles.block_q, bk = tiles.block_k;
  const Geometry g{a.batch, a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv, a.head_dim,
                   a.cu_seqlens_q, a.cu_seqlens_k, a.causal};
  const int64_t d = g.head_dim, hq = g.heads_q, hkv = g.heads_kv;
  const float scale = resolve_scale(a.softmax_scale, d);
  const float log_tau = std::log(a.tau);  // tau = 0: -inf, nothing is skipped

  const std::vector<float> Q = gather(a.q, a.dtype, a.q_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  const std::vector<float> K = gather(a.k, a.dtype, a.k_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  const std::vector<float> V = gather(a.v, a.dtype, a.v_strides, g.batch, g.seqlen_k, g.cu_k, hkv, d);
  std::vector<float> O = staging(g.rows_q() * hq * d);

  const int64_t nqt = n_tiles(g.seqlen_q, bq), nkt = n_tiles(g.seqlen_k, bk);
  if (a.tile_mask) std::memset(a.tile_mask, kTileIllegal, static_cast<size_t>(g.batch * hq * nqt * nkt));
  const int64_t n_tasks = g.batch * hq * nqt;

#pragma omp parallel for schedule(dynamic, 1) if (parallel_worth(g.rows_q() * hq * g.seqlen_k * d))
  for (int64_t task = 0; task < n_tasks; ++task) {
    const int64_t i = task % nqt, h = (task / nqt) % hq, b = task / (nqt * hq);
    const layout::Seq sq = g.seq_q(b), sk = g.seq_k(b);
    const int64_t r0 = i * bq;
    if (r0 >= sq.len) continue;
    const int64_t rows = std::min(bq, sq.len - r0);
    const int64_t hk = h / g.group();

    QueryTile t;
    t.rows = rows;
    t.d = d;
    t.block_k = bk;
    t.scale = scale;
    t.q.resize(rows);
    t.L.resize(rows);
    t.log_thr.resize(rows);
    std::vector<float> log_anchor;
    Seed seed;
    for (int64_t r = 0; r < rows; ++r) {
      t.q[r] = &Q[static_cast<size_t>(((sq.row0 + r0 + r) * hq + h) * d)];
      t.L[r] = rule::visible_keys(static_cast<int>(r0 + r), static_cast<int>(sq.len),
                                  static_cast<int>(sk.len), a.causal);
      // A split of a longer sequence (rows_before >= 0) tests against the row's whole length.
      const int64_t L_thr = rule::threshold_length(static_cast<int>(t.L[r]), static_cast<int>(r0 + r),
                                                   static_cast<int>(a.rows_before));
      t.log_thr[r] = rule::log_threshold(log_tau, std::log(static_cast<float>(L_thr)));
      t.max_L = std::max(t.max_L, t.L[r]);
    }
    if (a.seed_lse) {  // a seeded split (rule.h, "seeded split-KV"): the caller's anchor mass
      log_anchor.resize(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) log_anchor[r] = a.seed_lse[g.row_index(b, h, r0 + r)];
      seed.log_anchor = log_anchor.data();
      seed.owns_tile0 = a.owns_tile0;
      if (a.owns_newest) t.newest_tiles(&seed.newest_lo, &seed.newest_hi);  // else none held (lo > hi)
    }
    OnlineState st;
    st.reset(rows, d);
    auto key = [&](int64_t k) { return &K[static_cast<size_t>(((sk.row0 + k) * hkv + hk) * d)]; };
    auto value = [&](int64_t k) { return &V[static_cast<size_t>(((sk.row0 + k) * hkv + hk) * d)]; };
    uint8_t* mask = a.tile_mask ? a.tile_mask + ((b * hq + h) * nqt + i) * nkt : nullptr;
    const int64_t retained =
        attend_online(t, st, 0, t.legal_tiles(), sk.len, key, value, mask, a.seed_lse ? &seed : nullptr);

    for (int64_t r = 0; r < rows; ++r) {
      float* o = &O[static_cast<size_t>(((sq.row0 + r0 + r) * hq + h) * d)];
      const int64_t idx = g.row_index(b, h, r0 + r);
      // No visible key, or (seeded split) nothing retained: zeros, lse = -inf.
      if (t.L[r] == 0 || st.l[r] == 0.f) {
        if (a.lse) a.lse[idx] = -INFINITY;
        if (a.fwd_slots) a.fwd_slots[idx] = t.L[r] == 0 ? 0 : static_cast<int32_t>(retained * bk);
        continue;
      }
      const float l = st.l[r];
      const float* acc = &st.acc[static_cast<size_t>(r * d)];
      for (int64_t x = 0; x < d; ++x) o[x] = acc[x] / l;
      if (a.lse) a.lse[idx] = st.m[r] + std::log(l);
      if (a.fwd_slots) a.fwd_slots[idx] = static_cast<int32_t>(retained * bk);
    }
  }
  scatter(O, a.o, a.dtype, a.o_strides, g.batch, g.seqlen_q, g.cu_q, hq, d);
  return Status::success();
}

}  // namespace cpu
}  // namespace mala
