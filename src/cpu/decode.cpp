// CPU decode (flash_attn_with_kvcache semantics) with split-KV.
//   1. k_new/v_new are written into the cache at cache_seqlens[b] (contiguous or paged).
//   2. Each sequence attends to its Nk = cache_seqlens[b] + seqlen_new keys, causal bottom-right.
//   3. Query tiles: packed GQA (rows r = token * G + g of one KV head, block_q rows per tile) or one
//      query head's tokens.  The sequence's key tiles [0, ceil(Nk / block_k)) are partitioned by
//      rule::split_tiles; each split walks its legal tiles newest first with its own m, l (the test
//      uses the full L_q) and the splits are merged with the lse-weighted combine.
//   4. split_rule = seeded with num_splits > 1 (rule.h, "seeded split-KV"): the anchor tiles (tile 0
//      and the rows' newest legal tiles) are retained untested by their owners, and each split's test
//      adds the exact mass of the anchors it does not own.  Their scores are computed once per query
//      tile here (a kernel recomputes them per split: same scores, the sums may round differently).
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

namespace {

// Element offset of key position `pos` of sequence b, KV head hk, in a contiguous or paged cache.
struct CacheIndex {
  const DecodeArgs* a;
  layout::Resolved st;
  int64_t bt_stride;
  int64_t operator()(int64_t b, int64_t pos, int64_t hk) const {
    if (a->block_table) {
      const int64_t page = a->block_table[b * bt_stride + pos / a->page_size];
      return page * st.batch + (pos % a->page_size) * st.row + hk * st.head;
    }
    return b * st.batch + pos * st.row + hk * st.head;
  }
};

}  // namespace

Status decode(const DecodeArgs& a) {
  const Tiles tiles = cpu::decode_tiles(a);
  const int64_t bq = tiles.block_q, bk = tiles.block_k;
  const int64_t d = a.head_dim, hq = a.heads_q, hkv = a.heads_kv, group = hq / hkv;
  const int64_t nb = a.batch, sq = a.seqlen_q;
  const int num_splits = cpu::decode_num_splits(a);
  const float scale = resolve_scale(a.softmax_scale, d);
  const float log_tau = std::log(a.tau);
  const bool paged = a.block_table != nullptr;
  const int64_t cache_rows = paged ? a.page_size : a.cache_capacity;
  const int64_t capacity = paged ? a.page_size * a.max_pages : a.cache_capacity;
  const int64_t bt_stride = a.block_table_stride ? a.block_table_stride : a.max_pages;
  const CacheIndex kidx{&a, layout::resolve(a.k_cache_strides, cache_rows, hkv, d), bt_stride};
  const CacheIndex vidx{&a, layout::resolve(a.v_cache_strides, cache_rows, hkv, d), bt_stride};

  // 1. Append the new keys and values (raw copy, same dtype).
  if (a.seqlen_new > 0) {
    const layout::Resolved kn = layout::resolve(a.k_new_strides, a.seqlen_new, hkv, d);
    const layout::Resolved vn = layout::resolve(a.v_new_strides, a.seqlen_new, hkv, d);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t t = 0; t < a.seqlen_new; ++t)
        for (int64_t hk = 0; hk < hkv; ++hk) {
          const int64_t pos = a.cache_seqlens[b] + t;
          layout::copy_raw(a.k_cache, kidx(b, pos, hk), a.k_new, b * kn.batch + t * kn.row + hk * kn.head, d,
                           a.dtype);
          layout::copy_raw(a.v_cache, vidx(b, pos, hk), a.v_new, b * vn.batch + t * vn.row + hk * vn.head, d,
                           a.dtype);
        }
  }

  // 2. fp32 staging: q as [batch * seqlen_q, hq, d]; each sequence's keys as [Nk, hkv, d].
  const std::vector<float> Q = gather(a.q, a.dtype, a.q_strides, nb, sq, nullptr, hq, d);
  std::vector<int64_t> n_keys(static_cast<size_t>(nb));
  std::vector<std::vector<float>> K(static_cast<size_t>(nb)), V(static_cast<size_t>(nb));
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t nk = a.cache_seqlens[b] + a.seqlen_new;
    n_keys[b] = nk;
    K[b].resize(static_cast<size_t>(nk * hkv * d));
    V[b].resize(static_cast<size_t>(nk * hkv * d));
#pragma omp parallel for schedule(static) if (parallel_worth(nk * hkv * d))
    for (int64_t pos = 0; pos < nk; ++pos)
      for (int64_t hk = 0; hk < hkv; ++hk) {
        layout::load(a.k_cache, a.dtype, kidx(b, pos, hk), d, &K[b][static_cast<size_t>((pos * hkv + hk) * d)]);
        layout::load(a.v_cache, a.dtype, vidx(b, pos, hk), d, &V[b][static_cast<size_t>((pos * hkv + hk) * d)]);
      }
  }

  // 3. Query tiles.
  const int64_t tile_heads = a.pack_gqa ? hkv : hq;          // query-tile owners per sequence
  const int64_t tile_rows = a.pack_gqa ? sq * group : sq;    // rows per owner
  const int64_t nqt = n_tiles(tile_rows, bq), nkt = n_tiles(capacity, bk);
  if (a.tile_mask) std::memset(a.tile_mask, kTileIllegal, static_cast<size_t>(nb * tile_heads * nqt * nkt));
  const layout::Resolved ost = layout::resolve(a.o_strides, sq, hq, d);
  const int64_t n_tasks = nb * tile_heads * nqt;

#pragma omp parallel for schedule(dynamic, 1) if (parallel_worth(nb * hq * sq * capacity * d))
  for (int64_t task = 0; task < n_tasks; ++task) {
    const int64_t i = task % nqt, owner = (task / nqt) % tile_heads, b = task / (nqt * tile_heads);
    const int64_t r0 = i * bq, rows = std::min(bq, tile_rows - r0);
    const int64_t hk = a.pack_gqa ? owner : owner / group;
    const int64_t nk = n_keys[b];
    QueryTile t;
    t.rows = rows;
    t.d = d;
    t.block_k = bk;
    t.scale = scale;
    t.q.resize(rows);
    t.L.resize(rows);
    t.log_thr.resize(rows);
    std::vector<int64_t> token(static_cast<size_t>(rows)), head(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pr = r0 + r;
      token[r] = a.pack_gqa ? pr / group : pr;
      head[r] = a.pack_gqa ? hk * group + pr % group : owner;
      t.q[r] = &Q[static_cast<size_t>(((b * sq + token[r]) * hq + head[r]) * d)];
      t.L[r] = rule::visible_keys(static_cast<int>(token[r]), static_cast<int>(sq), static_cast<int>(nk), a.causal);
      t.log_thr[r] = rule::log_threshold(log_tau, std::log(static_cast<float>(t.L[r])));
      t.max_L = std::max(t.max_L, t.L[r]);
    }
    const float* Kb = K[b].data();
    const float* Vb = V[b].data();
    auto key = [&](int64_t k) { return &Kb[static_cast<size_t>((k * hkv + hk) * d)]; };
    auto value = [&](int64_t k) { return &Vb[static_cast<size_t>((k * hkv + hk) * d)]; };
    uint8_t* mask = a.tile_mask ? a.tile_mask + ((b * tile_heads + owner) * nqt + i) * nkt : nullptr;

    // Splits, each with its own state; results merged with the lse-weighted combine.
    const int seq_tiles = static_cast<int>(n_tiles(nk, bk));
    const int64_t legal = t.legal_tiles();
    std::vector<float> lse(static_cast<size_t>(rows), -INFINITY);
    std::vector<std::vector<float>> split_lse;
    std::vector<std::vector<float>> split_o;
    int64_t retained = 0;

    // Seeded: the anchor tiles and, per anchor tile and row, log of the row's mass over its legal
    // keys in the tile (-inf where it has none).
    const bool seeded = a.split_rule == SplitRule::seeded && num_splits > 1 && legal > 0;
    Seed seed;
    std::vector<int64_t> anchors;
    std::vector<std::vector<float>> anchor_mass;  // [anchor][row]
    std::vector<float> log_anchor;
    if (seeded) {
      int lo, hi;
      t.newest_tiles(&lo, &hi);
      seed.newest_lo = lo;
      seed.newest_hi = hi;
      for (int64_t j = 0; j < legal; ++j)
        if (rule::is_anchor_tile(static_cast<int>(j), lo, hi)) anchors.push_back(j);
      for (int64_t j : anchors) {
        std::vector<float> lm(static_cast<size_t>(rows), -INFINITY);
        const int64_t kb = j * bk, kn = std::min(kb + bk, nk) - kb;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t n = std::max<int64_t>(0, std::min(t.L[r] - kb, kn));
          if (n == 0) continue;
          std::vector<float> sc(static_cast<size_t>(n));
          float mx = -INFINITY;
          for (int64_t c = 0; c < n; ++c) mx = rule::nan_max(mx, sc[c] = score(t.q[r], key(kb + c), d, t.scale));
          float sum = 0.f;
          for (int64_t c = 0; c < n; ++c) sum += std::exp(sc[c] - mx);
          lm[r] = mx + std::log(sum);
        }
        anchor_mass.push_back(std::move(lm));
      }
      log_anchor.resize(static_cast<size_t>(rows));
      seed.log_anchor = log_anchor.data();
    }

    OnlineState st;
    for (int s = 0; s < num_splits; ++s) {
      int begin, end;
      rule::split_tiles(seq_tiles, num_splits, s, &begin, &end);
      const int64_t stop = std::min<int64_t>(end, legal);
      if (begin >= stop) continue;
      st.reset(rows, d);
      if (seeded) {  // Z_anchor of this split: the anchors it does not own
        std::fill(log_anchor.begin(), log_anchor.end(), -INFINITY);
        for (size_t x = 0; x < anchors.size(); ++x) {
          if (anchors[x] >= begin && anchors[x] < end) continue;
          for (int64_t r = 0; r < rows; ++r) log_anchor[r] = rule::log_add_exp(log_anchor[r], anchor_mass[x][r]);
        }
      }
      retained += attend_online(t, st, begin, stop, nk, key, value, mask, seeded ? &seed : nullptr);
      std::vector<float> sl(static_cast<size_t>(rows), -INFINITY), so(static_cast<size_t>(rows * d), 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        if (st.l[r] <= 0.f) continue;  // this row saw nothing in this split
        sl[r] = st.m[r] + std::log(st.l[r]);
        for (int64_t x = 0; x < d; ++x) so[r * d + x] = st.acc[r * d + x] / st.l[r];
      }
      split_lse.push_back(std::move(sl));
      split_o.push_back(std::move(so));
    }
    std::vector<float> out(static_cast<size_t>(d));
    for (int64_t r = 0; r < rows; ++r) {
      float mx = -INFINITY;
      for (const auto& sl : split_lse) mx = rule::nan_max(mx, sl[r]);
      std::fill(out.begin(), out.end(), 0.f);
      float row_lse = -INFINITY;
      if (mx != -INFINITY) {
        float sum = 0.f;
        for (const auto& sl : split_lse)
          if (sl[r] != -INFINITY) sum += std::exp(sl[r] - mx);
        row_lse = mx + std::log(sum);
        for (size_t s = 0; s < split_lse.size(); ++s) {
          if (split_lse[s][r] == -INFINITY) continue;
          const float w = std::exp(split_lse[s][r] - row_lse);
          for (int64_t x = 0; x < d; ++x) out[x] += w * split_o[s][r * d + x];
        }
      }
      layout::store(a.o, a.dtype, b * ost.batch + token[r] * ost.row + head[r] * ost.head, d, out.data());
      const int64_t idx = (b * hq + head[r]) * sq + token[r];
      if (a.lse) a.lse[idx] = row_lse;
      if (a.fwd_slots) a.fwd_slots[idx] = t.L[r] > 0 ? static_cast<int32_t>(retained * bk) : 0;
    }
  }
  return Status::success();
}

}  // namespace cpu
}  // namespace mala
