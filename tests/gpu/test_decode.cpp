// GPU decode (src/cuda/decode/) against the CPU implementation (mala::decode, Device::cpu) run on
// the same rounded inputs in fp32 with the kernel's tiles and num_splits.
//   O, lse rel L2 < 1e-2; tile_mask equal except rounding flips (counted, < 0.1% of legal tiles or
//   at most 1 in small cases); fwd_slots equal where no flip happened; poisoned outputs all written;
//   no NaN; batch > 1 with different lengths; paged == contiguous; appended K/V present in the cache;
//   num_splits = 1 equals the forward's last row; CUDA-graph capture replayed with new cache_seqlens.
//   Both split rules (seeded, the default, and per_split) at 1, 2, 16 and 128 splits; with the seeded
//   rule the omitted mass stays within tau / (1 + tau) over thousands of rows.
// Every test runs once per split-kernel instance (the kernel override of src/cuda/backend.h, a test
// parameter): the dispatch's own choice and the instance sized for sm_80's shared memory.
// DecodeFuzz.RandomShapes runs check_case on 300 random shapes under the dispatch's own kernel
// (seeded; MALA_FUZZ_SEED, MALA_FUZZ_CASES, MALA_FUZZ_CASE: see gpu_util.h).
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/backend.h"
#include "gpu_util.h"
#include "mala/mala.h"

namespace {

using mala::DType;
using mala::Device;
using namespace mala_test;

struct Case {
  int64_t batch = 1, seqlen_q = 1, heads_q = 8, heads_kv = 1, head_dim = 128, capacity = 4096;
  std::vector<int32_t> seqlens{4000};
  int64_t seqlen_new = 0;
  int64_t page_size = 0;  // 0 = contiguous
  bool pack = true, causal = true;
  float tau = 1.f;
  DType dtype = DType::bf16;
  int num_splits = 0;
  mala::SplitRule split_rule = mala::SplitRule::seeded;  // the library's default
  double sharpness = 0;  // > 0: synthetic structure (keys near the query position score high)
  float q_std = 1.f;     // query entries ~ N(0, q_std^2): larger is sharper attention on random keys
  float ramp = 0;        // > 0: scores fall by `ramp` nats per 128 keys from the newest key (+ N(0, 1))
  uint64_t seed = 1;
  bool quiet = false;    // no per-case line (the fuzz test prints a summary)
};

struct Inputs {
  std::vector<float> q, kc, vc, kn, vn;  // rounded fp32: q [B,Nq,Hq,d], caches [B,cap,Hkv,d], new [B,Nn,Hkv,d]
};

Inputs make_inputs(const Case& c) {
  Inputs in;
  const int64_t d = c.head_dim;
  in.q = randn(c.batch * c.seqlen_q * c.heads_q * d, c.seed * 11 + 1, c.q_std);
  in.kc = randn(c.batch * c.capacity * c.heads_kv * d, c.seed * 11 + 2);
  in.vc = randn(c.batch * c.capacity * c.heads_kv * d, c.seed * 11 + 3);
  const int64_t nn = std::max<int64_t>(c.seqlen_new, 1);
  in.kn = randn(c.batch * nn * c.heads_kv * d, c.seed * 11 + 4);
  in.vn = randn(c.batch * nn * c.heads_kv * d, c.seed * 11 + 5);
  if (c.ramp > 0) {
    // Dimension 0 carries the ramp: q[0] = sqrt(d) and K[pos][0] = -ramp * (Nk - 1 - pos) / 128, so
    // q.k / sqrt(d) = the ramp plus the other dimensions' N(0, 1).  The mass falls off smoothly, so
    // skipped tiles sit near the threshold and omit measurable mass.
    for (int64_t i = 0; i < c.batch * c.seqlen_q * c.heads_q; ++i) in.q[i * d] = std::sqrt(static_cast<float>(d));
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t nk = c.seqlens[b] + c.seqlen_new;
      auto ramp_at = [&](int64_t pos) { return -c.ramp * static_cast<float>(nk - 1 - pos) / 128.f; };
      for (int64_t h = 0; h < c.heads_kv; ++h) {
        for (int64_t pos = 0; pos < c.capacity; ++pos) in.kc[((b * c.capacity + pos) * c.heads_kv + h) * d] = ramp_at(pos);
        for (int64_t t = 0; t < c.seqlen_new; ++t)
          in.kn[((b * c.seqlen_new + t) * c.heads_kv + h) * d] = ramp_at(c.seqlens[b] + t);
      }
    }
  }
  if (c.sharpness > 0) {
    // A shared direction u: the queries carry +a*u, a few "needle" keys and the most recent keys
    // carry +a*u too, so the decode rows attend sharply to them and skip most of the cache.
    std::vector<float> u = randn(d, c.seed * 11 + 6);
    double n2 = 0;
    for (float x : u) n2 += x * x;
    const float a = static_cast<float>(std::sqrt(c.sharpness * std::sqrt(static_cast<double>(d)) / std::sqrt(n2)));
    auto add = [&](float* row, float w) {
      for (int64_t x = 0; x < d; ++x) row[x] += w * a * u[x] / static_cast<float>(std::sqrt(n2 / d));
    };
    for (int64_t i = 0; i < c.batch * c.seqlen_q * c.heads_q; ++i) add(&in.q[i * d], 1.f);
    std::mt19937_64 rng(c.seed * 11 + 7);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t pos = 0; pos < c.capacity; ++pos)
        for (int64_t h = 0; h < c.heads_kv; ++h) {
          const bool recent = pos + 64 >= c.seqlens[b] && pos < c.seqlens[b];
          const bool needle = (rng() % 1000) == 0;
          if (recent || needle) add(&in.kc[((b * c.capacity + pos) * c.heads_kv + h) * d], 1.f);
        }
  }
  return in;
}

struct Outputs {
  std::vector<float> o, lse;
  std::vector<int32_t> slots;
  std::vector<uint8_t> mask;
  std::vector<float> kc_after, vc_after;  // contiguous view of the cache after the call
  size_t poison = 0, nan = 0;
  mala::Tiles tiles;
  int splits = 0;
};

int64_t n_tiles_q(const Case& c, int bq) {
  const int64_t rows = c.pack ? c.seqlen_q * (c.heads_q / c.heads_kv) : c.seqlen_q;
  return (rows + bq - 1) / bq;
}

mala::DecodeArgs base_args(const Case& c) {
  mala::DecodeArgs a;
  a.batch = c.batch;
  a.seqlen_q = c.seqlen_q;
  a.seqlen_new = c.seqlen_new;
  a.cache_capacity = c.capacity;
  a.heads_q = c.heads_q;
  a.heads_kv = c.heads_kv;
  a.head_dim = c.head_dim;
  a.causal = c.causal;
  a.tau = c.tau;
  a.pack_gqa = c.pack;
  a.num_splits = c.num_splits;
  a.split_rule = c.split_rule;
  return a;
}

// Paged layout: page p of sequence b lives at physical page perm[b * pages + p].
struct Paging {
  int64_t pages_per_seq = 0, num_pages = 0;
  std::vector<int32_t> table;
};
Paging make_paging(const Case& c) {
  Paging pg;
  pg.pages_per_seq = (c.capacity + c.page_size - 1) / c.page_size;
  pg.num_pages = c.batch * pg.pages_per_seq + 3;  // a few unused pages
  std::vector<int32_t> perm(pg.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(c.seed * 7 + 3);
  std::shuffle(perm.begin(), perm.end(), rng);
  pg.table.assign(perm.begin(), perm.begin() + c.batch * pg.pages_per_seq);
  return pg;
}

// Runs the GPU decode on rounded inputs; returns outputs (cache read back in contiguous layout).
void run_gpu(const Case& c, const Inputs& in, Outputs* out) {
  const int64_t d = c.head_dim, hkv = c.heads_kv;
  mala::DecodeArgs a = base_args(c);
  a.device = Device::cuda;
  a.dtype = c.dtype;
  out->tiles = mala::decode_tiles(a);
  out->splits = mala::decode_num_splits(a);
  const int64_t nqt = n_tiles_q(c, out->tiles.block_q);
  const int64_t capacity = c.page_size ? ((c.capacity + c.page_size - 1) / c.page_size) * c.page_size : c.capacity;
  const int64_t nkt = (capacity + out->tiles.block_k - 1) / out->tiles.block_k;
  const int64_t owners = c.pack ? c.heads_kv : c.heads_q;

  std::vector<float> q = in.q, kn = in.kn, vn = in.vn;
  DeviceBuffer<uint16_t> dq(q.size()), dkn(kn.size()), dvn(vn.size());
  dq.upload(round_to(q, c.dtype));
  dkn.upload(round_to(kn, c.dtype));
  dvn.upload(round_to(vn, c.dtype));
  std::vector<float> kc = in.kc, vc = in.vc;
  std::vector<uint16_t> kbits = round_to(kc, c.dtype), vbits = round_to(vc, c.dtype);
  Paging pg;
  DeviceBuffer<int32_t> dtable;
  const int64_t row_elems = hkv * d;
  if (c.page_size) {
    pg = make_paging(c);
    std::vector<uint16_t> kp(pg.num_pages * c.page_size * row_elems, 0), vp(kp.size(), 0);
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t pos = 0; pos < c.capacity; ++pos) {
        const int64_t phys = pg.table[b * pg.pages_per_seq + pos / c.page_size] * c.page_size + pos % c.page_size;
        std::copy_n(&kbits[(b * c.capacity + pos) * row_elems], row_elems, &kp[phys * row_elems]);
        std::copy_n(&vbits[(b * c.capacity + pos) * row_elems], row_elems, &vp[phys * row_elems]);
      }
    kbits.swap(kp);
    vbits.swap(vp);
    dtable.resize(pg.table.size());
    dtable.upload(pg.table);
    a.block_table = dtable.ptr;
    a.max_pages = pg.pages_per_seq;
    a.page_size = c.page_size;
    a.num_pages = pg.num_pages;
    a.cache_capacity = 0;
  }
  DeviceBuffer<uint16_t> dkc(kbits.size()), dvc(vbits.size());
  dkc.upload(kbits);
  dvc.upload(vbits);
  DeviceBuffer<int32_t> dlen(c.batch);
  dlen.upload(c.seqlens);
  DeviceBuffer<uint16_t> dout(c.batch * c.seqlen_q * c.heads_q * d);
  DeviceBuffer<float> dlse(c.batch * c.heads_q * c.seqlen_q);
  DeviceBuffer<int32_t> dslots(c.batch * c.heads_q * c.seqlen_q);
  DeviceBuffer<uint8_t> dmask(c.batch * owners * nqt * nkt);

  a.q = dq.ptr;
  a.k_cache = dkc.ptr;
  a.v_cache = dvc.ptr;
  a.cache_seqlens = dlen.ptr;
  if (c.seqlen_new > 0) {
    a.k_new = dkn.ptr;
    a.v_new = dvn.ptr;
  }
  a.o = dout.ptr;
  a.lse = dlse.ptr;
  a.fwd_slots = dslots.ptr;
  a.tile_mask = dmask.ptr;
  mala::Status st = mala::decode(a);
  ASSERT_TRUE(st.ok) << st.message;
  MALA_CUDA_CHECK(cudaDeviceSynchronize());
  MALA_CUDA_CHECK(cudaGetLastError());

  std::vector<uint16_t> obits = dout.download();
  out->poison = count_poison(obits);
  out->o = widen(obits, c.dtype);
  out->lse = dlse.download();
  out->slots = dslots.download();
  out->mask = dmask.download();
  out->nan = count_nan(out->o);
  for (float x : out->lse) out->nan += std::isnan(x);
  for (int32_t s : out->slots) out->poison += (s == -1);
  for (uint8_t m : out->mask) out->poison += (m == 0xFF);
  std::vector<uint16_t> ka = dkc.download(), va = dvc.download();
  out->kc_after.assign(c.batch * c.capacity * row_elems, 0.f);
  out->vc_after.assign(out->kc_after.size(), 0.f);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t pos = 0; pos < c.capacity; ++pos) {
      const int64_t phys = c.page_size ? pg.table[b * pg.pages_per_seq + pos / c.page_size] * c.page_size + pos % c.page_size
                                       : b * c.capacity + pos;
      for (int64_t x = 0; x < row_elems; ++x) {
        out->kc_after[(b * c.capacity + pos) * row_elems + x] = from_bits(ka[phys * row_elems + x], c.dtype);
        out->vc_after[(b * c.capacity + pos) * row_elems + x] = from_bits(va[phys * row_elems + x], c.dtype);
      }
    }
}

// CPU decode on the same rounded inputs (fp32), with the GPU's tiles and splits.
void run_cpu(const Case& c, const Inputs& in, const Outputs& gpu, Outputs* out) {
  mala::DecodeArgs a = base_args(c);
  a.device = Device::cpu;
  a.dtype = DType::f32;
  a.block_q = gpu.tiles.block_q;
  a.block_k = gpu.tiles.block_k;
  a.num_splits = gpu.splits;
  std::vector<float> q = in.q, kc = in.kc, vc = in.vc, kn = in.kn, vn = in.vn;
  round_to(q, c.dtype);
  round_to(kc, c.dtype);
  round_to(vc, c.dtype);
  round_to(kn, c.dtype);
  round_to(vn, c.dtype);
  const int64_t nqt = n_tiles_q(c, gpu.tiles.block_q);
  const int64_t capacity = c.page_size ? ((c.capacity + c.page_size - 1) / c.page_size) * c.page_size : c.capacity;
  const int64_t nkt = (capacity + gpu.tiles.block_k - 1) / gpu.tiles.block_k;
  const int64_t owners = c.pack ? c.heads_kv : c.heads_q;
  // The CPU runs contiguous with the padded capacity so its tile_mask has the GPU's width.
  const int64_t row_elems = c.heads_kv * c.head_dim;
  std::vector<float> kcp(c.batch * capacity * row_elems, 0.f), vcp(kcp.size(), 0.f);
  for (int64_t b = 0; b < c.batch; ++b) {
    std::copy_n(&kc[b * c.capacity * row_elems], c.capacity * row_elems, &kcp[b * capacity * row_elems]);
    std::copy_n(&vc[b * c.capacity * row_elems], c.capacity * row_elems, &vcp[b * capacity * row_elems]);
  }
  a.cache_capacity = capacity;
  out->o.assign(q.size(), 0.f);
  out->lse.assign(c.batch * c.heads_q * c.seqlen_q, 0.f);
  out->slots.assign(out->lse.size(), 0);
  out->mask.assign(c.batch * owners * nqt * nkt, 0xFF);
  a.q = q.data();
  a.k_cache = kcp.data();
  a.v_cache = vcp.data();
  a.cache_seqlens = c.seqlens.data();
  if (c.seqlen_new > 0) {
    a.k_new = kn.data();
    a.v_new = vn.data();
  }
  a.o = out->o.data();
  a.lse = out->lse.data();
  a.fwd_slots = out->slots.data();
  a.tile_mask = out->mask.data();
  mala::Status st = mala::decode(a);
  ASSERT_TRUE(st.ok) << st.message;
  out->kc_after.assign(c.batch * c.capacity * row_elems, 0.f);
  out->vc_after.assign(out->kc_after.size(), 0.f);
  for (int64_t b = 0; b < c.batch; ++b) {
    std::copy_n(&kcp[b * capacity * row_elems], c.capacity * row_elems, &out->kc_after[b * c.capacity * row_elems]);
    std::copy_n(&vcp[b * capacity * row_elems], c.capacity * row_elems, &out->vc_after[b * c.capacity * row_elems]);
  }
}

double finite_rel_l2(const std::vector<float>& x, const std::vector<float>& ref, size_t* inf_mismatch) {
  std::vector<float> a, b;
  *inf_mismatch = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isinf(ref[i]) || std::isinf(x[i])) {
      *inf_mismatch += !(std::isinf(ref[i]) && std::isinf(x[i]) && (ref[i] < 0) == (x[i] < 0));
      continue;
    }
    a.push_back(x[i]);
    b.push_back(ref[i]);
  }
  if (a.empty()) return 0;
  return rel_l2(a, b);
}

struct Report {
  double o_err = 0, lse_err = 0, retained_gpu = 0;
  size_t flips = 0, legal = 0;
  bool checked = false;  // the comparison ran to the end
};

Report check_case(const Case& c, const Inputs& in, const char* name) {
  Report rep;
  Outputs g, r;
  run_gpu(c, in, &g);
  if (::testing::Test::HasFatalFailure()) return rep;
  run_cpu(c, in, g, &r);
  if (::testing::Test::HasFatalFailure()) return rep;
  EXPECT_EQ(g.poison, 0u) << name << ": unwritten outputs";
  EXPECT_EQ(g.nan, 0u) << name << ": NaN in outputs";
  rep.o_err = rel_l2(g.o, r.o);
  size_t lse_inf = 0;
  rep.lse_err = finite_rel_l2(g.lse, r.lse, &lse_inf);
  EXPECT_EQ(lse_inf, 0u) << name << ": lse -inf pattern differs";
  // Tile decisions.
  size_t retained = 0;
  for (size_t i = 0; i < g.mask.size(); ++i) {
    if (r.mask[i] != mala::kTileIllegal) ++rep.legal;
    if (g.mask[i] == mala::kTileRetained) ++retained;
    if (g.mask[i] != r.mask[i]) {
      ++rep.flips;
      const bool both_legal = g.mask[i] != mala::kTileIllegal && r.mask[i] != mala::kTileIllegal;
      EXPECT_TRUE(both_legal) << name << ": legality differs at tile " << i << " (gpu " << int(g.mask[i]) << ", cpu "
                              << int(r.mask[i]) << ")";
    }
  }
  rep.retained_gpu = rep.legal ? double(retained) / rep.legal : 0;
  const size_t allowed = std::max<size_t>(1, rep.legal / 1000);
  EXPECT_LE(rep.flips, allowed) << name << ": tile decisions differ beyond rounding flips";
  if (rep.flips == 0) {
    EXPECT_EQ(g.slots, r.slots) << name << ": fwd_slots differ";
    EXPECT_LT(rep.o_err, 1e-2) << name;
    EXPECT_LT(rep.lse_err, 1e-2) << name;
  } else {
    // A flipped tile changes its query tile's result a little (its mass is below tau / L_q).
    EXPECT_LT(rep.o_err, 3e-2) << name;
  }
  EXPECT_EQ(g.kc_after, r.kc_after) << name << ": K cache after append differs";
  EXPECT_EQ(g.vc_after, r.vc_after) << name << ": V cache after append differs";
  if (!c.quiet)
    std::printf("[decode] %-28s %-9s tiles %dx%d splits %3d  O err %.2e  lse err %.2e  retained %.3f  flips %zu/%zu\n",
                name, mala::split_rule_name(c.split_rule), g.tiles.block_q, g.tiles.block_k, g.splits, rep.o_err,
                rep.lse_err, rep.retained_gpu, rep.flips, rep.legal);
  rep.checked = true;
  return rep;
}
Report check_case(const Case& c, const char* name) { return check_case(c, make_inputs(c), name); }

bool have_gpu() { return mala::cuda_available(); }

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

using mala::cuda_backend::DecodeVariant;

// The split-kernel instance of the test parameter, selected in-process.
class GpuDecode : public ::testing::TestWithParam<DecodeVariant> {
 protected:
  void SetUp() override {
    mala::cuda_backend::KernelOverride o;
    o.decode = GetParam();
    mala::cuda_backend::set_kernel_override(o);
  }
  void TearDown() override { mala::cuda_backend::set_kernel_override({}); }
};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Kernels, GpuDecode, ::testing::Values(DecodeVariant::automatic, DecodeVariant::small_smem),
                         [](const ::testing::TestParamInfo<DecodeVariant>& i) {
                           return std::string(mala::cuda_backend::variant_name(i.param));
                         });

namespace {

TEST_P(GpuDecode, SingleTokenBatchDifferentLengths) {
  REQUIRE_GPU();
  Case c;
  c.batch = 3;
  c.capacity = 5000;
  c.seqlens = {1000, 4997, 130};
  for (DType t : {DType::bf16, DType::f16}) {
    c.dtype = t;
    for (float tau : {0.f, 1.f}) {
      c.tau = tau;
      check_case(c, (std::string(mala::dtype_name(t)) + " tau=" + std::to_string(int(tau))).c_str());
    }
  }
}

TEST_P(GpuDecode, SyntheticSharp) {
  REQUIRE_GPU();
  Case c;
  c.batch = 2;
  c.capacity = 20000;
  c.seqlens = {19999, 12345};
  c.sharpness = 4.0;
  c.num_splits = 4;
  Report rep = check_case(c, "synthetic splits=4");
  EXPECT_LT(rep.retained_gpu, 0.9);
  c.num_splits = 1;
  check_case(c, "synthetic splits=1");
  c.num_splits = 0;
  check_case(c, "synthetic splits=auto");
}

TEST_P(GpuDecode, HeadDimsSplitsAndGqa) {
  REQUIRE_GPU();
  for (int64_t d : {64, 128, 256})
    for (int splits : {1, 3, 0}) {
      Case c;
      c.head_dim = d;
      c.batch = 2;
      c.heads_q = 8;
      c.heads_kv = 2;
      c.capacity = 3000;
      c.seqlens = {2999, 777};
      c.num_splits = splits;
      c.seed = d + splits;
      check_case(c, ("d=" + std::to_string(d) + " splits=" + std::to_string(splits)).c_str());
    }
}

TEST_P(GpuDecode, MultiTokenAppendPackedAndUnpacked) {
  REQUIRE_GPU();
  for (bool pack : {true, false})
    for (int64_t d : {64, 128}) {
      Case c;
      c.head_dim = d;
      c.batch = 2;
      c.seqlen_q = 5;
      c.seqlen_new = 5;
      c.heads_q = 12;
      c.heads_kv = 3;  // G = 4: 20 packed rows -> 2 query tiles
      c.capacity = 1500;
      c.seqlens = {1200, 3};
      c.pack = pack;
      c.dtype = DType::f16;
      c.num_splits = 2;
      check_case(c, (std::string(pack ? "packed" : "unpacked") + " Nq=5 new=5 d=" + std::to_string(d)).c_str());
    }
}

TEST_P(GpuDecode, EmptyRowsAndEmptyCache) {
  REQUIRE_GPU();
  Case c;
  c.batch = 3;
  c.seqlen_q = 6;
  c.seqlen_new = 2;
  c.heads_q = 4;
  c.heads_kv = 4;
  c.capacity = 300;
  c.seqlens = {0, 1, 297};  // Nk = 2, 3, 299: the first tokens of the short ones see nothing
  c.num_splits = 3;
  check_case(c, "empty rows");
  c.seqlen_new = 0;
  c.seqlen_q = 1;
  c.seqlens = {0, 0, 5};
  check_case(c, "empty cache");
  c.causal = false;
  c.seqlen_q = 3;
  c.seqlens = {10, 299, 1};
  check_case(c, "non-causal");
}

TEST_P(GpuDecode, PagedEqualsContiguous) {
  REQUIRE_GPU();
  for (int64_t page : {16, 256, 100}) {
    Case c;
    c.batch = 3;
    c.capacity = 2600;  // a multiple of no page size above
    c.seqlens = {2500, 10, 1700};
    c.seqlen_new = 2;
    c.seqlen_q = 2;
    c.num_splits = 3;
    c.capacity = (c.capacity + page - 1) / page * page;
    Inputs in = make_inputs(c);
    Outputs contiguous, paged;
    run_gpu(c, in, &contiguous);
    c.page_size = page;
    run_gpu(c, in, &paged);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    EXPECT_EQ(paged.poison, 0u);
    EXPECT_EQ(contiguous.o, paged.o) << "page " << page;
    EXPECT_EQ(contiguous.lse, paged.lse) << "page " << page;
    EXPECT_EQ(contiguous.mask, paged.mask) << "page " << page;
    EXPECT_EQ(contiguous.slots, paged.slots) << "page " << page;
    EXPECT_EQ(contiguous.kc_after, paged.kc_after) << "page " << page;
    EXPECT_EQ(contiguous.vc_after, paged.vc_after) << "page " << page;
    check_case(c, ("paged " + std::to_string(page)).c_str());
  }
}

// num_splits = 1 reproduces the forward's last row: forward over N = k * block + 1 tokens (its last
// query tile holds only the last row), decode of that row against the N keys, pack_gqa = false.
TEST_P(GpuDecode, OneSplitEqualsForwardLastRow) {
  REQUIRE_GPU();
  const int64_t hq = 4, hkv = 2, d = 128;
  for (double sharp : {0.0, 4.0}) {
    Case c;
    c.heads_q = hq;
    c.heads_kv = hkv;
    c.head_dim = d;
    c.pack = false;
    c.num_splits = 1;
    c.sharpness = sharp;
    mala::DecodeArgs probe = base_args(c);
    probe.device = Device::cuda;
    const mala::Tiles dt = mala::decode_tiles(probe);
    const int64_t fbq = 64;
    const int64_t N = 40 * fbq + 1;  // 2561 keys
    c.capacity = N;
    c.seqlens = {static_cast<int32_t>(N)};
    Inputs in = make_inputs(c);  // caches hold the N keys; q is the decode row
    // Forward inputs: q rows are random except the last, which is the decode row.
    std::vector<float> fq = randn(N * hq * d, 99);
    std::copy(in.q.begin(), in.q.end(), fq.end() - hq * d);
    round_to(fq, c.dtype);
    std::vector<float> k = in.kc, v = in.vc;
    round_to(k, c.dtype);
    round_to(v, c.dtype);
    mala::ForwardArgs f;
    f.device = Device::cpu;
    f.dtype = DType::f32;
    f.batch = 1;
    f.seqlen_q = f.seqlen_k = N;
    f.heads_q = hq;
    f.heads_kv = hkv;
    f.head_dim = d;
    f.tau = c.tau;
    f.block_q = static_cast<int>(fbq);
    f.block_k = dt.block_k;
    const int64_t nqt = (N + fbq - 1) / fbq, nkt = (N + dt.block_k - 1) / dt.block_k;
    std::vector<float> fo(fq.size()), flse(hq * N);
    std::vector<uint8_t> fmask(hq * nqt * nkt);
    f.q = fq.data();
    f.k = k.data();
    f.v = v.data();
    f.o = fo.data();
    f.lse = flse.data();
    f.tile_mask = fmask.data();
    mala::Status st = mala::forward(f);
    ASSERT_TRUE(st.ok) << st.message;

    Outputs g;
    run_gpu(c, in, &g);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    EXPECT_EQ(g.splits, 1);
    std::vector<float> ref_o(fo.end() - hq * d, fo.end()), ref_lse(hq);
    size_t flips = 0;
    for (int64_t h = 0; h < hq; ++h) {
      ref_lse[h] = flse[h * N + N - 1];
      for (int64_t j = 0; j < nkt; ++j) flips += g.mask[h * nkt + j] != fmask[(h * nqt + nqt - 1) * nkt + j];
    }
    const double oe = rel_l2(g.o, ref_o), le = rel_l2(g.lse, ref_lse);
    std::printf("[decode] forward last row sharp=%.0f: O err %.2e lse err %.2e flips %zu/%lld\n", sharp, oe, le, flips,
                static_cast<long long>(hq * nkt));
    EXPECT_LE(flips, 1u);
    EXPECT_LT(oe, 1e-2);
    EXPECT_LT(le, 1e-2);
  }
}

// Capture once (workspace given), replay with three different cache_seqlens, compare with eager calls.
TEST_P(GpuDecode, GraphCaptureReplay) {
  REQUIRE_GPU();
  for (float tau : {0.f, 1.f}) {
    Case c;
    c.batch = 2;
    c.capacity = 9000;
    c.seqlens = {8000, 100};
    c.seqlen_new = 1;
    c.tau = tau;
    Inputs in = make_inputs(c);
    std::vector<float> q = in.q, kc = in.kc, vc = in.vc, kn = in.kn, vn = in.vn;
    DeviceBuffer<uint16_t> dq(q.size()), dk(kc.size()), dv(vc.size()), dkn(kn.size()), dvn(vn.size());
    dq.upload(round_to(q, c.dtype));
    const std::vector<uint16_t> kbits = round_to(kc, c.dtype), vbits = round_to(vc, c.dtype);
    dkn.upload(round_to(kn, c.dtype));
    dvn.upload(round_to(vn, c.dtype));
    DeviceBuffer<int32_t> dlen(c.batch);
    DeviceBuffer<uint16_t> dout(q.size());
    DeviceBuffer<float> dlse(c.batch * c.heads_q);
    mala::DecodeArgs a = base_args(c);
    a.device = Device::cuda;
    a.dtype = c.dtype;
    a.q = dq.ptr;
    a.k_cache = dk.ptr;
    a.v_cache = dv.ptr;
    a.k_new = dkn.ptr;
    a.v_new = dvn.ptr;
    a.cache_seqlens = dlen.ptr;
    a.o = dout.ptr;
    a.lse = dlse.ptr;
    const size_t ws_bytes = mala::decode_workspace_size(a);
    DeviceBuffer<uint8_t> ws(std::max<size_t>(ws_bytes, 1));
    a.workspace = ws.ptr;
    a.workspace_bytes = ws_bytes;
    cudaStream_t stream;
    MALA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    a.stream = stream;
    const std::vector<std::vector<int32_t>> lens = {{8000, 100}, {17, 8998}, {4096, 0}};
    // Eager results.
    std::vector<std::vector<uint16_t>> eager_o;
    std::vector<std::vector<float>> eager_lse;
    for (const auto& L : lens) {
      dk.upload(kbits);
      dv.upload(vbits);
      dlen.upload(L);
      dout.poison();
      ASSERT_TRUE(mala::decode(a).ok);
      MALA_CUDA_CHECK(cudaStreamSynchronize(stream));
      eager_o.push_back(dout.download());
      eager_lse.push_back(dlse.download());
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MALA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    mala::Status st = mala::decode(a);
    MALA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(st.ok) << st.message;
    MALA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (size_t i = 0; i < lens.size(); ++i) {
      dk.upload(kbits);
      dv.upload(vbits);
      dlen.upload(lens[i]);
      dout.poison();
      MALA_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      MALA_CUDA_CHECK(cudaStreamSynchronize(stream));
      EXPECT_EQ(dout.download(), eager_o[i]) << "replay " << i << " tau " << tau;
      EXPECT_EQ(dlse.download(), eager_lse[i]) << "replay " << i << " tau " << tau;
      EXPECT_EQ(count_poison(eager_o[i]), 0u);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// Both split rules against the CPU reference on structured inputs (tiles are skipped): 1, 2, 16, 128
// splits (128, kMaxNumSplits, leaves splits of the shorter sequence without tiles), packed GQA, one token and five
// tokens with five appended keys (two query tiles of different L_q), and the paged cache equal to
// the contiguous one bit for bit.  Seeded keeps far less than per_split at many splits.
TEST_P(GpuDecode, SplitRulesAgainstCpu) {
  REQUIRE_GPU();
  for (int tokens : {1, 5}) {
    Case c;
    c.batch = 2;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.seqlen_q = tokens;
    c.seqlen_new = tokens > 1 ? tokens : 0;
    c.capacity = 20736;  // a multiple of both page sizes below (equal tile_mask widths)
    c.seqlens = {20000, 9000};
    c.sharpness = tokens == 1 ? 4.0 : 0.0;  // needles; a score ramp (tiles near the threshold)
    c.ramp = tokens == 1 ? 0.f : 1.f;
    c.seed = 3 + tokens;
    const Inputs in = make_inputs(c);
    for (int splits : {1, 2, 16, mala::kMaxNumSplits}) {
      double retained[2] = {0, 0};
      for (mala::SplitRule rule : {mala::SplitRule::seeded, mala::SplitRule::per_split}) {
        c.num_splits = splits;
        c.split_rule = rule;
        const std::string name = "Nq=" + std::to_string(tokens) + " splits=" + std::to_string(splits);
        Outputs contiguous, paged;
        c.page_size = 0;
        run_gpu(c, in, &contiguous);
        c.page_size = tokens == 1 ? 256 : 48;  // a tile inside one page; pages smaller than a tile
        run_gpu(c, in, &paged);
        c.page_size = 0;
        ASSERT_FALSE(::testing::Test::HasFatalFailure());
        EXPECT_EQ(contiguous.o, paged.o) << name;
        EXPECT_EQ(contiguous.lse, paged.lse) << name;
        EXPECT_EQ(contiguous.mask, paged.mask) << name;
        EXPECT_EQ(contiguous.slots, paged.slots) << name;
        retained[rule == mala::SplitRule::seeded ? 0 : 1] = check_case(c, in, name.c_str()).retained_gpu;
      }
      if (splits >= 16) EXPECT_LT(retained[0], retained[1]) << "seeded keeps less than per_split, " << splits << " splits";
    }
  }
}

// One split: both rules are the forward rule, bit for bit (nothing seeded, tile 0 not forced).
TEST_P(GpuDecode, OneSplitRulesEqual) {
  REQUIRE_GPU();
  Case c;
  c.batch = 2;
  c.seqlen_q = 3;
  c.seqlen_new = 3;
  c.heads_q = 8;
  c.heads_kv = 2;
  c.capacity = 6000;
  c.seqlens = {5990, 700};
  c.sharpness = 4.0;
  c.num_splits = 1;
  Inputs in = make_inputs(c);
  Outputs seeded, per_split;
  c.split_rule = mala::SplitRule::seeded;
  run_gpu(c, in, &seeded);
  c.split_rule = mala::SplitRule::per_split;
  run_gpu(c, in, &per_split);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  EXPECT_EQ(seeded.splits, 1);
  EXPECT_EQ(seeded.o, per_split.o);
  EXPECT_EQ(seeded.lse, per_split.lse);
  EXPECT_EQ(seeded.mask, per_split.mask);
  EXPECT_EQ(seeded.slots, per_split.slots);
}

// The guarantee of the seeded rule over thousands of rows (docs/spec.md, "Split rules"): every row's
// omitted dense mass 1 - exp(lse - lse_dense) is at most tau / (1 + tau) (lse_dense: the same call
// at tau = 0), no row ends empty, tile 0 and the newest tile of every query tile are retained.
// Random keys with wide queries (nothing is skipped: the bound must hold trivially), score ramps of
// 1 and 4 nats per tile (skipped tiles near the threshold) and needles (sharp: nearly everything
// skipped); 16 to 128 splits; packed GQA with three tokens (two query tiles whose rows see different
// numbers of keys) and appended K/V.  (With 128-key tiles the omitted mass stays far below the bound:
// the CPU reference of these inputs reaches about 2% of it.)
TEST_P(GpuDecode, SeededOmittedMassWithinBound) {
  REQUIRE_GPU();
  int64_t rows = 0, skipped = 0;
  double worst = 0;  // largest omitted mass / bound
  for (int input = 0; input < 4; ++input) {
    Case c;
    c.batch = 6;
    c.seqlen_q = 3;
    c.seqlen_new = 3;
    c.heads_q = 16;
    c.heads_kv = 2;
    c.capacity = 16384;
    c.seqlens = {16000, 9000, 4000, 1500, 300, 40};
    c.q_std = input == 0 ? 3.f : 1.f;
    c.ramp = input == 1 ? 1.f : input == 2 ? 4.f : 0.f;
    c.sharpness = input == 3 ? 2.0 : 0.0;
    c.seed = 21 + input;
    const Inputs in = make_inputs(c);
    c.tau = 0.f;
    Outputs dense;
    run_gpu(c, in, &dense);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    for (float tau : {0.5f, 1.f, 2.f})
      for (int splits : {16, 64, mala::kMaxNumSplits}) {
        c.tau = tau;
        c.num_splits = splits;
        Outputs g;
        run_gpu(c, in, &g);
        ASSERT_FALSE(::testing::Test::HasFatalFailure());
        const std::string what = "input " + std::to_string(input) + " tau=" + std::to_string(tau) +
                                 " splits=" + std::to_string(splits);
        ASSERT_EQ(g.poison, 0u) << what;
        ASSERT_EQ(g.nan, 0u) << what;
        const double bound = tau / (1.0 + tau);
        for (size_t r = 0; r < g.lse.size(); ++r) {
          ASSERT_TRUE(std::isfinite(g.lse[r])) << what << " row " << r << ": no row may end empty";
          ASSERT_GT(g.slots[r], 0) << what << " row " << r;
          const double omitted = 1.0 - std::exp(static_cast<double>(g.lse[r]) - dense.lse[r]);
          ASSERT_LE(omitted, bound + 1e-4) << what << " row " << r;
          worst = std::max(worst, omitted / bound);
          ++rows;
        }
        const int64_t nkt = (c.capacity + g.tiles.block_k - 1) / g.tiles.block_k;
        for (size_t base = 0; base < g.mask.size(); base += static_cast<size_t>(nkt)) {
          int64_t newest = -1;
          for (int64_t j = 0; j < nkt; ++j) {
            skipped += g.mask[base + j] == mala::kTileSkipped;
            if (g.mask[base + j] != mala::kTileIllegal) newest = j;
          }
          if (newest < 0) continue;
          ASSERT_EQ(g.mask[base], mala::kTileRetained) << what << ": tile 0 of query tile " << base / nkt;
          ASSERT_EQ(g.mask[base + newest], mala::kTileRetained) << what << ": newest tile of query tile " << base / nkt;
        }
      }
  }
  std::printf("[decode] seeded bound: %lld rows, %lld skipped tiles, worst omitted mass %.3f of the bound\n",
              static_cast<long long>(rows), static_cast<long long>(skipped), worst);
  EXPECT_GE(rows, 5000);
  EXPECT_GT(skipped, 1000) << "the property must be exercised with skipping";
  EXPECT_GT(worst, 0.005) << "skipping must omit some mass";
}

TEST_P(GpuDecode, SmallForSanitizer) {
  REQUIRE_GPU();
  Case c;
  c.batch = 2;
  c.seqlen_q = 2;
  c.seqlen_new = 1;
  c.capacity = 700;
  c.seqlens = {650, 40};
  c.num_splits = 3;
  check_case(c, "small contiguous");
  c.page_size = 64;
  c.capacity = 704;
  check_case(c, "small paged");
  c.tau = 0;
  check_case(c, "small paged dense");
  c.tau = 1;
  c.page_size = 128;  // a key tile never crosses a page
  c.capacity = 768;
  check_case(c, "small paged 128");
  c.page_size = 48;  // neither a power of two nor a multiple of the tile
  c.capacity = 720;
  check_case(c, "small paged 48");
  c.split_rule = mala::SplitRule::per_split;
  check_case(c, "small paged 48");
}

}  // namespace

// ---- fuzz (issue #35): random shapes against the CPU, the dispatch's own kernel ----------------
// Batch 1-3, cache lengths 0..3000 (empty now and then), 1-8 tokens with or without 1-8 appended
// keys, contiguous or paged (page sizes below, at and above the key tile, not powers of two too),
// packed GQA or not, causal or not, head dims 64/128/256, bf16/fp16, MHA/GQA/MQA up to 8 query
// heads, tau in {0, 0.25, 1, 2}, automatic and explicit num_splits up to 128 (kMaxNumSplits), both split rules,
// random, wide-query, needle (sharpness) and score-ramp inputs.
namespace {

struct DecodeFuzzCase {
  Case c;
  std::string name;
};

DecodeFuzzCase draw_decode_case(Fuzz& fz, int index) {
  Case c;
  c.quiet = true;
  c.seed = fz.next() >> 8;
  c.dtype = fz.chance(0.5) ? DType::bf16 : DType::f16;
  c.head_dim = fz.pick({64, 128, 256});
  std::tie(c.heads_q, c.heads_kv) = fz.heads();
  c.batch = fz.pick({1, 1, 2, 3});
  c.seqlen_q = fz.uniform(1, 8);
  c.seqlen_new = fz.chance(0.5) ? 0 : fz.uniform(1, 8);
  c.seqlens.clear();
  int32_t longest = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int32_t len = fz.chance(0.05) ? 0 : fz.chance(0.3) ? fz.uniform(1, 200) : fz.uniform(1, 3000);
    c.seqlens.push_back(len);
    longest = std::max(longest, len);
  }
  c.capacity = std::max<int64_t>(1, longest + c.seqlen_new + fz.uniform(0, 300));
  c.page_size = fz.chance(0.5) ? fz.pick({16, 48, 64, 100, 128, 256}) : 0;
  if (c.page_size) c.capacity = (c.capacity + c.page_size - 1) / c.page_size * c.page_size;
  c.pack = fz.chance(0.7);
  c.causal = fz.chance(0.8);
  c.tau = fz.pick({0.f, 0.25f, 1.f, 2.f});
  c.num_splits = fz.pick({0, 0, 1, 2, 3, 5, 16, 64, mala::kMaxNumSplits});
  c.split_rule = fz.chance(0.5) ? mala::SplitRule::seeded : mala::SplitRule::per_split;
  const int input = fz.uniform(0, 9);
  const double sharpness = fz.pick({2.0, 4.0});
  const float ramp = fz.pick({1.f, 4.f});
  const char* what = "random";
  if (input < 2) c.sharpness = sharpness, what = "needles";
  else if (input < 4) c.ramp = ramp, what = "ramp";
  else if (input == 4) c.q_std = 3.f, what = "wide q";
  std::string lens;
  for (size_t b = 0; b < c.seqlens.size(); ++b) lens += (b ? "," : "") + std::to_string(c.seqlens[b]);
  char tau[16];
  std::snprintf(tau, sizeof tau, "%g", c.tau);
  const std::string name = "fuzz #" + std::to_string(index) + ": " + mala::dtype_name(c.dtype) + " d" +
                           std::to_string(c.head_dim) + " hq" + std::to_string(c.heads_q) + "/" +
                           std::to_string(c.heads_kv) + (c.pack ? " packed" : "") + " Nq=" +
                           std::to_string(c.seqlen_q) + " new=" + std::to_string(c.seqlen_new) + " lens={" + lens +
                           "} cap=" + std::to_string(c.capacity) + " page=" + std::to_string(c.page_size) +
                           (c.causal ? " causal" : " noncausal") + " tau=" + tau + " splits=" +
                           std::to_string(c.num_splits) + " " + mala::split_rule_name(c.split_rule) + " " + what;
  return {c, name};
}

}  // namespace

TEST(DecodeFuzz, RandomShapes) {
  REQUIRE_GPU();
  mala::cuda_backend::set_kernel_override({});
  run_fuzz("DecodeFuzz", 300, 3, draw_decode_case, [](const DecodeFuzzCase& f, FuzzStats* st) {
    const Report r = check_case(f.c, f.name.c_str());
    if (!r.checked) return;
    ++st->cases;
    st->tiles += static_cast<int64_t>(r.legal);
    st->flips += static_cast<int64_t>(r.flips);
    st->max_err = std::max(st->max_err, r.o_err);
  });
}
