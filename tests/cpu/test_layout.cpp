// Layout equivalences: GQA = K/V expanded per query head, varlen and batches = sequences run alone,
// strided tensors = contiguous ones, f16/bf16 = fp32 on the rounded inputs then rounded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "common/layout.h"
#include "test_util.h"

using namespace mala_test;

namespace {

// Adds a rotary-like positional code to q and k (per packed row) so attention is local and tiles
// far from the diagonal get skipped.
void add_locality(Problem& p) {
  auto code = [&](std::vector<float>& x, int64_t rows, int64_t heads) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < p.d / 2; ++c) {
          const double w = std::pow(0.5, c * 8.0 / p.d);
          x[(r * heads + h) * p.d + 2 * c] += 2.5f * std::cos(w * r);
          x[(r * heads + h) * p.d + 2 * c + 1] += 2.5f * std::sin(w * r);
        }
  };
  code(p.q, p.rows_q(), p.hq);
  code(p.k, p.rows_k(), p.hkv);
}

Problem sharp_problem(int64_t nq, int64_t nk, int64_t hq, int64_t hkv, uint64_t seed) {
  Problem p;
  p.nq = nq;
  p.nk = nk;
  p.hq = hq;
  p.hkv = hkv;
  p.d = 32;
  p.bq = 32;
  p.bk = 32;
  p.tau = 1.f;
  p.randomize(seed, 1.f);
  add_locality(p);
  return p;
}

TEST(Layout, GqaEqualsExpandedKv) {
  for (bool causal : {true, false}) {
    Problem g = sharp_problem(160, 200, 6, 2, 41);
    g.causal = causal;
    Problem e = g;
    e.hkv = g.hq;
    const int64_t group = g.hq / g.hkv;
    e.k.resize(g.nk * e.hkv * g.d);
    e.v.resize(g.nk * e.hkv * g.d);
    for (int64_t r = 0; r < g.nk; ++r)
      for (int64_t h = 0; h < g.hq; ++h)
        for (int64_t x = 0; x < g.d; ++x) {
          e.k[(r * e.hkv + h) * g.d + x] = g.k[(r * g.hkv + h / group) * g.d + x];
          e.v[(r * e.hkv + h) * g.d + x] = g.v[(r * g.hkv + h / group) * g.d + x];
        }
    ForwardOut fg = run_forward(g), fe = run_forward(e);
    EXPECT_EQ(fg.o, fe.o);
    EXPECT_EQ(fg.lse, fe.lse);
    EXPECT_EQ(fg.slots, fe.slots);
    EXPECT_EQ(fg.mask, fe.mask);
    EXPECT_GT(count_state(fg.mask, mala::kTileSkipped), 0);
    BackwardOut bg = run_backward(g, fg), be = run_backward(e, fe);
    EXPECT_EQ(bg.dq, be.dq);
    EXPECT_EQ(bg.slots, be.slots);
    EXPECT_EQ(bg.mask, be.mask);
    std::vector<float> dk(g.k.size(), 0.f), dv(g.v.size(), 0.f);
    for (int64_t r = 0; r < g.nk; ++r)
      for (int64_t h = 0; h < g.hq; ++h)
        for (int64_t x = 0; x < g.d; ++x) {
          dk[(r * g.hkv + h / group) * g.d + x] += be.dk[(r * e.hkv + h) * g.d + x];
          dv[(r * g.hkv + h / group) * g.d + x] += be.dv[(r * e.hkv + h) * g.d + x];
        }
    EXPECT_LT(rel_l2(bg.dk, dk), 1e-6);
    EXPECT_LT(rel_l2(bg.dv, dv), 1e-6);
  }
}

// Runs sequence b of a varlen or dense batch on its own.
Problem slice(const Problem& p, int64_t b) {
  Problem s = p;
  s.batch = 1;
  s.cu_q.clear();
  s.cu_k.clear();
  const int64_t q0 = p.varlen() ? p.cu_q[b] : b * p.nq, q1 = p.varlen() ? p.cu_q[b + 1] : (b + 1) * p.nq;
  const int64_t k0 = p.varlen() ? p.cu_k[b] : b * p.nk, k1 = p.varlen() ? p.cu_k[b + 1] : (b + 1) * p.nk;
  s.nq = q1 - q0;
  s.nk = k1 - k0;
  s.q.assign(p.q.begin() + q0 * p.hq * p.d, p.q.begin() + q1 * p.hq * p.d);
  s.dout.assign(p.dout.begin() + q0 * p.hq * p.d, p.dout.begin() + q1 * p.hq * p.d);
  s.k.assign(p.k.begin() + k0 * p.hkv * p.d, p.k.begin() + k1 * p.hkv * p.d);
  s.v.assign(p.v.begin() + k0 * p.hkv * p.d, p.v.begin() + k1 * p.hkv * p.d);
  return s;
}

void expect_batch_equals_alone(const Problem& p) {
  ForwardOut f = run_forward(p);
  BackwardOut b = run_backward(p, f);
  EXPECT_GT(count_state(f.mask, mala::kTileSkipped), 0);
  const int64_t total_q = p.rows_q();
  for (int64_t s = 0; s < p.batch; ++s) {
    Problem one = slice(p, s);
    if (one.nq == 0 || one.nk == 0) {
      // Empty sequences are legal only inside a varlen batch: their keys get zero gradients.
      for (int64_t x = p.cu_k[s] * p.hkv * p.d; x < p.cu_k[s + 1] * p.hkv * p.d; ++x) {
        EXPECT_EQ(b.dk[x], 0.f);
        EXPECT_EQ(b.dv[x], 0.f);
      }
      for (int64_t x = p.cu_q[s] * p.hq * p.d; x < p.cu_q[s + 1] * p.hq * p.d; ++x) {
        EXPECT_EQ(f.o[x], 0.f);
        EXPECT_EQ(b.dq[x], 0.f);
      }
      continue;
    }
    ForwardOut fo = run_forward(one);
    BackwardOut bo = run_backward(one, fo);
    const int64_t q0 = p.varlen() ? p.cu_q[s] : s * p.nq, k0 = p.varlen() ? p.cu_k[s] : s * p.nk;
    for (int64_t x = 0; x < (int64_t)fo.o.size(); ++x) {
      ASSERT_EQ(f.o[q0 * p.hq * p.d + x], fo.o[x]) << "seq " << s;
      ASSERT_EQ(b.dq[q0 * p.hq * p.d + x], bo.dq[x]) << "seq " << s;
    }
    for (int64_t x = 0; x < (int64_t)bo.dk.size(); ++x) {
      ASSERT_EQ(b.dk[k0 * p.hkv * p.d + x], bo.dk[x]) << "seq " << s;
      ASSERT_EQ(b.dv[k0 * p.hkv * p.d + x], bo.dv[x]) << "seq " << s;
    }
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t r = 0; r < one.nq; ++r) {
        const int64_t idx = p.varlen() ? h * total_q + q0 + r : (s * p.hq + h) * p.nq + r;
        ASSERT_EQ(f.lse[idx], fo.lse[h * one.nq + r]);
        ASSERT_EQ(f.slots[idx], fo.slots[h * one.nq + r]);
        ASSERT_EQ(b.slots[idx], bo.slots[h * one.nq + r]);
      }
    // Tile masks: the batch's [n_q_tiles, n_k_tiles] grid covers the sequence's own grid.
    for (int64_t h = 0; h < p.hq; ++h)
      for (int64_t i = 0; i < f.n_q_tiles; ++i)
        for (int64_t j = 0; j < f.n_k_tiles; ++j) {
          const uint8_t want = (i < fo.n_q_tiles && j < fo.n_k_tiles)
                                   ? fo.mask[(h * fo.n_q_tiles + i) * fo.n_k_tiles + j] : mala::kTileIllegal;
          ASSERT_EQ(f.mask[((s * p.hq + h) * f.n_q_tiles + i) * f.n_k_tiles + j], want) << s << " " << i << "," << j;
        }
  }
}

TEST(Layout, VarlenEqualsSequencesAlone) {
  Problem p = sharp_problem(0, 0, 4, 2, 51);
  p.batch = 4;
  p.cu_q = {0, 100, 100, 130, 230};    // an empty query sequence; Nq > Nk and Nq < Nk mixed
  p.cu_k = {0, 150, 190, 210, 290};
  p.nq = 100;
  p.nk = 150;
  p.randomize(51);
  add_locality(p);
  expect_batch_equals_alone(p);
  p.causal = false;
  expect_batch_equals_alone(p);
}

TEST(Layout, DenseBatchEqualsSequencesAlone) {
  Problem p = sharp_problem(90, 130, 2, 1, 52);
  p.batch = 3;
  p.randomize(52);
  add_locality(p);
  expect_batch_equals_alone(p);
}

// Copies contiguous [rows, heads, d] into a strided buffer (batch, row, head strides).
std::vector<float> to_strided(const std::vector<float>& x, int64_t batch, int64_t seqlen, int64_t heads, int64_t d,
                              mala::Strides s, float fill) {
  const int64_t size = (batch - 1) * s.batch + (seqlen - 1) * s.row + (heads - 1) * s.head + d;
  std::vector<float> out(size, fill);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < seqlen; ++r)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < d; ++c)
          out[b * s.batch + r * s.row + h * s.head + c] = x[((b * seqlen + r) * heads + h) * d + c];
  return out;
}
std::vector<float> from_strided(const std::vector<float>& x, int64_t batch, int64_t seqlen, int64_t heads, int64_t d,
                                mala::Strides s) {
  std::vector<float> out(batch * seqlen * heads * d);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < seqlen; ++r)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < d; ++c)
          out[((b * seqlen + r) * heads + h) * d + c] = x[b * s.batch + r * s.row + h * s.head + c];
  return out;
}

TEST(Layout, StridedEqualsContiguous) {
  Problem p = sharp_problem(70, 90, 4, 2, 61);
  p.batch = 2;
  p.randomize(61);
  add_locality(p);
  const int64_t d = p.d;
  // q, o, dq: [batch, heads, seqlen, d] (BHSD); k, dk: padded rows; v, dv: padded heads; dout: batch-last gap.
  const mala::Strides qs{p.hq * p.nq * d, d, p.nq * d};
  const mala::Strides ks{p.nk * (p.hkv * d + 5) + 3, p.hkv * d + 5, d};
  const mala::Strides vs{0, 0, d + 7};  // partly set: row and batch filled in from the head stride
  const mala::Strides vs_full{p.nk * p.hkv * (d + 7), p.hkv * (d + 7), d + 7};
  const mala::Strides dos{p.nq * p.hq * d + 11, 0, 0};
  const mala::Strides dos_full{p.nq * p.hq * d + 11, p.hq * d, d};

  ForwardOut ref = run_forward(p);
  BackwardOut gref = run_backward(p, ref);

  auto q = to_strided(p.q, p.batch, p.nq, p.hq, d, qs, NAN);
  auto k = to_strided(p.k, p.batch, p.nk, p.hkv, d, ks, NAN);
  auto v = to_strided(p.v, p.batch, p.nk, p.hkv, d, vs_full, NAN);
  auto dout = to_strided(p.dout, p.batch, p.nq, p.hq, d, dos_full, NAN);
  std::vector<float> o(q.size(), -7.f), lse(ref.lse.size());
  mala::ForwardArgs a = p.forward_args();
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.o = o.data();
  a.lse = lse.data();
  a.q_strides = a.o_strides = qs;
  a.k_strides = ks;
  a.v_strides = vs;
  ASSERT_TRUE(mala::forward(a).ok);
  EXPECT_EQ(from_strided(o, p.batch, p.nq, p.hq, d, qs), ref.o);
  EXPECT_EQ(lse, ref.lse);

  std::vector<float> dq(q.size(), -7.f), dk(k.size(), -7.f), dv(v.size(), -7.f);
  mala::BackwardArgs ba = p.backward_args();
  ba.q = q.data();
  ba.k = k.data();
  ba.v = v.data();
  ba.o = o.data();
  ba.dout = dout.data();
  ba.lse = lse.data();
  ba.dq = dq.data();
  ba.dk = dk.data();
  ba.dv = dv.data();
  ba.q_strides = ba.o_strides = ba.dq_strides = qs;
  ba.k_strides = ba.dk_strides = ks;
  ba.v_strides = ba.dv_strides = vs;
  ba.dout_strides = dos;
  ASSERT_TRUE(mala::backward(ba).ok);
  EXPECT_EQ(from_strided(dq, p.batch, p.nq, p.hq, d, qs), gref.dq);
  EXPECT_EQ(from_strided(dk, p.batch, p.nk, p.hkv, d, ks), gref.dk);
  EXPECT_EQ(from_strided(dv, p.batch, p.nk, p.hkv, d, vs_full), gref.dv);
  EXPECT_EQ(dk[3 + p.hkv * d], -7.f) << "padding between rows must stay untouched";
}

// ---- 16-bit storage ------------------------------------------------------------------------

TEST(Conversion, HalfRoundTripsEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = mala::layout::half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(mala::layout::half_to_float(mala::layout::float_to_half(f))));
      continue;
    }
    ASSERT_EQ(mala::layout::float_to_half(f), h) << std::hex << h;
  }
  EXPECT_EQ(mala::layout::half_to_float(0x3c00), 1.f);
  EXPECT_EQ(mala::layout::half_to_float(0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(mala::layout::half_to_float(0x7bff), 65504.f);
}

TEST(Conversion, HalfAndBf16RoundToNearestEven) {
  using namespace mala::layout;
  EXPECT_EQ(float_to_half(65519.f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.f), 0x7c00);  // ties to even: overflow to inf
  EXPECT_EQ(float_to_half(std::ldexp(1.f, -25)), 0x0000);  // tie between 0 and 2^-24: even
  EXPECT_EQ(float_to_half(std::ldexp(3.f, -25)), 0x0002);  // tie between 1 and 2 ulps: even
  EXPECT_EQ(float_to_half(1.f + std::ldexp(1.f, -11)), 0x3c00);  // tie: stays 1
  EXPECT_EQ(float_to_half(1.f + std::ldexp(3.f, -11)), 0x3c02);  // tie: up to even
  EXPECT_EQ(float_to_half(-2.f), 0xc000);
  EXPECT_EQ(float_to_bf16(1.f + std::ldexp(1.f, -8)), 0x3f80);  // tie: stays 1
  EXPECT_EQ(float_to_bf16(1.f + std::ldexp(3.f, -8)), 0x3f82);  // tie: up to even
  EXPECT_EQ(float_to_bf16(1.f + std::ldexp(5.f, -10)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-INFINITY)), -INFINITY);
}

// A 16-bit run equals the fp32 run on the same rounded inputs, with the outputs rounded once.
TEST(Conversion, SixteenBitForwardBackwardEqualFp32OnRoundedInputs) {
  for (mala::DType t : {mala::DType::f16, mala::DType::bf16}) {
    Problem p = sharp_problem(100, 120, 2, 1, 71);
    auto to16 = [&](std::vector<float>& x) {
      std::vector<uint16_t> bits(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        bits[i] = t == mala::DType::f16 ? mala::layout::float_to_half(x[i]) : mala::layout::float_to_bf16(x[i]);
        x[i] = t == mala::DType::f16 ? mala::layout::half_to_float(bits[i]) : mala::layout::bf16_to_float(bits[i]);
      }
      return bits;
    };
    auto round16 = [&](const std::vector<float>& x) {
      std::vector<uint16_t> bits(x.size());
      for (size_t i = 0; i < x.size(); ++i)
        bits[i] = t == mala::DType::f16 ? mala::layout::float_to_half(x[i]) : mala::layout::float_to_bf16(x[i]);
      return bits;
    };
    auto q = to16(p.q), k = to16(p.k), v = to16(p.v), dout = to16(p.dout);
    ForwardOut ref = run_forward(p);
    std::vector<uint16_t> o(q.size());
    std::vector<float> lse(ref.lse.size());
    mala::ForwardArgs a = p.forward_args();
    a.dtype = t;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.o = o.data();
    a.lse = lse.data();
    ASSERT_TRUE(mala::forward(a).ok);
    EXPECT_EQ(o, round16(ref.o));
    EXPECT_EQ(lse, ref.lse);

    // Backward reads the stored (rounded) O, so the fp32 twin gets the rounded O too.
    ForwardOut ref_rounded = ref;
    for (size_t i = 0; i < o.size(); ++i)
      ref_rounded.o[i] = t == mala::DType::f16 ? mala::layout::half_to_float(o[i]) : mala::layout::bf16_to_float(o[i]);
    BackwardOut gref = run_backward(p, ref_rounded);
    std::vector<uint16_t> dq(q.size()), dk(k.size()), dv(v.size());
    mala::BackwardArgs ba = p.backward_args();
    ba.dtype = t;
    ba.q = q.data();
    ba.k = k.data();
    ba.v = v.data();
    ba.o = o.data();
    ba.dout = dout.data();
    ba.lse = lse.data();
    ba.dq = dq.data();
    ba.dk = dk.data();
    ba.dv = dv.data();
    ASSERT_TRUE(mala::backward(ba).ok);
    EXPECT_EQ(dq, round16(gref.dq));
    EXPECT_EQ(dk, round16(gref.dk));
    EXPECT_EQ(dv, round16(gref.dv));
  }
}

}  // namespace

namespace {

// Tiles larger than the sequence are one tile: no giant allocations, same result as block = N.
TEST(Layout, BlocksLargerThanTheSequenceAreOneTile) {
  Problem p = sharp_problem(50, 70, 2, 1, 81);
  p.bq = 50;
  p.bk = 70;
  ForwardOut exact = run_forward(p);
  BackwardOut gexact = run_backward(p, exact);
  p.bq = p.bk = 1 << 30;
  ForwardOut huge = run_forward(p);
  BackwardOut ghuge = run_backward(p, huge);
  EXPECT_EQ(huge.o, exact.o);
  EXPECT_EQ(huge.lse, exact.lse);
  EXPECT_EQ(huge.mask, exact.mask);
  EXPECT_EQ(ghuge.dq, gexact.dq);
  EXPECT_EQ(ghuge.dk, gexact.dk);
  for (int32_t s : huge.slots) EXPECT_EQ(s, 1 << 30);  // Bk per retained tile, by definition
}

}  // namespace

#include <omp.h>

namespace {

// Results do not depend on the number of threads (every output has one writer, fixed order).
TEST(Layout, DeterministicAcrossThreadCounts) {
  Problem p = sharp_problem(300, 300, 4, 2, 91);
  p.batch = 2;
  p.randomize(91);
  add_locality(p);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(std::max(threads, 3));
  ForwardOut f_many = run_forward(p);
  BackwardOut b_many = run_backward(p, f_many);
  omp_set_num_threads(1);
  ForwardOut f_one = run_forward(p);
  BackwardOut b_one = run_backward(p, f_one);
  omp_set_num_threads(threads);
  EXPECT_EQ(f_many.o, f_one.o);
  EXPECT_EQ(f_many.lse, f_one.lse);
  EXPECT_EQ(f_many.mask, f_one.mask);
  EXPECT_EQ(b_many.dq, b_one.dq);
  EXPECT_EQ(b_many.dk, b_one.dk);
  EXPECT_EQ(b_many.dv, b_one.dv);
  EXPECT_EQ(b_many.mask, b_one.mask);
}

}  // namespace
