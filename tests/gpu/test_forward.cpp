// CUDA forward vs the exact CPU implementation (src/cpu) on the same bf16/fp16-rounded inputs, with
// the kernel's own tiles (forward_tiles) so the CPU reproduces its skip decisions.
// Checks: tile_mask equal except rare near-threshold flips (counted, < 0.1% of legal tiles), O rel L2
// < 1e-2 against the CPU's fp32 O, lse close, fwd_slots consistent with the kernel's tile_mask, every
// output written (poisoned buffers), no NaN.
// Every test that runs kernels runs once per forward kernel (the kernel override of
// src/cuda/backend.h, a test parameter), two in all: the dispatch's own choice (on sm_90 the
// 128-key kernel, and the mma.sync kernel where the TMA cannot describe K and V: the cases without
// total_k) and the mma.sync kernel.  On devices without wgmma both run the mma.sync kernel.
// ForwardFuzz.RandomShapes runs the same checks on 400 random shapes under the dispatch's own kernels
// (seeded; MALA_FUZZ_SEED, MALA_FUZZ_CASES, MALA_FUZZ_CASE: see gpu_util.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/rule.h"
#include "cuda/backend.h"
#include "gpu_util.h"

namespace {

using namespace mala_test;
using mala::DType;

// sink: random, plus key rows 0-3 that every query row scores about 24 nats above the rest (an
// attention sink).  The forward visits key tile 0 last, so each row's maximum grows there by far more
// than the lazy rescale's slack (attn/online_softmax.cuh): O and l are rescaled at the last tile.
enum class Input { random, local, workload, sink };

struct Case {
  std::string name;
  DType dtype = DType::bf16;
  int d = 128;
  bool causal = true;
  int batch = 1, nq = 256, nk = 256, hq = 8, hkv = 1;
  float tau = 1.f;
  Input input = Input::random;
  bool strided = false;
  std::vector<int> varlen_q, varlen_k;  // non-empty: varlen with these lengths
  bool total_k = true;                   // varlen: pass the packed rows (the Hopper forward's TMA loads)
  uint64_t seed = 1;
  bool quiet = false;                    // no per-case line (the fuzz test prints a summary)
  // One split of a longer sequence (ForwardArgs::rows_before, seed_lse, owns_*): seeded draws each
  // row's anchor mass around its own dense lse, so that both skips and empty rows occur.
  int rows_before = -1;
  bool seeded = false, owns_tile0 = false, owns_newest = false;
};

// Host tensor [batch, rows, heads, d] (or packed [total, heads, d]) with arbitrary element strides.
struct HostTensor {
  std::vector<float> v;
  mala::Strides st;
  int64_t sb = 0, sr = 0, sh = 0;
  int64_t idx(int64_t b, int64_t r, int64_t h) const { return b * sb + r * sr + h * sh; }
};

HostTensor make_tensor(int64_t batch, int64_t rows, int64_t heads, int64_t d, bool strided, bool varlen) {
  HostTensor t;
  t.sh = strided ? d + 16 : d;
  t.sr = strided ? heads * t.sh + 8 : heads * d;
  t.sb = varlen ? 0 : (strided ? rows * t.sr + 64 : rows * t.sr);
  if (strided) t.st = {varlen ? 0 : t.sb, t.sr, t.sh};
  const int64_t n = varlen ? rows * t.sr : batch * std::max<int64_t>(t.sb, rows * t.sr);
  t.v.assign(static_cast<size_t>(std::max<int64_t>(n, 1)), 0.f);
  return t;
}

// Structured inputs with strong locality: q_r = a * pos(r) + noise, k_c = a * pos(c) + noise with
// pos(x) = (cos(x w_i), sin(x w_i)) over the first half of the head dim, so q.k peaks at r = c.
float local_value(int64_t pos, int64_t x, int64_t d, float amp) {
  if (x >= d / 2) return 0.f;
  const int64_t i = x / 2;
  const double w = std::pow(30.0, -2.0 * i / (d / 2.0));
  const double ang = pos * w;
  return amp * static_cast<float>((x & 1) ? std::sin(ang) : std::cos(ang));
}

struct Outputs {
  std::vector<float> o, lse;
  std::vector<int32_t> slots;
  std::vector<uint8_t> mask;
};

void run_case(const Case& c, FuzzStats* stats = nullptr) {
  SCOPED_TRACE(c.name);
  const bool varlen = !c.varlen_q.empty();
  const int batch = varlen ? static_cast<int>(c.varlen_q.size()) : c.batch;
  std::vector<int32_t> cu_q(batch + 1, 0), cu_k(batch + 1, 0);
  int nq = c.nq, nk = c.nk;
  if (varlen) {
    nq = nk = 0;
    for (int b = 0; b < batch; ++b) {
      cu_q[b + 1] = cu_q[b] + c.varlen_q[b];
      cu_k[b + 1] = cu_k[b] + c.varlen_k[b];
      nq = std::max(nq, c.varlen_q[b]);
      nk = std::max(nk, c.varlen_k[b]);
    }
  }
  auto len_q = [&](int b) { return varlen ? c.varlen_q[b] : nq; };
  auto len_k = [&](int b) { return varlen ? c.varlen_k[b] : nk; };
  auto row0_q = [&](int b) { return varlen ? cu_q[b] : 0; };
  auto row0_k = [&](int b) { return varlen ? cu_k[b] : 0; };
  const int64_t rows_q = varlen ? cu_q[batch] : nq, rows_k = varlen ? cu_k[batch] : nk;
  const int d = c.d;

  HostTensor q = make_tensor(batch, rows_q, c.hq, d, c.strided, varlen);
  HostTensor k = make_tensor(batch, rows_k, c.hkv, d, c.strided, varlen);
  HostTensor v = make_tensor(batch, rows_k, c.hkv, d, c.strided, varlen);
  HostTensor o = make_tensor(batch, rows_q, c.hq, d, c.strided, varlen);

  // Fill valid positions.
  std::vector<float> wq, wk, wv;
  if (c.input == Input::workload) {
    ASSERT_FALSE(varlen);
    ASSERT_EQ(nq, nk);
    mala::WorkloadSpec spec;
    spec.regime = "synthetic";
    spec.batch = batch, spec.seqlen = nq, spec.heads_q = c.hq, spec.heads_kv = c.hkv, spec.head_dim = d;
    spec.sharpness = 2.0, spec.seed = c.seed;
    wq.resize((size_t)batch * nq * c.hq * d), wk.resize((size_t)batch * nk * c.hkv * d), wv.resize(wk.size());
    mala::Status s = mala::make_workload(spec, wq.data(), wk.data(), wv.data(), nullptr);
    ASSERT_TRUE(s.ok) << s.message;
  }
  // One draw per valid element: varlen rows are packed, padded batches have `batch` sequences.
  const int64_t all_q = varlen ? rows_q : (int64_t)batch * nq, all_k = varlen ? rows_k : (int64_t)batch * nk;
  std::vector<float> noise = randn((size_t)(all_q * c.hq + 2 * all_k * c.hkv) * d, c.seed);
  size_t ni = 0;
  const float amp = std::sqrt(16.f * std::sqrt((float)d) * 4.f / d);  // local peak ~16 nats
  const float sink_amp = std::sqrt(24.f * std::sqrt((float)d));       // q.k / sqrt(d) ~ 24 nats
  for (int b = 0; b < batch; ++b) {
    for (int r = 0; r < len_q(b); ++r)
      for (int h = 0; h < c.hq; ++h)
        for (int x = 0; x < d; ++x) {
          float val = noise[ni++];
          if (c.input == Input::local) val += local_value(r + len_k(b) - len_q(b), x, d, amp);
          if (c.input == Input::sink && x == 0) val += sink_amp;
          if (c.input == Input::workload) val = wq[(((size_t)b * nq + r) * c.hq + h) * d + x];
          q.v[q.idx(b, row0_q(b) + r, h) + x] = val;
        }
    for (int r = 0; r < len_k(b); ++r)
      for (int h = 0; h < c.hkv; ++h)
        for (int x = 0; x < d; ++x) {
          float kv = noise[ni++], vv = noise[ni++];
          if (c.input == Input::local) kv += local_value(r, x, d, amp);
          if (c.input == Input::sink && x == 0 && r < 4) kv += sink_amp;
          if (c.input == Input::workload) {
            kv = wk[(((size_t)b * nk + r) * c.hkv + h) * d + x];
            vv = wv[(((size_t)b * nk + r) * c.hkv + h) * d + x];
          }
          k.v[k.idx(b, row0_k(b) + r, h) + x] = kv;
          v.v[v.idx(b, row0_k(b) + r, h) + x] = vv;
        }
  }
  ASSERT_EQ(ni, noise.size()) << "test harness: noise draws";
  auto qb = round_to(q.v, c.dtype), kb = round_to(k.v, c.dtype), vb = round_to(v.v, c.dtype);

  // ---- GPU ----
  DeviceBuffer<uint16_t> dq(qb.size()), dk(kb.size()), dv(vb.size()), dout(o.v.size());
  dq.upload(qb), dk.upload(kb), dv.upload(vb);
  const int64_t lse_n = (int64_t)c.hq * (varlen ? rows_q : (int64_t)batch * nq);
  DeviceBuffer<float> dlse(lse_n);
  DeviceBuffer<int32_t> dslots(lse_n);
  DeviceBuffer<int32_t> dcu_q(varlen ? batch + 1 : 0), dcu_k(varlen ? batch + 1 : 0);
  if (varlen) dcu_q.upload(cu_q), dcu_k.upload(cu_k);

  mala::ForwardArgs a;
  a.device = mala::Device::cuda;
  a.dtype = c.dtype;
  a.q = dq.ptr, a.k = dk.ptr, a.v = dv.ptr, a.o = dout.ptr;
  a.lse = dlse.ptr, a.fwd_slots = dslots.ptr;
  a.batch = batch, a.seqlen_q = nq, a.seqlen_k = nk, a.heads_q = c.hq, a.heads_kv = c.hkv, a.head_dim = d;
  a.q_strides = q.st, a.k_strides = k.st, a.v_strides = v.st, a.o_strides = o.st;
  if (varlen) a.cu_seqlens_q = dcu_q.ptr, a.cu_seqlens_k = dcu_k.ptr;
  if (varlen && c.total_k) a.total_k = rows_k;
  a.causal = c.causal;
  a.tau = c.tau;
  a.rows_before = c.rows_before;
  std::vector<float> seed;
  DeviceBuffer<float> dseed(c.seeded ? lse_n : 0);
  if (c.seeded) {
    ASSERT_FALSE(varlen);
    mala::ForwardArgs ad = a;  // the rows' dense lse over this call's keys, on the rounded inputs
    std::vector<float> o_d(o.v.size()), lse_d(lse_n);
    ad.device = mala::Device::cpu, ad.dtype = DType::f32, ad.stream = nullptr;
    ad.q = q.v.data(), ad.k = k.v.data(), ad.v = v.v.data(), ad.o = o_d.data(), ad.lse = lse_d.data();
    ad.fwd_slots = nullptr, ad.tile_mask = nullptr, ad.rows_before = -1;
    ad.q_strides = q.st, ad.k_strides = k.st, ad.v_strides = v.st, ad.o_strides = o.st;
    ASSERT_TRUE(mala::reference::dense_forward(ad).ok);
    const std::vector<float> u = randn((size_t)lse_n, c.seed + 77);
    seed.resize(lse_n);
    for (int64_t i = 0; i < lse_n; ++i) seed[i] = std::isfinite(lse_d[i]) ? lse_d[i] + 2.f * u[i] + 1.f : -INFINITY;
    dseed.upload(seed);
    a.seed_lse = dseed.ptr, a.owns_tile0 = c.owns_tile0, a.owns_newest = c.owns_newest;
  }
  const mala::Tiles tiles = mala::forward_tiles(a);
  const int64_t nqt = (nq + tiles.block_q - 1) / tiles.block_q, nkt = (nk + tiles.block_k - 1) / tiles.block_k;
  DeviceBuffer<uint8_t> dmask((size_t)batch * c.hq * nqt * nkt);
  a.tile_mask = dmask.ptr;
  mala::Status st = mala::forward(a);
  ASSERT_TRUE(st.ok) << st.message;
  MALA_CUDA_CHECK(cudaDeviceSynchronize());

  // ---- CPU on the rounded values ----
  std::vector<float> o_cpu(o.v.size(), 0.f), lse_cpu(lse_n);
  std::vector<int32_t> slots_cpu(lse_n);
  std::vector<uint8_t> mask_cpu(dmask.count);
  mala::ForwardArgs ac = a;
  ac.device = mala::Device::cpu;
  ac.dtype = DType::f32;
  ac.q = q.v.data(), ac.k = k.v.data(), ac.v = v.v.data(), ac.o = o_cpu.data();
  ac.lse = lse_cpu.data(), ac.fwd_slots = slots_cpu.data(), ac.tile_mask = mask_cpu.data();
  ac.block_q = tiles.block_q, ac.block_k = tiles.block_k;
  ac.stream = nullptr;
  if (c.seeded) ac.seed_lse = seed.data();
  if (varlen) ac.cu_seqlens_q = cu_q.data(), ac.cu_seqlens_k = cu_k.data();
  st = mala::forward(ac);
  ASSERT_TRUE(st.ok) << st.message;

  // ---- compare ----
  const std::vector<uint16_t> ob = dout.download();
  const std::vector<float> lse_gpu = dlse.download();
  {
    // The same call without the optional tile mask and slots (a kernel may run another instance
    // then, as the warp-specialized forward does): the same decisions, so bit-identical O and lse.
    DeviceBuffer<uint16_t> dout2(o.v.size());
    DeviceBuffer<float> dlse2(lse_n);
    mala::ForwardArgs a2 = a;
    a2.o = dout2.ptr, a2.lse = dlse2.ptr, a2.tile_mask = nullptr, a2.fwd_slots = nullptr;
    mala::Status st2 = mala::forward(a2);
    ASSERT_TRUE(st2.ok) << st2.message;
    MALA_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(dout2.download() == ob) << "O without the tile mask differs";
    const std::vector<float> lse2 = dlse2.download();
    EXPECT_EQ(std::memcmp(lse2.data(), lse_gpu.data(), lse2.size() * sizeof(float)), 0) << "lse without the tile mask differs";
  }
  const std::vector<int32_t> slots_gpu = dslots.download();
  const std::vector<uint8_t> mask_gpu = dmask.download();

  std::vector<float> og, oc;
  size_t poison = 0;
  for (int b = 0; b < batch; ++b)
    for (int r = 0; r < len_q(b); ++r)
      for (int h = 0; h < c.hq; ++h)
        for (int x = 0; x < d; ++x) {
          const int64_t i = q.idx(b, row0_q(b) + r, h) + x;  // o has q's layout
          poison += ob[i] == 0xFFFF;
          og.push_back(from_bits(ob[i], c.dtype));
          oc.push_back(o_cpu[i]);
        }
  EXPECT_EQ(poison, 0u) << "unwritten O elements";
  EXPECT_EQ(count_nan(og), 0u);
  const double err = rel_l2(og, oc);
  EXPECT_LT(err, 1e-2) << "O rel L2";

  // tile masks
  int64_t legal = 0, mism = 0, retained = 0, bad_state = 0;
  for (size_t i = 0; i < mask_gpu.size(); ++i) {
    if (mask_gpu[i] > 2) ++bad_state;
    legal += mask_cpu[i] != mala::kTileIllegal;
    retained += mask_cpu[i] == mala::kTileRetained;
    if (mask_gpu[i] != mask_cpu[i]) {
      ++mism;
      // Only retained/skipped flips are rounding; legality must match exactly.
      EXPECT_TRUE(mask_gpu[i] != mala::kTileIllegal && mask_cpu[i] != mala::kTileIllegal)
          << "legality differs at mask entry " << i;
    }
  }
  EXPECT_EQ(bad_state, 0) << "tile_mask entries not written";
  if (c.tau == 0.f) EXPECT_EQ(mism, 0);
  EXPECT_LE(mism, std::max<int64_t>(1, legal / 1000)) << "tile decisions differ beyond rounding flips";

  // lse and slots; slots must follow the kernel's own mask.
  int64_t lse_bad = 0, slot_bad = 0;
  double max_dlse = 0;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < c.hq; ++h)
      for (int r = 0; r < len_q(b); ++r) {
        const int64_t i = varlen ? (int64_t)h * rows_q + cu_q[b] + r : ((int64_t)b * c.hq + h) * nq + r;
        const float lg = lse_gpu[i], lc = lse_cpu[i];
        if (std::isnan(lg) || (std::isinf(lc) != std::isinf(lg))) ++lse_bad;
        else if (std::isfinite(lc)) max_dlse = std::max(max_dlse, (double)std::fabs(lg - lc));
        const int L = mala::rule::visible_keys(r, len_q(b), len_k(b), c.causal);
        const uint8_t* mrow = &mask_gpu[(((size_t)b * c.hq + h) * nqt + r / tiles.block_q) * nkt];
        int32_t expect = 0;
        if (L > 0)
          for (int64_t kt = 0; kt < nkt; ++kt) expect += (mrow[kt] == mala::kTileRetained) * tiles.block_k;
        slot_bad += slots_gpu[i] != expect;
      }
  EXPECT_EQ(lse_bad, 0) << "lse NaN/unwritten or -inf mismatch";
  EXPECT_EQ(slot_bad, 0) << "fwd_slots inconsistent with tile_mask";
  if (mism == 0) EXPECT_LT(max_dlse, 5e-3) << "lse differs";
  if (stats) {
    ++stats->cases;
    stats->tiles += legal;
    stats->flips += mism;
    stats->max_err = std::max(stats->max_err, err);
  }
  if (!c.quiet)
    std::printf("[%s] tiles %dx%d  O relL2 %.2e  max|dlse| %.2e  legal tiles %lld  retained %.1f%%  flips %lld\n",
                c.name.c_str(), tiles.block_q, tiles.block_k, err, max_dlse, (long long)legal,
                legal ? 100.0 * retained / legal : 0.0, (long long)mism);
}

Case mk(std::string name, DType t, int d, bool causal, int nq, int nk, int hq, int hkv, float tau, Input in) {
  Case c;
  c.name = std::move(name);
  c.dtype = t, c.d = d, c.causal = causal, c.nq = nq, c.nk = nk, c.hq = hq, c.hkv = hkv, c.tau = tau, c.input = in;
  return c;
}

using mala::cuda_backend::FwdVariant;

// The kernel tests, once per forward kernel (the test parameter), which the fixture selects
// in-process through the kernel override.
class CudaForwardKernels : public ::testing::TestWithParam<FwdVariant> {
 protected:
  void SetUp() override {
    mala::cuda_backend::KernelOverride o;
    o.fwd = GetParam();
    mala::cuda_backend::set_kernel_override(o);
  }
  void TearDown() override { mala::cuda_backend::set_kernel_override({}); }
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Kernels, CudaForwardKernels,
                         ::testing::Values(FwdVariant::automatic, FwdVariant::mma_sync),
                         [](const ::testing::TestParamInfo<FwdVariant>& i) {
                           return std::string(mala::cuda_backend::variant_name(i.param));
                         });

TEST_P(CudaForwardKernels, DenseMatchesCpuAtTauZero) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  run_case(mk("bf16 d128 causal gqa8/1 N=1000 tau0", DType::bf16, 128, true, 1000, 1000, 8, 1, 0.f, Input::random));
  run_case(mk("fp16 d64 causal mha N=2049 tau0 local", DType::f16, 64, true, 2049, 2049, 2, 2, 0.f, Input::local));
  run_case(mk("bf16 d256 noncausal N=300/77 tau0", DType::bf16, 256, false, 300, 77, 4, 2, 0.f, Input::random));
  run_case(mk("fp16 d256 causal gqa4/1 N=1000 tau0", DType::f16, 256, true, 1000, 1000, 4, 1, 0.f, Input::random));
}

TEST_P(CudaForwardKernels, HeadDimsDtypesCausality) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (DType t : {DType::bf16, DType::f16})
    for (int d : {64, 128, 256})
      for (bool causal : {true, false}) {
        std::string n = std::string(t == DType::bf16 ? "bf16" : "fp16") + " d" + std::to_string(d) +
                        (causal ? " causal" : " noncausal") + " gqa4/2 N=1000 tau1 local";
        run_case(mk(n, t, d, causal, 1000, 1000, 4, 2, 1.f, Input::local));
      }
}

TEST_P(CudaForwardKernels, RandomInputsTauOne) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  run_case(mk("bf16 d128 causal gqa8/1 N=2049 tau1 random", DType::bf16, 128, true, 2049, 2049, 8, 1, 1.f, Input::random));
  Case c = mk("fp16 d64 causal mha batch2 N=77 tau1 random", DType::f16, 64, true, 77, 77, 2, 2, 1.f, Input::random);
  c.batch = 2;
  run_case(c);
  run_case(mk("bf16 d256 causal gqa4/1 N=2049 tau1 random", DType::bf16, 256, true, 2049, 2049, 4, 1, 1.f, Input::random));
}

// Rows whose maximum grows by far more than the lazy rescale's slack at the last tile visited.
TEST_P(CudaForwardKernels, AttentionSink) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (float tau : {0.f, 1.f}) {
    const std::string ts = tau > 0.f ? " tau1" : " tau0";
    run_case(mk("bf16 d128 causal gqa8/1 N=2049 sink" + ts, DType::bf16, 128, true, 2049, 2049, 8, 1, tau, Input::sink));
    run_case(mk("fp16 d128 noncausal N=300/1000 sink" + ts, DType::f16, 128, false, 300, 1000, 4, 2, tau, Input::sink));
    run_case(mk("fp16 d64 causal N=1000 sink" + ts, DType::f16, 64, true, 1000, 1000, 4, 2, tau, Input::sink));
    run_case(mk("bf16 d256 causal N=1000 sink" + ts, DType::bf16, 256, true, 1000, 1000, 2, 1, tau, Input::sink));
  }
}

TEST_P(CudaForwardKernels, RaggedLengths) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  run_case(mk("bf16 d128 causal N=1", DType::bf16, 128, true, 1, 1, 8, 1, 1.f, Input::random));
  run_case(mk("bf16 d128 causal Nq=1 Nk=2049 local", DType::bf16, 128, true, 1, 2049, 8, 1, 1.f, Input::local));
  run_case(mk("bf16 d128 causal Nq=77 Nk=2049 local", DType::bf16, 128, true, 77, 2049, 8, 1, 1.f, Input::local));
  run_case(mk("fp16 d128 causal Nq=1000 Nk=300 (L=0 rows)", DType::f16, 128, true, 1000, 300, 4, 1, 1.f, Input::local));
  run_case(mk("bf16 d256 causal Nq=2049 Nk=77", DType::bf16, 256, true, 2049, 77, 2, 1, 1.f, Input::random));
  run_case(mk("fp16 d64 noncausal Nq=77 Nk=1000 local", DType::f16, 64, false, 77, 1000, 4, 4, 1.f, Input::local));
  run_case(mk("bf16 d64 causal N=2049 gqa8/1 local", DType::bf16, 64, true, 2049, 2049, 8, 1, 1.f, Input::local));
}

TEST_P(CudaForwardKernels, BatchStridedVarlen) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  Case c = mk("bf16 d128 causal batch2 strided N=1000 local", DType::bf16, 128, true, 1000, 1000, 4, 2, 1.f, Input::local);
  c.batch = 2, c.strided = true;
  run_case(c);
  c = mk("fp16 d64 noncausal batch2 strided Nq=300 Nk=777", DType::f16, 64, false, 300, 777, 2, 1, 1.f, Input::random);
  c.batch = 2, c.strided = true;
  run_case(c);
  c = mk("bf16 d128 causal varlen3 local", DType::bf16, 128, true, 0, 0, 8, 1, 1.f, Input::local);
  c.varlen_q = {77, 1000, 300}, c.varlen_k = {77, 1000, 513};
  run_case(c);
  c.name = "bf16 d128 causal varlen3 local, no total_k (mma.sync)";
  c.total_k = false;
  run_case(c);
  c = mk("fp16 d128 noncausal varlen4 strided random", DType::f16, 128, false, 0, 0, 4, 2, 1.f, Input::random);
  c.varlen_q = {130, 0, 64, 700}, c.varlen_k = {65, 1, 200, 700}, c.strided = true;
  run_case(c);
  c = mk("bf16 d128 causal varlen3 tau=0", DType::bf16, 128, true, 0, 0, 8, 1, 0.f, Input::local);
  c.varlen_q = {1, 513, 2000}, c.varlen_k = {333, 513, 2000};
  run_case(c);
  c = mk("fp16 d256 noncausal varlen3 strided", DType::f16, 256, false, 0, 0, 4, 2, 1.f, Input::local);
  c.varlen_q = {129, 1, 640}, c.varlen_k = {200, 33, 640}, c.strided = true;
  run_case(c);
  // d = 64 likewise: the 128-key kernel where the TMA serves, else mma.sync.
  for (float tau : {0.f, 1.f}) {
    c = mk(std::string("bf16 d64 causal varlen3 local tau") + (tau > 0.f ? "1" : "0"), DType::bf16, 64, true, 0, 0, 8,
           2, tau, Input::local);
    c.varlen_q = {77, 1000, 300}, c.varlen_k = {77, 1000, 513};
    run_case(c);
    c.name += ", no total_k";
    c.total_k = false;
    run_case(c);
  }
}

// tau = 0 over the layouts the other tests run at tau = 1: on sm_90 these run the 128-key kernel's
// dense instance (automatic) and the mma.sync kernel's (mma_sync; one instance at d = 128), whose
// tiles cross the ends, the diagonal and short rows differently.
TEST_P(CudaForwardKernels, DenseLayouts) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (int d : {64, 128}) {
    const std::string dn = " d" + std::to_string(d);
    run_case(mk("bf16" + dn + " causal N=1", DType::bf16, d, true, 1, 1, 8, 1, 0.f, Input::random));
    run_case(mk("fp16" + dn + " causal Nq=77 Nk=2049", DType::f16, d, true, 77, 2049, 8, 1, 0.f, Input::local));
    run_case(mk("bf16" + dn + " causal Nq=1000 Nk=300 (L=0 rows)", DType::bf16, d, true, 1000, 300, 4, 1, 0.f,
                Input::local));
    run_case(mk("bf16" + dn + " noncausal Nq=300 Nk=1000 sink", DType::bf16, d, false, 300, 1000, 4, 2, 0.f,
                Input::sink));
    run_case(mk("fp16" + dn + " causal N=2049 gqa4/2", DType::f16, d, true, 2049, 2049, 4, 2, 0.f, Input::random));
    Case c = mk("bf16" + dn + " causal batch2 strided N=1000", DType::bf16, d, true, 1000, 1000, 4, 2, 0.f,
                Input::local);
    c.batch = 2, c.strided = true;
    run_case(c);
    c = mk("fp16" + dn + " noncausal varlen4 strided", DType::f16, d, false, 0, 0, 4, 2, 0.f, Input::random);
    c.varlen_q = {130, 0, 64, 700}, c.varlen_k = {65, 1, 200, 700}, c.strided = true;
    run_case(c);
    c = mk("bf16" + dn + " causal varlen3", DType::bf16, d, true, 0, 0, 8, 1, 0.f, Input::local);
    c.varlen_q = {1, 513, 2000}, c.varlen_k = {333, 513, 2000};
    run_case(c);
  }
}

TEST_P(CudaForwardKernels, SyntheticWorkload) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  Case c = mk("bf16 d128 causal gqa8/1 N=2048 synthetic", DType::bf16, 128, true, 2048, 2048, 8, 1, 1.f, Input::workload);
  run_case(c);
  run_case(mk("bf16 d256 causal gqa4/1 N=2048 synthetic", DType::bf16, 256, true, 2048, 2048, 4, 1, 1.f, Input::workload));
}

// The call as one split of a longer sequence (context parallelism): the whole-length threshold
// (rows_before), the seed in the test's denominator, the held anchors retained untested, rows that
// retain nothing (o = 0, lse = -inf).  Seeded calls that the TMA cannot serve run mma.sync, as
// every call the TMA cannot serve does.
TEST_P(CudaForwardKernels, SplitOfALongerSequence) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (DType t : {DType::bf16, DType::f16})
    for (int d : {64, 128, 256}) {
      const std::string dt = std::string(t == DType::bf16 ? "bf16" : "fp16") + " d" + std::to_string(d);
      Case c = mk(dt + " diagonal shard, seeded, owns newest", t, d, true, 640, 640, 4, 2, 1.f, Input::local);
      c.rows_before = 3 * 640, c.seeded = true, c.owns_newest = true;
      run_case(c);
      c = mk(dt + " earlier shard, seeded, owns tile 0", t, d, false, 640, 640, 4, 1, 1.f, Input::local);
      c.rows_before = 2 * 640, c.seeded = true, c.owns_tile0 = true, c.seed = 3;
      run_case(c);
      c = mk(dt + " middle shard, seeded, random", t, d, false, 320, 640, 8, 1, 1.f, Input::random);
      c.rows_before = 5 * 640, c.seeded = true, c.seed = 4;
      run_case(c);
      c = mk(dt + " diagonal shard, rows_before only", t, d, true, 640, 640, 4, 2, 1.f, Input::local);
      c.rows_before = 640, c.seed = 5;
      run_case(c);
    }
  Case c = mk("bf16 d128 seeded, strided", DType::bf16, 128, false, 300, 640, 4, 2, 1.f,
              Input::local);
  c.rows_before = 1000, c.seeded = true, c.strided = true;
  run_case(c);
  c = mk("bf16 d128 seeded tau=0", DType::bf16, 128, true, 640, 640, 4, 2, 0.f, Input::local);
  c.rows_before = 640, c.seeded = true, c.owns_newest = true;
  run_case(c);
}

TEST(CudaForward, RejectsUnsupported) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  DeviceBuffer<uint16_t> buf(64 * 128);
  mala::ForwardArgs a;
  a.device = mala::Device::cuda;
  a.dtype = mala::DType::bf16;
  a.q = a.k = a.v = buf.ptr;
  a.o = buf.ptr;
  a.seqlen_q = a.seqlen_k = 64, a.head_dim = 128;
  a.block_q = 7;
  EXPECT_FALSE(mala::forward(a).ok);
  a.block_q = 0;
  a.head_dim = 96;
  EXPECT_FALSE(mala::forward(a).ok);
}

// Tiny shapes for compute-sanitizer (memcheck / racecheck): run with --gtest_filter=*Sanitizer*.
TEST_P(CudaForwardKernels, SanitizerSmall) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  run_case(mk("bf16 d128 causal N=150", DType::bf16, 128, true, 150, 150, 2, 1, 1.f, Input::local));
  run_case(mk("fp16 d64 noncausal Nq=70 Nk=130", DType::f16, 64, false, 70, 130, 2, 2, 1.f, Input::random));
  run_case(mk("bf16 d256 causal Nq=100 Nk=40", DType::bf16, 256, true, 100, 40, 2, 1, 1.f, Input::local));
  run_case(mk("bf16 d128 causal N=300 tau0", DType::bf16, 128, true, 300, 300, 2, 1, 0.f, Input::local));
  run_case(mk("fp16 d64 noncausal Nq=200 Nk=390 tau0", DType::f16, 64, false, 200, 390, 2, 2, 0.f, Input::random));
  Case c = mk("bf16 d128 seeded split N=150", DType::bf16, 128, true, 150, 150, 2, 1, 1.f, Input::local);
  c.rows_before = 300, c.seeded = true, c.owns_newest = true;
  run_case(c);
  c = mk("fp16 d64 seeded split Nq=70 Nk=130", DType::f16, 64, false, 70, 130, 2, 2, 1.f, Input::local);
  c.rows_before = 500, c.seeded = true, c.owns_tile0 = true;
  run_case(c);
  run_case(mk("fp16 d256 noncausal Nq=90 Nk=200 tau0", DType::f16, 256, false, 90, 200, 2, 2, 0.f, Input::random));
  c = mk("bf16 d256 seeded split N=150", DType::bf16, 256, true, 150, 150, 2, 1, 1.f, Input::local);
  c.rows_before = 300, c.seeded = true, c.owns_newest = true;
  run_case(c);
}

// ---- fuzz (issue #35): random shapes against the CPU, the dispatch's own kernels ---------------
// Batch 1-3 or varlen (1-4 sequences, empty ones included), lengths 1..700 (equal or not),
// bottom-right causal or not, head dims 64/128/256, bf16/fp16, MHA/GQA/MQA up to 8 query heads,
// tau in {0, 0.25, 1, 2}, random, local or synthetic (nq == nk, dense) inputs, strided or not.
namespace {

Case draw_forward_case(Fuzz& fz, int index) {
  Case c;
  c.quiet = true;
  c.seed = fz.next();
  c.dtype = fz.chance(0.5) ? DType::bf16 : DType::f16;
  c.d = fz.pick({64, 128, 256});
  c.causal = fz.chance(0.6);
  std::tie(c.hq, c.hkv) = fz.heads();
  c.tau = fz.pick({0.f, 0.25f, 1.f, 2.f});
  c.strided = fz.chance(0.25);
  std::string shape;
  if (fz.chance(0.2)) {
    const int n = fz.uniform(1, 4);
    int max_q = 0, max_k = 0;
    for (int b = 0; b < n; ++b) {
      const int kind = fz.uniform(0, 19);
      int lq = fz.length(700), lk = fz.chance(0.4) ? lq : fz.length(700);
      if (kind < 2) lq = lk = 0;  // an empty sequence
      else if (kind == 2) lq = 0;  // keys without queries
      else if (kind == 3) lk = 0;  // queries without keys
      c.varlen_q.push_back(lq), c.varlen_k.push_back(lk);
      max_q = std::max(max_q, lq), max_k = std::max(max_k, lk);
    }
    if (max_q == 0) c.varlen_q[0] = fz.length(700);  // seqlen_q and seqlen_k must be >= 1
    if (max_k == 0) c.varlen_k[0] = fz.length(700);
    c.total_k = fz.chance(0.75);
    c.input = fz.chance(0.4) ? Input::local : Input::random;
    shape = "varlen q{";
    for (size_t b = 0; b < c.varlen_q.size(); ++b) shape += (b ? "," : "") + std::to_string(c.varlen_q[b]);
    shape += "} k{";
    for (size_t b = 0; b < c.varlen_k.size(); ++b) shape += (b ? "," : "") + std::to_string(c.varlen_k[b]);
    shape += c.total_k ? "}" : "} no total_k";
  } else {
    c.batch = fz.pick({1, 1, 2, 3});
    c.nq = fz.length(700);
    c.nk = fz.chance(0.4) ? c.nq : fz.length(700);
    const bool workload = c.nq == c.nk && fz.chance(0.15);  // the synthetic workload needs nq == nk
    c.input = workload ? Input::workload : fz.chance(0.4) ? Input::local : Input::random;
    shape = "B=" + std::to_string(c.batch) + " nq=" + std::to_string(c.nq) + " nk=" + std::to_string(c.nk);
  }
  char tau[16];
  std::snprintf(tau, sizeof tau, "%g", c.tau);
  c.name = "fuzz #" + std::to_string(index) + ": " + (c.dtype == DType::bf16 ? "bf16" : "fp16") + " d" +
           std::to_string(c.d) + (c.causal ? " causal " : " noncausal ") + shape + " hq" + std::to_string(c.hq) +
           "/" + std::to_string(c.hkv) + " tau=" + tau +
           (c.input == Input::local ? " local" : c.input == Input::workload ? " synthetic" : " random") +
           (c.strided ? " strided" : "");
  return c;
}

}  // namespace

TEST(ForwardFuzz, RandomShapes) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  mala::cuda_backend::set_kernel_override({});
  run_fuzz("ForwardFuzz", 400, 1, draw_forward_case, [](const Case& c, FuzzStats* st) { run_case(c, st); });
}
