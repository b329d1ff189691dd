// The online (forward / decode) rule for one query tile, shared by cpu::forward and cpu::decode so
// that a decode with one split reproduces the forward bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/rule.h"
#include "cpu/common.h"

namespace mala {
namespace cpu {
namespace detail {

// One query tile: `rows` fp32 query rows (all using the same KV head), their visible-key counts
// and thresholds, and the fp32 running state m, l, acc (one set per split in decode).
struct QueryTile {
  int64_t rows = 0, d = 0, block_k = 0;
  float scale = 1.f;
  std::vector<const float*> q;   // [rows] pointers to fp32 query rows
  std::vector<int64_t> L;        // visible keys per row (L_q)
  std::vector<float> log_thr;    // log(tau) - log(L_q), natural log
  int64_t max_L = 0;

  // Legal key tiles: [0, legal_tiles()) — those holding a key some row sees.
  int64_t legal_tiles() const { return n_tiles(max_L, block_k); }
  // The rows' newest legal key tiles, rule::newest_tile of each row with L > 0: the range
  // [*lo, *hi] (the seeded split's newest anchors); lo = legal_tiles(), hi = -1 when no row sees a key.
  void newest_tiles(int* lo, int* hi) const {
    *lo = static_cast<int>(legal_tiles());
    *hi = -1;
    for (int64_t r = 0; r < rows; ++r) {
      if (L[r] <= 0) continue;
      const int nt = rule::newest_tile(static_cast<int>(L[r]), static_cast<int>(block_k));
      *lo = std::min(*lo, nt);
      *hi = std::max(*hi, nt);
    }
  }
};

struct OnlineState {
  std::vector<float> m, l, acc;  // per row; acc is [rows, d]
  void reset(int64_t rows, int64_t d) {
    m.assign(static_cast<size_t>(rows), -INFINITY);
    l.assign(static_cast<size_t>(rows), 0.f);
    acc.assign(static_cast<size_t>(rows * d), 0.f);
  }
};

// Seeded split-KV (rule.h, "seeded split-KV"): the split's anchor tiles are retained untested and
// each row's test adds the mass of the anchors the split does not own, log_anchor[r] = log Z_anchor
// (-inf when it owns them all).
struct Seed {
  const float* log_anchor = nullptr;  // [rows]
  int newest_lo = 0, newest_hi = -1;  // the rows' newest legal tiles (anchors with tile 0); lo > hi: none
  bool owns_tile0 = true;             // key tile 0 here is the sequence's (false: a later KV shard)
};

// Visits key tiles j = j_end-1 down to j_begin (the diagonal/newest first) with the online test.
// key(k) / value(k) return fp32 rows of key index k (0-based in the sequence).  n_keys bounds the
// last tile.  Writes TileState per visited tile into mask[j] when mask is non-null.  Returns the
// number of retained tiles.  seed: null for the forward / per-split rule.
template <class KeyRow, class ValueRow>
int64_t attend_online(const QueryTile& t, OnlineState& st, int64_t j_begin, int64_t j_end, int64_t n_keys,
                      KeyRow key, ValueRow value, uint8_t* mask, const Seed* seed = nullptr) {
  const int64_t rows = t.rows, d = t.d, bk = t.block_k;
  const int64_t width = std::min(bk, n_keys);  // a tile never holds more than n_keys keys
  std::vector<float> s(static_cast<size_t>(rows * width));
  std::vector<float> tile_max(static_cast<size_t>(rows));
  std::vector<int64_t> legal(static_cast<size_t>(rows));
  int64_t retained = 0;
  for (int64_t j = j_end - 1; j >= j_begin; --j) {
    const int64_t kb = j * bk;
    const int64_t kn = std::min(kb + bk, n_keys) - kb;
    const bool forced =
        seed && rule::is_held_anchor_tile(static_cast<int>(j), seed->owns_tile0, seed->newest_lo, seed->newest_hi);
    bool skip = !forced, any_legal = false;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::max<int64_t>(0, std::min(t.L[r] - kb, kn));
      legal[r] = n;
      if (n == 0) continue;  // this row sees no key of the tile: it does not constrain it
      any_legal = true;
      float mx = -INFINITY;
      float* sr = &s[static_cast<size_t>(r * width)];
      for (int64_t c = 0; c < n; ++c) {
        sr[c] = score(t.q[r], key(kb + c), d, t.scale);
        mx = rule::nan_max(mx, sr[c]);
      }
      tile_max[r] = mx;
      if (!skip) continue;
      const float own = st.m[r] + std::log(st.l[r]);
      const float log_norm = seed ? rule::log_add_exp(seed->log_anchor[r], own) : own;
      if (!rule::row_allows_skip(mx, log_norm, t.log_thr[r])) skip = false;
    }
    if (!any_legal) {
      if (mask) mask[j] = kTileIllegal;
      continue;
    }
    if (skip) {
      if (mask) mask[j] = kTileSkipped;
      continue;
    }
    if (mask) mask[j] = kTileRetained;
    ++retained;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = legal[r];
      if (n == 0) continue;
      float* sr = &s[static_cast<size_t>(r * width)];
      const float m_new = rule::nan_max(st.m[r], tile_max[r]);
      const float alpha = std::exp(st.m[r] - m_new);  // 0 before anything was retained
      float sum = 0.f;
      for (int64_t c = 0; c < n; ++c) {
        sr[c] = std::exp(sr[c] - m_new);
        sum += sr[c];
      }
      st.l[r] = alpha * st.l[r] + sum;
      float* acc = &st.acc[static_cast<size_t>(r * d)];
      for (int64_t x = 0; x < d; ++x) acc[x] *= alpha;
      for (int64_t c = 0; c < n; ++c) {
        const float p = sr[c];
        const float* v = value(kb + c);
        for (int64_t x = 0; x < d; ++x) acc[x] += p * v[x];
      }
      st.m[r] = m_new;
    }
  }
  return retained;
}

}  // namespace detail
}  // namespace cpu
}  // namespace mala
