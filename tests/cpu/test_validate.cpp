// Bad input: every class of argument error returns !ok, names the argument first in the message,
// and leaves every output buffer (pre-filled with a sentinel) untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "test_util.h"

using namespace mala_test;

namespace {

constexpr float kSentinel = 12345.f;

struct Bad {
  const char* what;      // description
  const char* argument;  // the message must start with "<argument>:"
  std::function<void(mala::ForwardArgs&)> mutate;
};

// `argument` may list alternatives separated by '|'.
bool names(const mala::Status& s, const std::string& argument) {
  if (s.ok) return false;
  size_t start = 0;
  while (true) {
    const size_t bar = argument.find('|', start);
    const std::string one = argument.substr(start, bar == std::string::npos ? std::string::npos : bar - start);
    if (s.message.rfind(one + ":", 0) == 0) return true;
    if (bar == std::string::npos) return false;
    start = bar + 1;
  }
}

Problem small() {
  Problem p;
  p.nq = p.nk = 16;
  p.hq = 2;
  p.hkv = 1;
  p.d = 8;
  p.randomize(1);
  return p;
}

const int32_t kCuGood[] = {0, 8, 16};
const int32_t kCuNotZero[] = {1, 8, 16};
const int32_t kCuDecreasing[] = {0, 9, 8};
const int32_t kCuTooLong[] = {0, 2, 16};  // second sequence has 14 > seqlen 8

TEST(Validate, ForwardRejectsEachBadArgumentAndWritesNothing) {
  const Problem p = small();
  std::vector<Bad> cases = {
      {"null q", "q", [](mala::ForwardArgs& a) { a.q = nullptr; }},
      {"null k", "k", [](mala::ForwardArgs& a) { a.k = nullptr; }},
      {"null v", "v", [](mala::ForwardArgs& a) { a.v = nullptr; }},
      {"null o", "o", [](mala::ForwardArgs& a) { a.o = nullptr; }},
      {"batch 0", "batch", [](mala::ForwardArgs& a) { a.batch = 0; }},
      {"seqlen_q 0", "seqlen_q", [](mala::ForwardArgs& a) { a.seqlen_q = 0; }},
      {"seqlen_k negative", "seqlen_k", [](mala::ForwardArgs& a) { a.seqlen_k = -3; }},
      {"heads_q 0", "heads_q", [](mala::ForwardArgs& a) { a.heads_q = 0; }},
      {"heads_kv 0", "heads_kv", [](mala::ForwardArgs& a) { a.heads_kv = 0; }},
      {"heads not divisible", "heads_q", [](mala::ForwardArgs& a) { a.heads_q = 3; a.heads_kv = 2; }},
      {"head_dim 0", "head_dim", [](mala::ForwardArgs& a) { a.head_dim = 0; }},
      {"head_dim too large for cpu", "head_dim", [](mala::ForwardArgs& a) { a.head_dim = 513; }},
      {"head_dim not a cuda size", "head_dim", [](mala::ForwardArgs& a) { a.device = mala::Device::cuda; a.dtype = mala::DType::bf16; a.head_dim = 96; }},
      {"f32 on cuda", "dtype", [](mala::ForwardArgs& a) { a.device = mala::Device::cuda; }},
      // A CPU-only build says "device: built without CUDA"; a CUDA build names the host pointer q.
      {"cuda pointers on a cpu build or host memory", "device|q", [](mala::ForwardArgs& a) { a.device = mala::Device::cuda; a.dtype = mala::DType::bf16; a.head_dim = 64; }},
      {"unknown dtype", "dtype", [](mala::ForwardArgs& a) { a.dtype = static_cast<mala::DType>(7); }},
      {"unknown device", "device", [](mala::ForwardArgs& a) { a.device = static_cast<mala::Device>(5); }},
      {"tau negative", "tau", [](mala::ForwardArgs& a) { a.tau = -1.f; }},
      {"tau NaN", "tau", [](mala::ForwardArgs& a) { a.tau = NAN; }},
      {"tau inf", "tau", [](mala::ForwardArgs& a) { a.tau = INFINITY; }},
      {"scale negative", "softmax_scale", [](mala::ForwardArgs& a) { a.softmax_scale = -0.5f; }},
      {"scale NaN", "softmax_scale", [](mala::ForwardArgs& a) { a.softmax_scale = NAN; }},
      {"block_q negative", "block_q", [](mala::ForwardArgs& a) { a.block_q = -1; }},
      {"block_k negative", "block_k", [](mala::ForwardArgs& a) { a.block_k = -64; }},
      {"negative stride", "k_strides", [](mala::ForwardArgs& a) { a.k_strides.row = -8; }},
      {"head stride < head_dim", "q_strides", [](mala::ForwardArgs& a) { a.q_strides.head = 4; }},
      {"rows overlap heads", "o_strides", [](mala::ForwardArgs& a) { a.o_strides = {0, 8, 8}; }},
      {"batches overlap", "v_strides", [](mala::ForwardArgs& a) { a.batch = 2; a.v_strides = {64, 8, 8}; }},
      {"only cu_seqlens_q", "cu_seqlens_k", [](mala::ForwardArgs& a) { a.cu_seqlens_q = kCuGood; }},
      {"only cu_seqlens_k", "cu_seqlens_q", [](mala::ForwardArgs& a) { a.cu_seqlens_k = kCuGood; }},
      {"cu_seqlens not from 0", "cu_seqlens_q", [](mala::ForwardArgs& a) { a.batch = 2; a.seqlen_q = a.seqlen_k = 8; a.cu_seqlens_q = kCuNotZero; a.cu_seqlens_k = kCuGood; }},
      {"cu_seqlens decreasing", "cu_seqlens_k", [](mala::ForwardArgs& a) { a.batch = 2; a.seqlen_q = a.seqlen_k = 8; a.cu_seqlens_q = kCuGood; a.cu_seqlens_k = kCuDecreasing; }},
      {"varlen sequence longer than seqlen", "cu_seqlens_q", [](mala::ForwardArgs& a) { a.batch = 2; a.seqlen_q = a.seqlen_k = 8; a.cu_seqlens_q = kCuTooLong; a.cu_seqlens_k = kCuGood; }},
      {"total_k without varlen", "total_k", [](mala::ForwardArgs& a) { a.total_k = 16; }},
      {"total_k negative", "total_k", [](mala::ForwardArgs& a) { a.batch = 2; a.seqlen_q = a.seqlen_k = 8; a.cu_seqlens_q = a.cu_seqlens_k = kCuGood; a.total_k = -1; }},
      {"total_k below seqlen_k", "total_k|cu_seqlens_k", [](mala::ForwardArgs& a) { a.batch = 2; a.seqlen_q = a.seqlen_k = 8; a.cu_seqlens_q = a.cu_seqlens_k = kCuGood; a.total_k = 4; }},
      {"total_k below cu_seqlens_k[batch]", "cu_seqlens_k", [](mala::ForwardArgs& a) { a.batch = 2; a.seqlen_q = a.seqlen_k = 8; a.cu_seqlens_q = a.cu_seqlens_k = kCuGood; a.total_k = 12; }},
  };
  for (const Bad& c : cases) {
    std::vector<float> o(p.q.size(), kSentinel), lse(p.hq * p.nq, kSentinel);
    std::vector<int32_t> slots(lse.size(), 7);
    std::vector<uint8_t> mask(64, 9);
    mala::ForwardArgs a = p.forward_args();
    a.o = o.data();
    a.lse = lse.data();
    a.fwd_slots = slots.data();
    a.tile_mask = mask.data();
    c.mutate(a);
    const mala::Status s = mala::forward(a);
    EXPECT_TRUE(names(s, c.argument)) << c.what << ": got ok=" << s.ok << " \"" << s.message << "\"";
    EXPECT_TRUE(names(mala::check(a), c.argument)) << c.what;
    if (a.dtype == mala::DType::f32 && a.device == mala::Device::cpu && a.head_dim > 0 && a.head_dim <= 512) {
      mala::Status r = mala::reference::dense_forward(a);
      EXPECT_FALSE(r.ok) << c.what;
    }
    for (float x : o) ASSERT_EQ(x, kSentinel) << c.what;
    for (float x : lse) ASSERT_EQ(x, kSentinel) << c.what;
    for (int32_t x : slots) ASSERT_EQ(x, 7) << c.what;
    for (uint8_t x : mask) ASSERT_EQ(x, 9) << c.what;
  }
  // The valid arguments themselves pass, and empty varlen sequences are allowed.
  std::vector<float> o(p.q.size()), lse(p.hq * p.nq);
  mala::ForwardArgs a = p.forward_args();
  a.o = o.data();
  a.lse = lse.data();
  EXPECT_TRUE(mala::forward(a).ok);
  static const int32_t cu_empty[] = {0, 0, 16};
  a.batch = 2;
  a.cu_seqlens_q = cu_empty;
  a.cu_seqlens_k = kCuGood;
  a.seqlen_k = 8;
  const mala::Status s = mala::forward(a);
  EXPECT_TRUE(s.ok) << s.message;
  a.total_k = 16;  // the packed rows, as flash_attn's k.shape[0]
  EXPECT_TRUE(mala::forward(a).ok);
}

TEST(Validate, BackwardRejectsBadArgumentsAndWritesNothing) {
  const Problem p = small();
  const ForwardOut f = run_forward(p);
  struct BadB {
    const char* what;
    const char* argument;
    std::function<void(mala::BackwardArgs&)> mutate;
  };
  std::vector<BadB> cases = {
      {"null dout", "dout", [](mala::BackwardArgs& a) { a.dout = nullptr; }},
      {"null lse", "lse", [](mala::BackwardArgs& a) { a.lse = nullptr; }},
      {"null o", "o", [](mala::BackwardArgs& a) { a.o = nullptr; }},
      {"null dq", "dq", [](mala::BackwardArgs& a) { a.dq = nullptr; }},
      {"null dk", "dk", [](mala::BackwardArgs& a) { a.dk = nullptr; }},
      {"null dv", "dv", [](mala::BackwardArgs& a) { a.dv = nullptr; }},
      {"tau negative", "tau", [](mala::BackwardArgs& a) { a.tau = -0.1f; }},
      {"heads not divisible", "heads_q", [](mala::BackwardArgs& a) { a.heads_kv = 3; }},
      {"dq strides overlap", "dq_strides", [](mala::BackwardArgs& a) { a.dq_strides = {0, 4, 0}; }},
      {"dout strides negative", "dout_strides", [](mala::BackwardArgs& a) { a.dout_strides.batch = -1; }},
      {"block_k negative", "block_k", [](mala::BackwardArgs& a) { a.block_k = -2; }},
      {"total_q without varlen", "total_q", [](mala::BackwardArgs& a) { a.total_q = 16; }},
      {"total_k without varlen", "total_k", [](mala::BackwardArgs& a) { a.total_k = 16; }},
  };
  for (const auto& c : cases) {
    std::vector<float> dq(p.q.size(), kSentinel), dk(p.k.size(), kSentinel), dv(p.v.size(), kSentinel);
    std::vector<int32_t> slots(p.hq * p.nq, 7);
    std::vector<uint8_t> mask(64, 9);
    mala::BackwardArgs a = p.backward_args();
    a.o = f.o.data();
    a.lse = f.lse.data();
    a.dq = dq.data();
    a.dk = dk.data();
    a.dv = dv.data();
    a.bwd_slots = slots.data();
    a.tile_mask = mask.data();
    c.mutate(a);
    const mala::Status s = mala::backward(a);
    EXPECT_TRUE(names(s, c.argument)) << c.what << ": \"" << s.message << "\"";
    for (float x : dq) ASSERT_EQ(x, kSentinel) << c.what;
    for (float x : dk) ASSERT_EQ(x, kSentinel) << c.what;
    for (float x : dv) ASSERT_EQ(x, kSentinel) << c.what;
    for (int32_t x : slots) ASSERT_EQ(x, 7) << c.what;
    for (uint8_t x : mask) ASSERT_EQ(x, 9) << c.what;
  }
}

TEST(Validate, DecodeRejectsBadArgumentsAndWritesNothing) {
  const int64_t d = 8, cap = 32, hkv = 1, hq = 2;
  std::vector<float> q = randn(hq * d, 1), kc = randn(cap * hkv * d, 2), vc = randn(cap * hkv * d, 3);
  std::vector<float> kn = randn(2 * hkv * d, 4), vn = randn(2 * hkv * d, 5);
  static const int32_t seqlens[] = {20};
  static const int32_t seqlens_full[] = {31};
  static const int32_t seqlens_negative[] = {-1};
  static const int32_t table[] = {0, 1, 5, 3};
  static const int32_t table_bad[] = {0, 1, 9, 3};
  struct BadD {
    const char* what;
    const char* argument;
    std::function<void(mala::DecodeArgs&)> mutate;
  };
  auto paged = [](mala::DecodeArgs& a) {
    a.cache_capacity = 0;
    a.block_table = table;
    a.max_pages = 4;
    a.page_size = 8;
    a.num_pages = 4;
  };
  std::vector<BadD> cases = {
      {"null cache_seqlens", "cache_seqlens", [](mala::DecodeArgs& a) { a.cache_seqlens = nullptr; }},
      {"null q", "q", [](mala::DecodeArgs& a) { a.q = nullptr; }},
      {"null k_cache", "k_cache", [](mala::DecodeArgs& a) { a.k_cache = nullptr; }},
      {"seqlen_q 0", "seqlen_q", [](mala::DecodeArgs& a) { a.seqlen_q = 0; }},
      {"k_new without v_new", "v_new", [](mala::DecodeArgs& a) { a.v_new = nullptr; }},
      {"v_new without k_new", "k_new", [](mala::DecodeArgs& a) { a.k_new = nullptr; }},
      {"seqlen_new without k_new/v_new", "k_new", [](mala::DecodeArgs& a) { a.k_new = a.v_new = nullptr; }},
      {"seqlen_new negative", "seqlen_new", [](mala::DecodeArgs& a) { a.seqlen_new = -1; }},
      {"num_splits negative", "num_splits", [](mala::DecodeArgs& a) { a.num_splits = -1; }},
      {"cache_capacity 0", "cache_capacity", [](mala::DecodeArgs& a) { a.cache_capacity = 0; }},
      {"cache overflows", "cache_seqlens", [](mala::DecodeArgs& a) { a.cache_seqlens = seqlens_full; }},
      {"cache_seqlens negative", "cache_seqlens", [](mala::DecodeArgs& a) { a.cache_seqlens = seqlens_negative; }},
      {"page_size 0", "page_size", [&](mala::DecodeArgs& a) { paged(a); a.page_size = 0; }},
      {"block_table without max_pages", "max_pages", [&](mala::DecodeArgs& a) { paged(a); a.max_pages = 0; }},
      {"num_pages missing", "num_pages", [&](mala::DecodeArgs& a) { paged(a); a.num_pages = 0; }},
      {"page args without block_table", "block_table", [](mala::DecodeArgs& a) { a.page_size = 8; }},
      {"block_table_stride < max_pages", "block_table_stride", [&](mala::DecodeArgs& a) { paged(a); a.block_table_stride = 2; }},
      {"block_table entry out of range", "block_table", [&](mala::DecodeArgs& a) { paged(a); a.num_pages = 4; a.block_table = table_bad; }},
      {"tau NaN", "tau", [](mala::DecodeArgs& a) { a.tau = NAN; }},
      {"heads not divisible", "heads_q", [](mala::DecodeArgs& a) { a.heads_kv = 4; }},
      {"cache strides overlap", "k_cache_strides", [](mala::DecodeArgs& a) { a.k_cache_strides.row = 3; }},
      {"block_q negative", "block_q", [](mala::DecodeArgs& a) { a.block_q = -1; }},
  };
  for (const auto& c : cases) {
    std::vector<float> kc2 = kc, vc2 = vc;
    kc2.resize(4 * 8 * d, 0.f);  // room for the paged variants
    vc2.resize(4 * 8 * d, 0.f);
    const std::vector<float> kc_before = kc2, vc_before = vc2;
    std::vector<float> o(hq * d, kSentinel), lse(hq, kSentinel);
    std::vector<int32_t> slots(hq, 7);
    std::vector<uint8_t> mask(64, 9);
    mala::DecodeArgs a;
    a.q = q.data();
    a.k_cache = kc2.data();
    a.v_cache = vc2.data();
    a.cache_seqlens = seqlens;
    a.cache_capacity = cap;
    a.k_new = kn.data();
    a.v_new = vn.data();
    a.seqlen_new = 2;
    a.heads_q = hq;
    a.heads_kv = hkv;
    a.head_dim = d;
    a.o = o.data();
    a.lse = lse.data();
    a.fwd_slots = slots.data();
    a.tile_mask = mask.data();
    {  // the unmutated arguments are valid
      mala::DecodeArgs ok = a;
      std::vector<float> kc3 = kc2, vc3 = vc2, o3(o.size());
      ok.k_cache = kc3.data();
      ok.v_cache = vc3.data();
      ok.o = o3.data();
      ok.lse = nullptr;
      ok.fwd_slots = nullptr;
      ok.tile_mask = nullptr;
      const mala::Status s = mala::decode(ok);
      ASSERT_TRUE(s.ok) << s.message;
    }
    c.mutate(a);
    const mala::Status s = mala::decode(a);
    EXPECT_TRUE(names(s, c.argument)) << c.what << ": \"" << s.message << "\"";
    EXPECT_EQ(kc2, kc_before) << c.what << ": the cache must not be written";
    EXPECT_EQ(vc2, vc_before) << c.what;
    for (float x : o) ASSERT_EQ(x, kSentinel) << c.what;
    for (float x : lse) ASSERT_EQ(x, kSentinel) << c.what;
    for (int32_t x : slots) ASSERT_EQ(x, 7) << c.what;
    for (uint8_t x : mask) ASSERT_EQ(x, 9) << c.what;
  }
}

// Outputs that share memory with an input (or another output) are rejected, named, before anything
// is written: without the check each of these calls runs and overwrites its own input.
TEST(Validate, ForwardRejectsOutputsOverlappingInputs) {
  const Problem p = small();
  struct Case {
    const char* what;
    const char* message;
    std::function<void(mala::ForwardArgs&, std::vector<float>& buf)> mutate;
  };
  // buf holds q (first p.q.size() floats) followed by spare room; the inputs are copies in it.
  const std::vector<Case> cases = {
      {"o is q", "o: overlaps q", [](mala::ForwardArgs& a, std::vector<float>&) { a.o = const_cast<void*>(a.q); }},
      {"o starts inside q", "o: overlaps q",
       [&](mala::ForwardArgs& a, std::vector<float>& buf) { a.o = buf.data() + p.q.size() - 8; }},
      {"o is v", "o: overlaps v", [](mala::ForwardArgs& a, std::vector<float>&) { a.o = const_cast<void*>(a.v); }},
      {"lse inside k", "lse: overlaps k",
       [](mala::ForwardArgs& a, std::vector<float>&) { a.lse = const_cast<float*>(static_cast<const float*>(a.k)) + 3; }},
      {"fwd_slots is lse", "fwd_slots: overlaps lse",
       [](mala::ForwardArgs& a, std::vector<float>&) { a.fwd_slots = reinterpret_cast<int32_t*>(a.lse); }},
      {"tile_mask inside o", "tile_mask: overlaps o",
       [](mala::ForwardArgs& a, std::vector<float>&) { a.tile_mask = static_cast<uint8_t*>(a.o) + 1; }},
  };
  for (const Case& c : cases) {
    std::vector<float> buf(p.q.size() + 2 * p.q.size(), kSentinel);
    std::copy(p.q.begin(), p.q.end(), buf.begin());
    std::vector<float> k = p.k, v = p.v, o(p.q.size(), kSentinel), lse(p.hq * p.nq, kSentinel);
    std::vector<int32_t> slots(lse.size(), 7);
    std::vector<uint8_t> mask(64, 9);
    mala::ForwardArgs a = p.forward_args();
    a.q = buf.data(), a.k = k.data(), a.v = v.data();
    a.o = o.data(), a.lse = lse.data(), a.fwd_slots = slots.data(), a.tile_mask = mask.data();
    c.mutate(a, buf);
    const std::vector<float> buf_before = buf;
    const mala::Status s = mala::forward(a);
    EXPECT_FALSE(s.ok) << c.what;
    EXPECT_EQ(s.message, c.message) << c.what;
    EXPECT_EQ(buf, buf_before) << c.what << ": q was written";
    EXPECT_EQ(k, p.k) << c.what;
    EXPECT_EQ(v, p.v) << c.what;
    for (float x : o) ASSERT_EQ(x, kSentinel) << c.what;
    for (float x : lse) ASSERT_EQ(x, kSentinel) << c.what;
    EXPECT_FALSE(mala::check(a).ok) << c.what;
  }
}

TEST(Validate, BackwardRejectsOutputsOverlappingInputsOrEachOther) {
  const Problem p = small();
  const ForwardOut f = run_forward(p);
  struct Case {
    const char* what;
    const char* message;
    std::function<void(mala::BackwardArgs&)> mutate;
  };
  const std::vector<Case> cases = {
      {"dq is q", "dq: overlaps q", [](mala::BackwardArgs& a) { a.dq = const_cast<void*>(a.q); }},
      {"dq is dout", "dq: overlaps dout", [](mala::BackwardArgs& a) { a.dq = const_cast<void*>(a.dout); }},
      {"dq is o", "dq: overlaps o", [](mala::BackwardArgs& a) { a.dq = const_cast<void*>(a.o); }},
      {"dk is k", "dk: overlaps k", [](mala::BackwardArgs& a) { a.dk = const_cast<void*>(a.k); }},
      {"dv inside v", "dv: overlaps v",
       [](mala::BackwardArgs& a) { a.dv = const_cast<float*>(static_cast<const float*>(a.v)) + 5; }},
      {"dv is dk", "dv: overlaps dk", [](mala::BackwardArgs& a) { a.dv = a.dk; }},
      {"dk is dq", "dk: overlaps dq", [](mala::BackwardArgs& a) { a.dk = a.dq; }},
      {"dq holds lse", "dq: overlaps lse",
       [](mala::BackwardArgs& a) { a.dq = const_cast<float*>(a.lse) + 1; }},
      {"bwd_slots inside dq", "bwd_slots: overlaps dq",
       [](mala::BackwardArgs& a) { a.bwd_slots = static_cast<int32_t*>(a.dq) + 2; }},
  };
  for (const auto& c : cases) {
    // Inputs and outputs live in one arena so that pointers into neighbours stay inside it.
    const size_t nq = p.q.size(), nk = p.k.size(), nl = f.lse.size();
    std::vector<float> arena(16 + 4 * nq + 2 * nk + nl + 3 * nk + nq + 16, kSentinel);
    float* x = arena.data() + 16;
    auto place = [&](const std::vector<float>& src) {
      float* at = x;
      std::copy(src.begin(), src.end(), at);
      x += src.size();
      return at;
    };
    mala::BackwardArgs a = p.backward_args();
    a.q = place(p.q), a.k = place(p.k), a.v = place(p.v), a.o = place(f.o), a.dout = place(p.dout);
    a.lse = place(f.lse);
    a.dq = x, x += nq;
    a.dk = x, x += nk;
    a.dv = x, x += nk;
    std::vector<int32_t> slots(p.hq * p.nq, 7);
    a.bwd_slots = slots.data();
    c.mutate(a);
    const std::vector<float> before = arena;
    const mala::Status s = mala::backward(a);
    EXPECT_FALSE(s.ok) << c.what;
    EXPECT_EQ(s.message, c.message) << c.what;
    EXPECT_EQ(arena, before) << c.what << ": something was written";
    for (int32_t v : slots) ASSERT_EQ(v, 7) << c.what;
  }
}

// dq, dk, dv (and q, k, v) as interleaved views of one packed [N, 3, H, d] tensor, as flash_attn's
// qkvpacked functions pass them: their extents interleave but no element is shared, so they are
// accepted, and the results equal those of separate buffers.
TEST(Validate, PackedInterleavedViewsAreNotOverlaps) {
  Problem p = small();
  p.hkv = p.hq;  // [N, 3, H, d]
  p.randomize(3);
  const int64_t n = p.nq, h = p.hq, d = p.d, row = 3 * h * d;
  std::vector<float> qkv(n * row), dqkv(n * row, kSentinel);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < h * d; ++i) {
      qkv[t * row + i] = p.q[t * h * d + i];
      qkv[t * row + h * d + i] = p.k[t * h * d + i];
      qkv[t * row + 2 * h * d + i] = p.v[t * h * d + i];
    }
  const ForwardOut f = run_forward(p);
  const BackwardOut ref = run_backward(p, f);
  mala::BackwardArgs a = p.backward_args();
  a.q = qkv.data(), a.k = qkv.data() + h * d, a.v = qkv.data() + 2 * h * d;
  a.q_strides = a.k_strides = a.v_strides = {0, row, 0};
  a.o = f.o.data(), a.lse = f.lse.data();
  a.dq = dqkv.data(), a.dk = dqkv.data() + h * d, a.dv = dqkv.data() + 2 * h * d;
  a.dq_strides = a.dk_strides = a.dv_strides = {0, row, 0};
  const mala::Status s = mala::backward(a);
  ASSERT_TRUE(s.ok) << s.message;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < h * d; ++i) {
      ASSERT_EQ(dqkv[t * row + i], ref.dq[t * h * d + i]);
      ASSERT_EQ(dqkv[t * row + h * d + i], ref.dk[t * h * d + i]);
      ASSERT_EQ(dqkv[t * row + 2 * h * d + i], ref.dv[t * h * d + i]);
    }
  // Shifted by one element, dk's footprint runs into dv's: rejected.
  a.dk = dqkv.data() + h * d + 1;
  EXPECT_EQ(mala::check(a).message, "dv: overlaps dk");
}

TEST(Validate, DecodeRejectsOutputsOverlappingQOrTheCache) {
  const int64_t d = 8, cap = 32, hkv = 1, hq = 2;
  std::vector<float> q = randn(hq * d, 1), kc = randn(cap * hkv * d, 2), vc = randn(cap * hkv * d, 3);
  std::vector<float> kn = randn(2 * hkv * d, 4), vn = randn(2 * hkv * d, 5);
  static const int32_t seqlens[] = {20};
  struct Case {
    const char* what;
    const char* message;
    std::function<void(mala::DecodeArgs&)> mutate;
  };
  const std::vector<Case> cases = {
      {"o is q", "o: overlaps q", [](mala::DecodeArgs& a) { a.o = const_cast<void*>(a.q); }},
      {"o inside k_cache", "o: overlaps k_cache", [](mala::DecodeArgs& a) { a.o = static_cast<float*>(a.k_cache) + 40; }},
      {"lse inside v_cache", "lse: overlaps v_cache", [](mala::DecodeArgs& a) { a.lse = static_cast<float*>(a.v_cache); }},
      {"o is k_new", "o: overlaps k_new", [](mala::DecodeArgs& a) { a.o = const_cast<void*>(a.k_new); }},
      {"fwd_slots is lse", "fwd_slots: overlaps lse", [](mala::DecodeArgs& a) { a.fwd_slots = reinterpret_cast<int32_t*>(a.lse); }},
  };
  for (const auto& c : cases) {
    std::vector<float> kc2 = kc, vc2 = vc, q2 = q, kn2 = kn;
    std::vector<float> o(hq * d, kSentinel), lse(hq, kSentinel);
    std::vector<int32_t> slots(hq, 7);
    mala::DecodeArgs a;
    a.q = q2.data(), a.k_cache = kc2.data(), a.v_cache = vc2.data(), a.cache_seqlens = seqlens;
    a.cache_capacity = cap, a.k_new = kn2.data(), a.v_new = vn.data(), a.seqlen_new = 2;
    a.heads_q = hq, a.heads_kv = hkv, a.head_dim = d;
    a.o = o.data(), a.lse = lse.data(), a.fwd_slots = slots.data();
    c.mutate(a);
    const mala::Status s = mala::decode(a);
    EXPECT_FALSE(s.ok) << c.what;
    EXPECT_EQ(s.message, c.message) << c.what;
    EXPECT_EQ(kc2, kc) << c.what << ": the cache must not be written";
    EXPECT_EQ(vc2, vc) << c.what;
    EXPECT_EQ(q2, q) << c.what;
    EXPECT_EQ(kn2, kn) << c.what;
    for (float x : o) ASSERT_EQ(x, kSentinel) << c.what;
    for (float x : lse) ASSERT_EQ(x, kSentinel) << c.what;
  }
}

// The stride test sorts a tensor's dimensions by stride (stably: equal strides keep the order
// batch, row, head), so layouts in any dimension order pass and an error names the dimension that
// runs into the ones inside it.
TEST(Validate, StridesInAnyOrderAndTheOverlappingDimensionNamed) {
  const int64_t b = 2, n = 2, hq = 2, hkv = 1, d = 8, cap = 16;
  std::vector<float> q = randn(8 * b * n * hq * d, 1), kc = randn(b * cap * hkv * d, 2), vc = kc;
  std::vector<float> o(b * n * hq * d), lse(b * hq * n);
  static const int32_t seqlens[] = {3, 7};
  struct Case {
    mala::Strides q_strides;
    const char* message;  // "" = accepted
  };
  const Case cases[] = {
      {{8, 32, 16}, ""},  // [row, head, batch, d]: every dimension steps past the ones inside it
      {{0, 8, 8}, "q_strides: head stride 8 makes elements overlap (needs >= 16 with head_dim=8)"},
      {{8, 32, 8}, "q_strides: head stride 8 makes elements overlap (needs >= 16 with head_dim=8)"},
      {{16, 4, 0}, "q_strides: row stride 4 makes elements overlap (needs >= 8 with head_dim=8)"},
  };
  for (const Case& c : cases) {
    mala::DecodeArgs a;
    a.q = q.data(), a.k_cache = kc.data(), a.v_cache = vc.data(), a.cache_seqlens = seqlens;
    a.batch = b, a.seqlen_q = n, a.cache_capacity = cap, a.heads_q = hq, a.heads_kv = hkv, a.head_dim = d;
    a.o = o.data(), a.lse = lse.data();
    a.q_strides = c.q_strides;
    const mala::Status s = mala::check(a);
    EXPECT_EQ(s.message, c.message) << c.q_strides.batch << "," << c.q_strides.row << "," << c.q_strides.head;
    EXPECT_EQ(s.ok, *c.message == '\0');
  }
}

// Device::cuda where there is no GPU (CI, this machine) or no CUDA in the build: the message says
// so, instead of blaming the first pointer ("q: not a CUDA device pointer").
TEST(Validate, CudaWithoutADeviceSaysSo) {
  if (mala::cuda_available()) GTEST_SKIP() << "a CUDA device is present";
  const Problem p = small();
  std::vector<uint16_t> q(p.q.size()), k(p.k.size()), v(p.v.size()), o(p.q.size(), 0x1234);
  mala::ForwardArgs a = p.forward_args();
  a.device = mala::Device::cuda;
  a.dtype = mala::DType::bf16;
  a.head_dim = 64;
  a.q = q.data(), a.k = k.data(), a.v = v.data(), a.o = o.data();
  auto says_no_device = [](const mala::Status& s) {
    return !s.ok && s.message.rfind("device: ", 0) == 0 &&
           (s.message.find("no CUDA device is available (cudaGetDeviceCount: ") != std::string::npos ||
            s.message.find("built without CUDA") != std::string::npos);
  };
  const mala::Status s = mala::forward(a);
  EXPECT_TRUE(says_no_device(s)) << s.message;
  for (uint16_t x : o) ASSERT_EQ(x, 0x1234);

  mala::BackwardArgs b = p.backward_args();
  b.device = mala::Device::cuda;
  b.dtype = mala::DType::bf16;
  b.head_dim = 64;
  std::vector<float> lse(64);
  b.q = q.data(), b.k = k.data(), b.v = v.data(), b.o = q.data(), b.dout = q.data(), b.lse = lse.data();
  b.dq = o.data(), b.dk = o.data() + 1, b.dv = o.data() + 2;  // never reached: no device comes first
  EXPECT_TRUE(says_no_device(mala::check(b))) << mala::check(b).message;

  mala::DecodeArgs dc;
  static const int32_t seqlens[] = {4};
  dc.device = mala::Device::cuda;
  dc.dtype = mala::DType::bf16;
  dc.head_dim = 64;
  dc.q = q.data(), dc.k_cache = k.data(), dc.v_cache = v.data(), dc.cache_seqlens = seqlens;
  dc.cache_capacity = 8, dc.o = o.data();
  EXPECT_TRUE(says_no_device(mala::check(dc))) << mala::check(dc).message;
}

TEST(Validate, ReferenceTakesFloat32CpuOnly) {
  const Problem p = small();
  std::vector<uint16_t> q(p.q.size()), k(p.k.size()), v(p.v.size()), o(p.q.size(), 0x1234);
  mala::ForwardArgs a = p.forward_args();
  a.dtype = mala::DType::bf16;
  a.q = q.data();
  a.k = k.data();
  a.v = v.data();
  a.o = o.data();
  EXPECT_TRUE(names(mala::reference::dense_forward(a), "dtype"));
  for (uint16_t x : o) ASSERT_EQ(x, 0x1234);
}

}  // namespace
