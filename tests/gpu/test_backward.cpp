// The fused CUDA backward against the CPU implementation (Device::cpu backward with the kernel's
// tiles, fp32 inputs equal to the rounded bf16/fp16 values, O and lse from the CPU forward, the same
// rounded O/lse passed to both so that the decisions are comparable).
//   - tile_mask equal except near-margin flips (|margin| < 2e-3 natural-log units, counted),
//   - dQ/dK/dV rel L2 < 1e-2 vs the CPU fp32 result, no poison left, no NaN,
//   - bwd_slots equal to the CPU's (exact when there is no flip).
// Every test runs once per backward kernel (the kernel override of src/cuda/backend.h, a test
// parameter): the dispatch's own choice (on sm_90 the warp-specialized TMA kernels, and the mma.sync
// kernel where the TMA cannot describe the tensors: varlen without totals) and the mma.sync kernel
// (the same on devices without wgmma).  Deterministic calls also run three times and must give
// bit-identical dQ, dK, dV.
// BackwardFuzz.RandomShapes runs the same checks on 400 random shapes under the dispatch's own
// kernels (seeded; MALA_FUZZ_SEED, MALA_FUZZ_CASES, MALA_FUZZ_CASE: see gpu_util.h).
#include <string>
#include <vector>

#include "common/rule.h"
#include "cuda/backend.h"
#include "gpu_util.h"

namespace {

using mala::DType;
using namespace mala_test;

struct Case {
  DType dtype = DType::bf16;
  int64_t batch = 1, nq = 256, nk = 256, hq = 4, hkv = 2, d = 128;
  bool causal = true;
  float tau = 1.f;
  // Input regime: "random" (N(0,1)), "sharp" (q, k ~ N(0, sigma^2): sharp attention, Nq != Nk
  // allowed) or "synthetic" (mala::make_workload, needs nq == nk and batch 1).
  std::string regime = "random";
  float sigma = 2.5f;
  double sharpness = 2.0;
  bool strided = false;
  std::vector<int> varlen_q, varlen_k;  // per-sequence lengths (varlen when non-empty)
  int head_splits = 0;                  // the override's bwd_head_splits (0 = heuristic)
  bool outputs = true;                  // request tile_mask and bwd_slots
  bool user_workspace = false;
  bool totals = true;         // varlen: give total_q and total_k (the TMA kernel needs them)
  bool deterministic = false;
  bool fwd_mask = false;                // pass the forward's tile mask (forward_tile_mask)
  float dout_scale = 1.f;               // dO's magnitude (the fixed-point dQ's unit follows it)
  float k_offset = 0.f;                 // added to every element of K: softmax is unchanged, but max|K|
                                        // (the fixed-point dQ's bound) grows and dQ's adds cancel
  double max_rel_l2 = 1e-2;             // each gradient's error against the CPU reference
  int64_t rows_before = -1;   // one split of a longer sequence: the threshold's whole row length
  uint64_t seed = 1;
  bool quiet = false;  // no per-case line (the fuzz test prints a summary)
};

struct Layout {
  mala::Strides s;
  int64_t span = 0;  // elements to allocate
};

Layout make_layout(const Case& c, int64_t rows_per_batch, int64_t heads, bool varlen, int64_t total_rows) {
  Layout l;
  const int64_t pad = c.strided ? 8 : 0;
  l.s.head = c.d + pad;
  l.s.row = heads * l.s.head + pad;
  if (varlen) {
    l.s.batch = 0;
    l.span = total_rows * l.s.row;
  } else {
    l.s.batch = rows_per_batch * l.s.row + (c.strided ? 16 : 0);
    l.span = c.batch * l.s.batch;
  }
  if (!c.strided) l.s = mala::Strides{};
  return l;
}

// Element offsets of the logical [rows, heads, d] elements (varlen packed or dense batches).
std::vector<int64_t> logical_offsets(const Case& c, const Layout& l, const std::vector<int>& cu, int64_t seqlen,
                                     int64_t heads) {
  const int64_t hs = l.s.head ? l.s.head : c.d;
  const int64_t rs = l.s.row ? l.s.row : heads * hs;
  const int64_t bs = l.s.batch ? l.s.batch : seqlen * rs;
  std::vector<int64_t> off;
  if (!cu.empty()) {
    for (int64_t g = 0; g < cu.back(); ++g)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t x = 0; x < c.d; ++x) off.push_back(g * rs + h * hs + x);
  } else {
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t r = 0; r < seqlen; ++r)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t x = 0; x < c.d; ++x) off.push_back(b * bs + r * rs + h * hs + x);
  }
  return off;
}

template <typename V>
std::vector<float> pick(const std::vector<V>& src, const std::vector<int64_t>& off) {
  std::vector<float> out(off.size());
  for (size_t i = 0; i < off.size(); ++i) out[i] = static_cast<float>(src[off[i]]);
  return out;
}

void run_case(const Case& c, FuzzStats* stats = nullptr) {
  SCOPED_TRACE(::testing::Message() << "dtype=" << mala::dtype_name(c.dtype) << " B=" << c.batch << " nq=" << c.nq
                                    << " nk=" << c.nk << " hq=" << c.hq << " hkv=" << c.hkv << " d=" << c.d
                                    << " causal=" << c.causal << " tau=" << c.tau << " regime=" << c.regime
                                    << " strided=" << c.strided << " varlen=" << !c.varlen_q.empty()
                                    << " splits=" << c.head_splits << " deterministic=" << c.deterministic
                                    << " fwd_mask=" << c.fwd_mask << " dout_scale=" << c.dout_scale
                                    << " k_offset=" << c.k_offset);
  // The head splits through the kernel override, beside the fixture's kernel.
  auto set_head_splits = [](int splits) {
    mala::cuda_backend::KernelOverride o = mala::cuda_backend::kernel_override();
    o.bwd_head_splits = splits;
    mala::cuda_backend::set_kernel_override(o);
  };
  set_head_splits(c.head_splits);
  const bool varlen = !c.varlen_q.empty();
  std::vector<int> cu_q{0}, cu_k{0};
  int64_t nq = c.nq, nk = c.nk, batch = c.batch;
  if (varlen) {
    batch = static_cast<int64_t>(c.varlen_q.size());
    nq = nk = 0;
    for (size_t b = 0; b < c.varlen_q.size(); ++b) {
      cu_q.push_back(cu_q.back() + c.varlen_q[b]);
      cu_k.push_back(cu_k.back() + c.varlen_k[b]);
      nq = std::max<int64_t>(nq, c.varlen_q[b]);
      nk = std::max<int64_t>(nk, c.varlen_k[b]);
    }
  }
  Case cc = c;
  cc.batch = batch;
  const Layout lq = make_layout(cc, nq, c.hq, varlen, cu_q.back());
  const Layout lk = make_layout(cc, nk, c.hkv, varlen, cu_k.back());
  const std::vector<int> no_cu;
  const auto offq = logical_offsets(cc, lq, varlen ? cu_q : no_cu, nq, c.hq);
  const auto offk = logical_offsets(cc, lk, varlen ? cu_k : no_cu, nk, c.hkv);

  // Inputs (fp32, then rounded to the storage type).
  std::vector<float> q = randn(lq.span, c.seed * 11 + 1), k = randn(lk.span, c.seed * 11 + 2),
                     v = randn(lk.span, c.seed * 11 + 3), dout = randn(lq.span, c.seed * 11 + 4);
  if (c.regime == "sharp") {
    for (auto& x : q) x *= c.sigma;
    for (auto& x : k) x *= c.sigma;
  } else if (c.regime == "synthetic") {
    ASSERT_EQ(nq, nk);
    ASSERT_FALSE(c.strided || varlen || batch != 1);
    mala::WorkloadSpec w;
    w.regime = "synthetic";
    w.batch = 1;
    w.seqlen = nq;
    w.heads_q = c.hq;
    w.heads_kv = c.hkv;
    w.head_dim = c.d;
    w.sharpness = c.sharpness;
    w.seed = c.seed;
    ASSERT_TRUE(mala::make_workload(w, q.data(), k.data(), v.data(), dout.data()).ok);
  }
  for (auto& x : dout) x *= c.dout_scale;
  for (auto& x : k) x += c.k_offset;
  const auto qb = round_to(q, c.dtype), kb = round_to(k, c.dtype), vb = round_to(v, c.dtype),
             dob = round_to(dout, c.dtype);

  // CPU forward for O and lse (fp32 on the rounded inputs), O rounded to the storage type.
  std::vector<float> o(lq.span, 0.f);
  const int64_t lse_n = varlen ? c.hq * cu_q.back() : batch * c.hq * nq;
  std::vector<float> lse(lse_n, 0.f);
  // With fwd_mask, the forward records its decisions on the GPU forward's tiles (its O and lse then
  // come from those tiles too), for the GPU backward's forward_tile_mask.
  mala::Tiles ftiles{};
  std::vector<uint8_t> fmask;
  {
    mala::ForwardArgs f;
    f.device = mala::Device::cpu;
    f.dtype = DType::f32;
    f.q = q.data();
    f.k = k.data();
    f.v = v.data();
    f.o = o.data();
    f.lse = lse.data();
    f.batch = batch;
    f.seqlen_q = nq;
    f.seqlen_k = nk;
    f.heads_q = c.hq;
    f.heads_kv = c.hkv;
    f.head_dim = c.d;
    f.q_strides = f.o_strides = lq.s;
    f.k_strides = f.v_strides = lk.s;
    f.cu_seqlens_q = varlen ? cu_q.data() : nullptr;
    f.cu_seqlens_k = varlen ? cu_k.data() : nullptr;
    f.causal = c.causal;
    f.tau = c.tau;
    if (c.fwd_mask) {
      mala::ForwardArgs probe = f;
      probe.device = mala::Device::cuda;
      probe.dtype = c.dtype;
      probe.q = probe.k = probe.v = nullptr;
      probe.o = nullptr;
      probe.lse = nullptr;
      probe.cu_seqlens_q = probe.cu_seqlens_k = nullptr;
      ftiles = mala::forward_tiles(probe);
      f.block_q = ftiles.block_q;
      f.block_k = ftiles.block_k;
      fmask.assign(static_cast<size_t>(batch * c.hq * ((nq + ftiles.block_q - 1) / ftiles.block_q) *
                                       ((nk + ftiles.block_k - 1) / ftiles.block_k)),
                   9);
      f.tile_mask = fmask.data();
    }
    mala::Status s = mala::forward(f);
    ASSERT_TRUE(s.ok) << s.message;
  }
  const auto ob = round_to(o, c.dtype);

  // Backward arguments shared by both devices.
  mala::BackwardArgs a;
  a.batch = batch;
  a.seqlen_q = nq;
  a.seqlen_k = nk;
  a.heads_q = c.hq;
  a.heads_kv = c.hkv;
  a.head_dim = c.d;
  a.q_strides = a.o_strides = a.dout_strides = a.dq_strides = lq.s;
  a.k_strides = a.v_strides = a.dk_strides = a.dv_strides = lk.s;
  a.causal = c.causal;
  a.tau = c.tau;
  a.rows_before = c.rows_before;

  mala::BackwardArgs ga = a;
  ga.device = mala::Device::cuda;
  ga.dtype = c.dtype;
  const mala::Tiles tiles = mala::backward_tiles(ga);
  const int64_t nqt = (nq + tiles.block_q - 1) / tiles.block_q, nkt = (nk + tiles.block_k - 1) / tiles.block_k;
  const int64_t mask_n = batch * c.hq * nqt * nkt;

  // CPU backward with the kernel's tiles.
  std::vector<float> dq_c(lq.span, 0.f), dk_c(lk.span, 0.f), dv_c(lk.span, 0.f);
  std::vector<int32_t> slots_c(lse_n, -7);
  std::vector<uint8_t> mask_c(mask_n, 9);
  {
    mala::BackwardArgs ca = a;
    ca.device = mala::Device::cpu;
    ca.dtype = DType::f32;
    ca.q = q.data();
    ca.k = k.data();
    ca.v = v.data();
    ca.o = o.data();
    ca.dout = dout.data();
    ca.lse = lse.data();
    ca.dq = dq_c.data();
    ca.dk = dk_c.data();
    ca.dv = dv_c.data();
    ca.bwd_slots = slots_c.data();
    ca.tile_mask = mask_c.data();
    ca.cu_seqlens_q = varlen ? cu_q.data() : nullptr;
    ca.cu_seqlens_k = varlen ? cu_k.data() : nullptr;
    ca.block_q = tiles.block_q;
    ca.block_k = tiles.block_k;
    mala::Status s = mala::backward(ca);
    ASSERT_TRUE(s.ok) << s.message;
  }

  // GPU backward.
  DeviceBuffer<uint16_t> gq(lq.span), gk(lk.span), gv(lk.span), go(lq.span), gdo(lq.span), gdq(lq.span),
      gdk(lk.span), gdv(lk.span);
  DeviceBuffer<float> glse(lse_n);
  DeviceBuffer<int32_t> gslots(c.outputs ? lse_n : 0), gcu_q(varlen ? cu_q.size() : 0),
      gcu_k(varlen ? cu_k.size() : 0);
  DeviceBuffer<uint8_t> gmask(c.outputs ? mask_n : 0), gfmask(fmask.size());
  if (c.fwd_mask) {
    gfmask.upload(fmask);
    ga.forward_tile_mask = gfmask.ptr;
    ga.forward_block_q = ftiles.block_q;
    ga.forward_block_k = ftiles.block_k;
  }
  gq.upload(qb);
  gk.upload(kb);
  gv.upload(vb);
  go.upload(ob);
  gdo.upload(dob);
  glse.upload(lse);
  if (varlen) {
    gcu_q.upload(cu_q);
    gcu_k.upload(cu_k);
  }
  ga.q = gq.ptr;
  ga.k = gk.ptr;
  ga.v = gv.ptr;
  ga.o = go.ptr;
  ga.dout = gdo.ptr;
  ga.lse = glse.ptr;
  ga.dq = gdq.ptr;
  ga.dk = gdk.ptr;
  ga.dv = gdv.ptr;
  ga.bwd_slots = c.outputs ? gslots.ptr : nullptr;
  ga.tile_mask = c.outputs ? gmask.ptr : nullptr;
  ga.cu_seqlens_q = varlen ? gcu_q.ptr : nullptr;
  ga.cu_seqlens_k = varlen ? gcu_k.ptr : nullptr;
  if (varlen && c.totals) {
    ga.total_q = cu_q.back();
    ga.total_k = cu_k.back();
  }
  ga.deterministic = c.deterministic;
  DeviceBuffer<uint8_t> gws(c.user_workspace ? mala::backward_workspace_size(ga) : 0);
  if (c.user_workspace) {
    ga.workspace = gws.ptr;
    ga.workspace_bytes = gws.count;
  }
  mala::Status s = mala::backward(ga);
  ASSERT_TRUE(s.ok) << s.message;
  MALA_CUDA_CHECK(cudaDeviceSynchronize());
  MALA_CUDA_CHECK(cudaGetLastError());
  if (c.deterministic) {
    const auto dq0 = gdq.download(), dk0 = gdk.download(), dv0 = gdv.download();
    for (int rep = 0; rep < 2; ++rep) {
      ASSERT_TRUE(mala::backward(ga).ok);
      MALA_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(gdq.download() == dq0) << "dq differs in run " << rep + 2;
      EXPECT_TRUE(gdk.download() == dk0) << "dk differs in run " << rep + 2;
      EXPECT_TRUE(gdv.download() == dv0) << "dv differs in run " << rep + 2;
    }
  }
  set_head_splits(0);

  // Decisions.
  int64_t flips = 0, legal = 0, retained = 0;
  bool exact_decisions = true;
  if (c.outputs) {
    const auto mask_g = gmask.download();
    const float log_tau = std::log(c.tau);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    const int64_t hs_q = lq.s.head ? lq.s.head : c.d, rs_q = lq.s.row ? lq.s.row : c.hq * hs_q,
                  bs_q = lq.s.batch ? lq.s.batch : nq * rs_q;
    const int64_t hs_k = lk.s.head ? lk.s.head : c.d, rs_k = lk.s.row ? lk.s.row : c.hkv * hs_k,
                  bs_k = lk.s.batch ? lk.s.batch : nk * rs_k;
    for (int64_t x = 0; x < mask_n; ++x) {
      ASSERT_LE(mask_g[x], 2) << "tile_mask entry " << x << " not written";
      legal += mask_c[x] != mala::kTileIllegal;
      retained += mask_c[x] == mala::kTileRetained;
      if (mask_g[x] == mask_c[x]) continue;
      ASSERT_NE(mask_c[x], mala::kTileIllegal) << "tile " << x << ": GPU visited an illegal tile";
      ASSERT_NE(mask_g[x], mala::kTileIllegal) << "tile " << x << ": GPU missed a legal tile";
      // A flip: its margin must be within rounding.
      const int64_t j = x % nkt, i = (x / nkt) % nqt, h = (x / (nkt * nqt)) % c.hq, b = x / (nkt * nqt * c.hq);
      const int64_t lq_b = varlen ? cu_q[b + 1] - cu_q[b] : nq, lk_b = varlen ? cu_k[b + 1] - cu_k[b] : nk;
      float margin = -INFINITY;
      for (int64_t r = i * tiles.block_q; r < std::min<int64_t>(lq_b, (i + 1) * tiles.block_q); ++r) {
        const int L = mala::rule::visible_keys(static_cast<int>(r), static_cast<int>(lq_b), static_cast<int>(lk_b), c.causal);
        const int64_t qoff = varlen ? (cu_q[b] + r) * rs_q + h * hs_q : b * bs_q + r * rs_q + h * hs_q;
        const int64_t lidx = varlen ? h * cu_q.back() + cu_q[b] + r : (b * c.hq + h) * nq + r;
        float mx = -INFINITY;
        for (int64_t kk = j * tiles.block_k; kk < std::min<int64_t>(L, (j + 1) * tiles.block_k); ++kk) {
          const int64_t koff = varlen ? (cu_k[b] + kk) * rs_k + (h / (c.hq / c.hkv)) * hs_k
                                      : b * bs_k + kk * rs_k + (h / (c.hq / c.hkv)) * hs_k;
          float dot = 0.f;
          for (int64_t e = 0; e < c.d; ++e) dot += q[qoff + e] * k[koff + e];
          mx = std::max(mx, dot * scale);
        }
        if (mx == -INFINITY) continue;
        margin = std::max(margin, mala::rule::row_margin(mx, lse[lidx], log_tau - std::log(static_cast<float>(L))));
      }
      EXPECT_LT(std::fabs(margin), 2e-3f) << "tile " << x << " flipped with margin " << margin;
      ++flips;
    }
    exact_decisions = flips == 0;
    EXPECT_LE(flips, 1 + legal / 1000) << "too many rounding flips";
    const auto slots_g = gslots.download();
    int64_t slot_mismatch = 0;
    for (int64_t x = 0; x < lse_n; ++x) {
      ASSERT_GE(slots_g[x], 0) << "bwd_slots[" << x << "] not written";
      slot_mismatch += slots_g[x] != slots_c[x];
    }
    if (exact_decisions) EXPECT_EQ(slot_mismatch, 0);
    if (!c.quiet)
      std::printf("  [bwd] %s d=%lld nq=%lld nk=%lld tau=%g %s: legal tiles %lld, retained %lld (%.1f%%), flips %lld\n",
                  mala::dtype_name(c.dtype), (long long)c.d, (long long)nq, (long long)nk, c.tau, c.regime.c_str(),
                  (long long)legal, (long long)retained, legal ? 100.0 * retained / legal : 0.0, (long long)flips);
  }

  // Gradients.
  struct G {
    const char* name;
    DeviceBuffer<uint16_t>* dev;
    const std::vector<float>* ref;
    const std::vector<int64_t>* off;
  } grads[] = {{"dq", &gdq, &dq_c, &offq}, {"dk", &gdk, &dk_c, &offk}, {"dv", &gdv, &dv_c, &offk}};
  double max_err = 0;
  for (const G& gr : grads) {
    const auto bits = gr.dev->download();
    std::vector<uint16_t> lb(gr.off->size());
    for (size_t x = 0; x < lb.size(); ++x) lb[x] = bits[(*gr.off)[x]];
    EXPECT_EQ(count_poison(lb), 0u) << gr.name << ": unwritten elements";
    const std::vector<float> got = widen(lb, c.dtype);
    EXPECT_EQ(count_nan(got), 0u) << gr.name << ": NaN";
    const std::vector<float> ref = pick(*gr.ref, *gr.off);
    const double err = rel_l2(got, ref);
    EXPECT_LT(err, c.max_rel_l2) << gr.name << " rel L2 " << err << (exact_decisions ? "" : " (with flips)");
    max_err = std::max(max_err, err);
  }
  if (stats) {
    ++stats->cases;
    stats->tiles += legal;
    stats->flips += flips;
    stats->max_err = std::max(stats->max_err, max_err);
  }
}

using mala::cuda_backend::BwdVariant;

// The fixtures: the backward kernel of the test parameter, selected in-process.
class BackwardKernels : public ::testing::TestWithParam<BwdVariant> {
 protected:
  void SetUp() override {
    mala::cuda_backend::KernelOverride o;
    o.bwd = GetParam();
    mala::cuda_backend::set_kernel_override(o);
  }
  void TearDown() override { mala::cuda_backend::set_kernel_override({}); }
};
class BackwardGpuSmall : public BackwardKernels {};
class BackwardGpu : public BackwardKernels {};

}  // namespace

auto bwd_variant_name = [](const ::testing::TestParamInfo<BwdVariant>& i) {
  return std::string(mala::cuda_backend::variant_name(i.param));
};
INSTANTIATE_TEST_SUITE_P(Kernels, BackwardGpuSmall,
                         ::testing::Values(BwdVariant::automatic, BwdVariant::mma_sync),
                         bwd_variant_name);
INSTANTIATE_TEST_SUITE_P(Kernels, BackwardGpu,
                         ::testing::Values(BwdVariant::automatic, BwdVariant::mma_sync),
                         bwd_variant_name);

namespace {

// ---- small shapes (also run under compute-sanitizer: names contain "Small") -------------------

TEST_P(BackwardGpuSmall, Basic) {
  Case c;
  c.nq = c.nk = 200;
  run_case(c);
}

TEST_P(BackwardGpuSmall, AllDimsDtypesMasks) {
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t d : {64, 128, 256})
      for (bool causal : {true, false})
        for (float tau : {0.f, 1.f}) {
          Case c;
          c.dtype = t;
          c.d = d;
          c.causal = causal;
          c.tau = tau;
          c.nq = c.nk = 173;
          c.seed = d + 7 * causal + 13 * (tau > 0);
          run_case(c);
        }
}

TEST_P(BackwardGpuSmall, SharpSkipping) {
  for (int64_t d : {64, 128, 256}) {
    Case c;
    c.regime = "sharp";
    c.d = d;
    c.nq = c.nk = 300;
    c.hq = 4;
    c.hkv = 1;
    run_case(c);
  }
}

// One split of a longer causal sequence (context parallelism): the offline test with the rows'
// whole lengths (rows_before), on the diagonal shard (causal) and an earlier one (every key seen).
TEST_P(BackwardGpuSmall, SplitOfALongerSequence) {
  for (int64_t d : {64, 128, 256})
    for (bool causal : {true, false}) {
      Case c;
      c.regime = "sharp";
      c.d = d;
      c.causal = causal;
      c.nq = c.nk = 320;
      c.hq = 4;
      c.hkv = 1;
      c.rows_before = causal ? 3 * 320 : 5 * 320;
      c.seed = 40 + d + causal;
      run_case(c);
    }
}

TEST_P(BackwardGpuSmall, VarlenStrided) {
  Case c;
  c.varlen_q = {70, 0, 130, 257};
  c.varlen_k = {70, 33, 200, 100};
  c.strided = true;
  c.regime = "sharp";
  run_case(c);
  c.causal = false;
  c.dtype = DType::f16;
  run_case(c);
}

// The small cases the dispatch tests share: 4 query heads on one KV head over 333 rows, and varlen
// with an empty sequence and unequal lengths.
Case small_gqa(int64_t d, const char* regime) {
  Case c;
  c.d = d;
  c.regime = regime;
  c.hq = 4;
  c.hkv = 1;
  c.nq = c.nk = 333;
  return c;
}
Case small_varlen() {
  Case v;
  v.varlen_q = {70, 0, 130, 257};
  v.varlen_k = {70, 33, 200, 100};
  v.regime = "sharp";
  return v;
}

// The dispatch's own kernel only: deterministic mode and varlen without totals (the mma.sync
// fallback on sm_90).  Deterministic runs on Hopper's warp-specialized kernel; elsewhere it must be refused.
// Every head dim at tau 0 and 1 and with the forward's tile mask; at d = 64 and 128 (fixed-point dQ)
// also gradients of 1e-30 and 1e15 (the rows' units at the clamp and far from 1).  The fixed point's
// int32 has the least room where its bound is loosest: keys with a
// large shared offset (max|K| 20x a typical element, dQ's adds cancelling) over 1024 keys, and tau = 4
// (the bound's 1 + tau for P's row sum, which the forward's skips push past 1); there its error
// against the CPU reference must stay that of the default mode's fp32 adds.  (Both modes' error is
// larger there, about 2.6e-2: dS rounded to 16 bits for the dQ product leaves offset x 2^-9 that no
// longer cancels.)
TEST_P(BackwardGpuSmall, DeterministicAndFallbacks) {
  if (GetParam() != BwdVariant::automatic) GTEST_SKIP() << "the dispatch's choice only";
  if (!mala_test::device_is_sm90()) GTEST_SKIP() << "deterministic mode needs sm_90";
  for (int64_t d : {64, 128, 256}) {
    for (float tau : {0.f, 1.f}) {
      Case c = small_gqa(d, "sharp");
      c.tau = tau;
      c.deterministic = true;
      run_case(c);
    }
    Case m = small_gqa(d, "sharp");
    m.deterministic = true;
    m.fwd_mask = true;
    run_case(m);
  }
  for (int64_t d : {64, 128})
    for (float scale : {1e-30f, 1e15f}) {
      Case c = small_gqa(d, "random");
      c.deterministic = true;
      c.dout_scale = scale;
      run_case(c);
    }
  for (int64_t d : {64, 128})
    for (float tau : {0.f, 4.f}) {
      Case c = small_gqa(d, "random");
      c.nq = c.nk = 1024;
      c.tau = tau;
      c.k_offset = 16.f;
      c.max_rel_l2 = 5e-2;
      FuzzStats dflt, fixed;
      run_case(c, &dflt);
      c.deterministic = true;
      run_case(c, &fixed);
      EXPECT_LE(fixed.max_err, 1.25 * dflt.max_err + 1e-4) << "d=" << d << " tau=" << tau;
      std::printf("  [bwd] fixed-point dQ, K offset 16, d=%lld tau=%g: max rel L2 %.3e (default %.3e)\n",
                  (long long)d, tau, fixed.max_err, dflt.max_err);
    }
  Case v = small_varlen();
  v.deterministic = true;
  run_case(v);
  v.deterministic = false;
  v.totals = false;
  run_case(v);
}

// The forward's tile mask (forward_tile_mask): tiles whose forward tiles were all skipped are
// skipped unscored (the warp-specialized kernel at d = 64 and 128; the others ignore it), with the
// same decisions, outputs and gradients as scoring them.
TEST_P(BackwardGpuSmall, ForwardTileMask) {
  for (int64_t d : {64, 128, 256})
    for (const char* regime : {"sharp", "random"})
      for (bool outputs : {true, false}) {
        Case c = small_gqa(d, regime);
        c.outputs = outputs;
        c.fwd_mask = true;
        run_case(c);
      }
  Case v = small_varlen();
  v.fwd_mask = true;
  run_case(v);
  Case n;
  n.causal = false;
  n.nq = 200;
  n.nk = 517;
  n.regime = "sharp";
  n.fwd_mask = true;
  run_case(n);
}

// backward_reads_forward_tile_mask: where autograd has the forward record its tile mask.  It says yes
// exactly where the dispatch hands the mask to the kernel (the tests above check that kernel's use).
TEST(BackwardGpuQuery, ReadsForwardTileMask) {
  if (!mala_test::device_is_sm90()) GTEST_SKIP();
  mala::cuda_backend::set_kernel_override({});
  mala::BackwardArgs a;
  a.device = mala::Device::cuda;
  a.dtype = DType::bf16;
  a.batch = 1;
  a.seqlen_q = a.seqlen_k = 4096;
  a.heads_q = 8;
  a.heads_kv = 1;
  a.head_dim = 128;
  a.causal = true;
  a.tau = 1.f;
  EXPECT_TRUE(mala::backward_reads_forward_tile_mask(a));
  a.head_dim = 64;
  a.dtype = DType::f16;
  EXPECT_TRUE(mala::backward_reads_forward_tile_mask(a));
  a.head_dim = 256;
  EXPECT_FALSE(mala::backward_reads_forward_tile_mask(a)) << "d = 256";
  a.head_dim = 128;
  a.tau = 0.f;
  EXPECT_FALSE(mala::backward_reads_forward_tile_mask(a)) << "tau = 0";
  a.tau = 1.f;
  a.deterministic = true;  // fixed-point dQ: the order of the adds does not matter
  EXPECT_TRUE(mala::backward_reads_forward_tile_mask(a)) << "deterministic, d = 128";
  a.head_dim = 64;
  EXPECT_TRUE(mala::backward_reads_forward_tile_mask(a)) << "deterministic, d = 64";
  a.head_dim = 128;
  a.deterministic = false;
  a.seqlen_q = a.seqlen_k = int64_t{1} << 20;  // 16384 query tiles: past the CTA's bitmap
  EXPECT_FALSE(mala::backward_reads_forward_tile_mask(a)) << "1M tokens";
  a.seqlen_q = a.seqlen_k = 4096;
  a.device = mala::Device::cpu;
  EXPECT_FALSE(mala::backward_reads_forward_tile_mask(a)) << "cpu";
  a.device = mala::Device::cuda;
  mala::cuda_backend::KernelOverride o;
  o.bwd = mala::cuda_backend::BwdVariant::mma_sync;
  mala::cuda_backend::set_kernel_override(o);
  EXPECT_FALSE(mala::backward_reads_forward_tile_mask(a)) << "mma_sync override";
  mala::cuda_backend::set_kernel_override({});
}

// ---- larger shapes -----------------------------------------------------------------------------

TEST_P(BackwardGpu, UnequalLengths) {
  for (auto nn : {std::pair<int, int>{200, 517}, {517, 200}, {1, 300}, {300, 1}})
    for (bool causal : {true, false})
      for (float tau : {0.f, 1.f}) {
        Case c;
        c.nq = nn.first;
        c.nk = nn.second;
        c.causal = causal;
        // With one visible key (Nk = 1) tau = 1 is an exact tie (p = 1 = tau / L): rounding decides
        // it either way and the row's whole gradient goes with it.  Test tau = 0.5 there.
        c.tau = (nn.second == 1 && tau > 0) ? 0.5f : tau;
        c.regime = tau > 0 ? "sharp" : "random";
        run_case(c);
      }
}

TEST_P(BackwardGpu, BatchStridedGqa) {
  for (int64_t d : {128, 256})
    for (int splits : {0, 1, 2, 4}) {
      Case c;
      c.d = d;
      c.batch = 2;
      c.nq = c.nk = 391;
      c.hq = 8;
      c.hkv = 2;
      c.strided = true;
      c.regime = "sharp";
      c.head_splits = splits;
      c.user_workspace = splits == 2;
      run_case(c);
    }
}

TEST_P(BackwardGpu, MhaNoOutputs) {
  Case c;
  c.hq = c.hkv = 3;
  c.nq = c.nk = 333;
  c.outputs = false;
  c.dtype = DType::f16;
  run_case(c);
}

TEST_P(BackwardGpu, ForwardTileMaskLong) {
  for (double sharpness : {16.0, 4.0}) {
    Case c;
    c.regime = "synthetic";
    c.sharpness = sharpness;
    c.nq = c.nk = 2048;
    c.hq = 8;
    c.hkv = 1;
    c.fwd_mask = true;
    run_case(c);
  }
}

TEST_P(BackwardGpu, DeterministicGqaLong) {
  if (GetParam() != BwdVariant::automatic || !mala_test::device_is_sm90()) GTEST_SKIP();
  for (float tau : {0.f, 1.f}) {
    Case c;
    c.regime = "synthetic";
    c.sharpness = 4.0;
    c.nq = c.nk = 2048;
    c.hq = 8;
    c.hkv = 1;
    c.tau = tau;
    c.deterministic = true;
    run_case(c);
  }
}

// Head dim 256 (its own warp-specialized kernels on Hopper: 64-key CTAs, two 32-row decision tiles per
// query step, and a query-major dQ kernel): lengths that end inside a step or a half, bottom-right
// causal, varlen (batch strides and GQA with head splits: BatchStridedGqa).
TEST_P(BackwardGpu, HeadDim256Layouts) {
  for (auto nn : {std::pair<int, int>{200, 517}, {517, 200}, {97, 97}})
    for (bool causal : {true, false})
      for (float tau : {0.f, 1.f}) {
        Case c;
        c.d = 256;
        c.nq = nn.first;
        c.nk = nn.second;
        c.causal = causal;
        c.tau = tau;
        c.regime = tau > 0 ? "sharp" : "random";
        c.seed = 300 + nn.first + causal + 2 * (tau > 0);
        run_case(c);
      }
  Case v;
  v.d = 256;
  v.varlen_q = {70, 0, 130, 257};
  v.varlen_k = {70, 33, 200, 100};
  v.strided = true;
  v.regime = "sharp";
  run_case(v);
}

TEST_P(BackwardGpu, SyntheticWorkload) {
  for (int64_t d : {64, 128, 256}) {
    for (double sharp : {1.0, 4.0}) {
      Case c;
      c.regime = "synthetic";
      c.sharpness = sharp;
      c.d = d;
      c.nq = c.nk = 1024;
      c.hq = 8;
      c.hkv = 1;
      run_case(c);
    }
  }
}

}  // namespace

// ---- fuzz (issue #35): random shapes against the CPU, the dispatch's own kernels ---------------
// Batch 1-3 or varlen (1-4 sequences, empty ones included), lengths 1..700 (equal or not),
// bottom-right causal or not, head dims 64/128/256, bf16/fp16, MHA/GQA/MQA up to 8 query heads,
// tau in {0, 0.25, 1, 2}, random, sharp or synthetic inputs, strided, forced head splits, no
// outputs, a user workspace, varlen without totals and (sm_90) deterministic mode now and then.
namespace {

// The sequences of a case as (len_q, len_k) pairs.
std::vector<std::pair<int64_t, int64_t>> sequences(const Case& c) {
  std::vector<std::pair<int64_t, int64_t>> s;
  if (c.varlen_q.empty()) s.assign(1, {c.nq, c.nk});
  for (size_t b = 0; b < c.varlen_q.size(); ++b) s.push_back({c.varlen_q[b], c.varlen_k[b]});
  return s;
}

// Whether some query tile's decision on key tile 0 rests on a row with one visible key alone (the
// tile's other rows see no key): at tau = 1 that row is an exact tie (p = 1 = tau / L), which
// rounding decides either way, with the row's whole gradient (UnequalLengths tests tau = 0.5 there).
// In a causal sequence with len_q >= len_k the one such row is row len_q - len_k, preceded by rows
// that see nothing and followed by rows that see more keys (and keep the tile).
bool one_key_row_decides(const Case& c, int64_t block_q) {
  for (const auto& s : sequences(c)) {
    const int64_t lq = s.first, lk = s.second;
    if (lq == 0 || lk == 0) continue;
    if (lk == 1) return true;
    if (c.causal && lq >= lk && (lq - lk) % block_q == block_q - 1) return true;
  }
  return false;
}

// (query rows) x (query heads) that see at least `keys` keys.
int64_t rows_seeing(const Case& c, int64_t keys) {
  int64_t n = 0;
  for (const auto& s : sequences(c))
    for (int64_t r = 0; r < s.first; ++r)
      n += mala::rule::visible_keys(static_cast<int>(r), static_cast<int>(s.first), static_cast<int>(s.second),
                                    c.causal) >= keys;
  return n * (c.varlen_q.empty() ? c.batch : 1) * c.hq;
}

Case draw_backward_case(Fuzz& fz, int /*index*/) {
  Case c;
  c.quiet = true;
  c.seed = fz.next() >> 8;
  c.dtype = fz.chance(0.5) ? DType::bf16 : DType::f16;
  c.d = fz.pick({64, 128, 256});
  c.causal = fz.chance(0.6);
  std::tie(c.hq, c.hkv) = fz.heads();
  c.strided = fz.chance(0.25);
  const bool varlen = fz.chance(0.2);
  if (varlen) {
    const int n = fz.uniform(1, 4);
    int max_q = 0, max_k = 0;
    for (int b = 0; b < n; ++b) {
      const int kind = fz.uniform(0, 19);
      int lq = fz.length(700), lk = fz.chance(0.4) ? lq : fz.length(700);
      if (kind < 2) lq = lk = 0;  // an empty sequence
      else if (kind == 2) lq = 0;  // keys without queries (zero dK, dV)
      else if (kind == 3) lk = 0;  // queries without keys (zero dQ)
      c.varlen_q.push_back(lq), c.varlen_k.push_back(lk);
      max_q = std::max(max_q, lq), max_k = std::max(max_k, lk);
    }
    if (max_q == 0) c.varlen_q[0] = fz.length(700);  // seqlen_q and seqlen_k must be >= 1
    if (max_k == 0) c.varlen_k[0] = fz.length(700);
    c.totals = fz.chance(0.8);
  } else {
    c.batch = fz.pick({1, 1, 2, 3});
    c.nq = fz.length(700);
    c.nk = fz.chance(0.4) ? c.nq : fz.length(700);
  }
  const int regime = fz.uniform(0, 99);
  const float sigma = fz.pick({1.5f, 2.5f});
  const double sharpness = fz.pick({1.0, 2.0, 4.0});
  if (regime < 12 && !varlen) {
    // make_workload: batch 1, nq == nk, not strided; at least a tile of rows (its small-N rows
    // attend to a sink: the gradients of a handful of saturated rows are all rounding).
    c.regime = "synthetic";
    c.sharpness = sharpness;
    c.batch = 1;
    c.nq = c.nk = std::max<int64_t>(c.nq, 64);
    c.strided = false;
  } else if (regime < 50) {
    c.regime = "sharp";
    c.sigma = sigma;
    // Sharp rows that see a few keys saturate (p = 1): their gradient is rounding noise.  Keep
    // enough rows that see many keys for the relative errors to mean something.
    if (rows_seeing(c, 32) < 64) c.regime = "random";
  }
  c.tau = fz.pick({0.f, 0.25f, 1.f, 2.f});
  const float tau_alt = fz.pick({0.25f, 1.f});
  // tau = 2 ties a row that sees two keys when its p saturates to 1 = tau / L (sharp and synthetic
  // inputs): random inputs only.
  if (c.tau == 2.f && c.regime != "random") c.tau = tau_alt;
  mala::BackwardArgs probe;
  probe.device = mala::Device::cuda;
  probe.head_dim = c.d;
  if (c.tau == 1.f && one_key_row_decides(c, mala::backward_tiles(probe).block_q)) c.tau = 0.5f;
  const int group = static_cast<int>(c.hq / c.hkv);
  const int split = fz.uniform(1, group);
  if (fz.chance(0.2) && group % split == 0) c.head_splits = split;
  c.outputs = fz.chance(0.9);
  c.user_workspace = fz.chance(0.1);
  c.fwd_mask = fz.chance(0.3);
  // Deterministic mode: sm_90's warp-specialized kernel (d = 64, 128; varlen with totals).
  if (fz.chance(0.1) && mala_test::device_is_sm90() && c.d <= 128 && (!varlen || c.totals)) {
    c.deterministic = true;
    c.head_splits = 0;
  }
  return c;
}

}  // namespace

TEST(BackwardFuzz, RandomShapes) {
  if (!mala::cuda_available()) GTEST_SKIP() << "no CUDA device";
  mala::cuda_backend::set_kernel_override({});
  run_fuzz("BackwardFuzz", 400, 2, draw_backward_case, [](const Case& c, FuzzStats* st) { run_case(c, st); });
}
