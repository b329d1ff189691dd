// Helpers shared by the CPU tests: seeded random tensors, a small attention problem held in
// contiguous fp32 std::vectors, and one-call wrappers around forward/backward/reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "mala/mala.h"

namespace mala_test {

inline std::vector<float> randn(size_t n, uint64_t seed, float stddev = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(rng);
  return x;
}

inline double rel_l2(const std::vector<float>& x, const std::vector<float>& ref) {
  EXPECT_EQ(x.size(), ref.size());
  return mala::relative_l2(x.data(), ref.data(), static_cast<int64_t>(std::min(x.size(), ref.size())));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One attention problem: contiguous fp32 q, dout [rows_q, hq, d], k, v [rows_k, hkv, d], where
// rows = batch * seqlen (dense) or the varlen total (cu_q / cu_k non-empty).
struct Problem {
  int64_t batch = 1, nq = 0, nk = 0, hq = 1, hkv = 1, d = 32;
  bool causal = true;
  float tau = 1.f, scale = 0.f;
  int bq = 0, bk = 0;
  std::vector<int32_t> cu_q, cu_k;
  std::vector<float> q, k, v, dout;

  bool varlen() const { return !cu_q.empty(); }
  int64_t rows_q() const { return varlen() ? cu_q.back() : batch * nq; }
  int64_t rows_k() const { return varlen() ? cu_k.back() : batch * nk; }

  Problem& randomize(uint64_t seed, float q_std = 1.f) {
    q = randn(static_cast<size_t>(rows_q() * hq * d), seed * 4 + 1, q_std);
    k = randn(static_cast<size_t>(rows_k() * hkv * d), seed * 4 + 2);
    v = randn(static_cast<size_t>(rows_k() * hkv * d), seed * 4 + 3);
    dout = randn(static_cast<size_t>(rows_q() * hq * d), seed * 4 + 4);
    return *this;
  }

  mala::ForwardArgs forward_args() const {
    mala::ForwardArgs a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.batch = batch;
    a.seqlen_q = nq;
    a.seqlen_k = nk;
    a.heads_q = hq;
    a.heads_kv = hkv;
    a.head_dim = d;
    a.causal = causal;
    a.tau = tau;
    a.softmax_scale = scale;
    a.block_q = bq;
    a.block_k = bk;
    if (varlen()) {
      a.cu_seqlens_q = cu_q.data();
      a.cu_seqlens_k = cu_k.data();
    }
    return a;
  }

  mala::BackwardArgs backward_args() const {
    mala::BackwardArgs a;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.dout = dout.data();
    a.batch = batch;
    a.seqlen_q = nq;
    a.seqlen_k = nk;
    a.heads_q = hq;
    a.heads_kv = hkv;
    a.head_dim = d;
    a.causal = causal;
    a.tau = tau;
    a.softmax_scale = scale;
    a.block_q = bq;
    a.block_k = bk;
    if (varlen()) {
      a.cu_seqlens_q = cu_q.data();
      a.cu_seqlens_k = cu_k.data();
    }
    return a;
  }
};

struct ForwardOut {
  mala::Status status;
  std::vector<float> o, lse;
  std::vector<int32_t> slots;
  std::vector<uint8_t> mask;  // [batch, hq, n_q_tiles, n_k_tiles]
  int64_t n_q_tiles = 0, n_k_tiles = 0;
  mala::Tiles tiles;
};

inline ForwardOut run_forward(const Problem& p, bool reference = false) {
  ForwardOut out;
  mala::ForwardArgs a = p.forward_args();
  out.tiles = mala::forward_tiles(a);
  out.n_q_tiles = ceil_div(p.nq, out.tiles.block_q);
  out.n_k_tiles = ceil_div(p.nk, out.tiles.block_k);
  out.o.assign(static_cast<size_t>(p.rows_q() * p.hq * p.d), NAN);
  out.lse.assign(static_cast<size_t>(p.rows_q() * p.hq), NAN);
  out.slots.assign(out.lse.size(), -1);
  out.mask.assign(static_cast<size_t>(p.batch * p.hq * out.n_q_tiles * out.n_k_tiles), 0xff);
  a.o = out.o.data();
  a.lse = out.lse.data();
  if (!reference) {
    a.fwd_slots = out.slots.data();
    a.tile_mask = out.mask.data();
  }
  out.status = reference ? mala::reference::dense_forward(a) : mala::forward(a);
  EXPECT_TRUE(out.status.ok) << out.status.message;
  return out;
}

struct BackwardOut {
  mala::Status status;
  std::vector<float> dq, dk, dv;
  std::vector<int32_t> slots;
  std::vector<uint8_t> mask;
  int64_t n_q_tiles = 0, n_k_tiles = 0;
};

// Backward using the forward outputs o and lse of `fwd`.
inline BackwardOut run_backward(const Problem& p, const ForwardOut& fwd, bool reference = false) {
  BackwardOut out;
  mala::BackwardArgs a = p.backward_args();
  const mala::Tiles t = mala::backward_tiles(a);
  out.n_q_tiles = ceil_div(p.nq, t.block_q);
  out.n_k_tiles = ceil_div(p.nk, t.block_k);
  out.dq.assign(p.q.size(), NAN);
  out.dk.assign(p.k.size(), NAN);
  out.dv.assign(p.v.size(), NAN);
  out.slots.assign(static_cast<size_t>(p.rows_q() * p.hq), -1);
  out.mask.assign(static_cast<size_t>(p.batch * p.hq * out.n_q_tiles * out.n_k_tiles), 0xff);
  a.o = fwd.o.data();
  a.lse = fwd.lse.data();
  a.dq = out.dq.data();
  a.dk = out.dk.data();
  a.dv = out.dv.data();
  if (!reference) {
    a.bwd_slots = out.slots.data();
    a.tile_mask = out.mask.data();
  }
  out.status = reference ? mala::reference::dense_backward(a) : mala::backward(a);
  EXPECT_TRUE(out.status.ok) << out.status.message;
  return out;
}

inline int64_t count_state(const std::vector<uint8_t>& mask, uint8_t state) {
  int64_t n = 0;
  for (uint8_t m : mask) n += m == state;
  return n;
}

}  // namespace mala_test
