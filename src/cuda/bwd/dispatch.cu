// The CUDA backward's host side: the plan (tiles, head splits, workspace), the three steps, and the
// choice of the main kernel -- the only place where that happens:
//   sm_90 (sm_90a build), while the query tiles and heads fit the packed 16-bit tile words: the
//     warp-specialized TMA kernels where the TMA can describe Q, dO, K, V and the dQ accumulator
//     (varlen: when the call gives total_q and total_k): bwd/sm90_kernel.cuh at d = 64 and 128;
//     at d = 256 sm90_256_kernel.cuh (dK, dV, the decisions into the tile mask) then
//     sm90_256_dq_kernel.cuh (dQ straight into the output: no accumulator, no convert);
//   everything else, and on sm_90 what the TMA cannot describe: the mma.sync kernel
//     (bwd/kernel_sm80.cuh).
// deterministic = true runs only on the warp-specialized kernels (an error elsewhere): at d = 64 and
// 128 their dQ adds are in fixed point (int32), whose sums do not depend on the order of the adds; at
// d = 256 the dQ kernel adds nothing.  Each kernel's tau = 0 instance runs at tau = 0.  The kernel
// override (backend.h) forces the mma.sync kernel, the Q stages or the head splits for tests and
// benchmarks.
// The row-wise steps are one kernel template, bwd_rowwise_kernel<Op> (bwd/rowwise.cuh):
//   0. fixed-point dQ: the K/V maxima (BwdKvMax), for the rows' fixed-point units.
//   1. preprocess (BwdPreprocess): D = rowsum(dO * O) (fp32) into the workspace, lse in
//      log2 units, (tau > 0) each row's skip bound on raw scores and (fixed point) the row's dQ
//      unit beside it, bwd_slots zeroed; the dQ accumulator (and the dK/dV accumulators when used)
//      zeroed with cudaMemsetAsync.
//   2. the fused key-major main kernel, one instantiation per (dtype, head dim).
//   3. convert (BwdConvert): dQ (and dK/dV when they went through the fp32 workspace) in the input dtype.
// GQA: a CTA loops over `heads_per_cta` query heads of one KV group with dK/dV in registers.  When
// one CTA per (key tile, KV head) would leave the GPU underfilled the group is split and the CTAs
// add their partial dK/dV into an fp32 workspace (red.global.add), converted at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/layout.h"
#include "common/rule.h"
#include "cuda/backend.h"
#include "cuda/bwd/launch.h"
#include "cuda/bwd/rowwise.cuh"
#include "cuda/core/tma.cuh"

namespace mala {
namespace cuda_backend {

namespace {

using cuda::BwdParams;
using cuda::RowParams;
using cuda::RowStrides;

Tiles tiles_for_dim(int64_t d) {
  // Every kernel of a head dim decides on the same tile (bwd/tiles.h); unsupported head dims: d = 128's.
  const cuda::BwdTiles t = cuda::bwd_tiles(cuda::BwdKernelKind::sm80, d == 64 || d == 256 ? static_cast<int>(d) : 128);
  return {t.dec_rows, t.bk};
}

// An attribute of the current device, or `fallback` (an H100's value) when the query fails.
int64_t device_attribute(cudaDeviceAttr attr, int64_t fallback) {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, attr, dev) != cudaSuccess) {
    cudaGetLastError();
    return fallback;
  }
  return n > 0 ? n : fallback;
}

// 3 Q stages where the device's opt-in shared memory holds them (sm_90: yes; sm_80 at d = 128: no):
// they pay on the skip path, where a tile's Q is all it loads.
int pick_q_stages(int bytes3) {
  const int forced = kernel_override().bwd_q_stages;
  if (forced == 2 || forced == 3) return forced;
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return 2;
  }
  return optin >= bytes3 ? 3 : 2;
}

RowStrides strides(const Strides& s, int64_t seqlen, int64_t heads, int64_t d) {
  const layout::Resolved r = layout::resolve(s, seqlen, heads, d);
  return {r.batch, r.row, r.head};
}

// The TMA's view of the call's input tensors (false where it cannot describe one): Q, dO [rows, heads,
// d] in boxes of 64 rows, K, V in boxes of the kernel's key tile (128 rows, 64 at d = 256, and at
// d = 256 also 32 for the dQ kernel; varlen: the packed rows as one batch entry).
bool make_input_maps(const BackwardArgs& a, cuda::BwdTmaMaps* m) {
  const bool varlen = a.cu_seqlens_q != nullptr, bf16 = a.dtype == DType::bf16;
  if (varlen && (a.total_q <= 0 || a.total_k <= 0)) return false;
  const int64_t dd = a.head_dim;
  const RowStrides qs = strides(a.q_strides, a.seqlen_q, a.heads_q, dd), ks = strides(a.k_strides, a.seqlen_k, a.heads_kv, dd),
                   vs = strides(a.v_strides, a.seqlen_k, a.heads_kv, dd),
                   dos = strides(a.dout_strides, a.seqlen_q, a.heads_q, dd);
  const int d = static_cast<int>(dd), batch = varlen ? 1 : static_cast<int>(a.batch);
  const int hq = static_cast<int>(a.heads_q), hkv = static_cast<int>(a.heads_kv);
  const int rq = static_cast<int>(varlen ? a.total_q : a.seqlen_q), rk = static_cast<int>(varlen ? a.total_k : a.seqlen_k);
  const int kbox = cuda::bwd_tiles(cuda::BwdKernelKind::sm90_ws, d).bk;
  return cuda::make_kv_tensor_map(&m->q, a.q, bf16, d, rq, hq, batch, qs.r, qs.h, qs.b, 64) &&
         cuda::make_kv_tensor_map(&m->dout, a.dout, bf16, d, rq, hq, batch, dos.r, dos.h, dos.b, 64) &&
         cuda::make_kv_tensor_map(&m->k, a.k, bf16, d, rk, hkv, batch, ks.r, ks.h, ks.b, kbox) &&
         cuda::make_kv_tensor_map(&m->v, a.v, bf16, d, rk, hkv, batch, vs.r, vs.h, vs.b, kbox) &&
         (d != 256 || (cuda::make_kv_tensor_map(&m->k32, a.k, bf16, d, rk, hkv, batch, ks.r, ks.h, ks.b, 32) &&
                       cuda::make_kv_tensor_map(&m->v32, a.v, bf16, d, rk, hkv, batch, vs.r, vs.h, vs.b, 32)));
}
// ... and of the workspace: the dQ accumulator [heads_q * rows_q_cap, d] (fp32, or int32 for
// fixed-point dQ) in boxes of 128 bytes x 64 rows (not at d = 256, whose kernels need none), the
// per-row lse, bound, D and fixed-point unit [heads_q * rows_q_cap] in boxes of 68 (64 rows from the
// 16-byte boundary before the first).
bool make_tma_maps(const BackwardArgs& a, const BwdParams& p, cuda::BwdTmaMaps* m) {
  const int d = static_cast<int>(a.head_dim);
  const int64_t rows = a.heads_q * p.rows_q_cap;
  return make_input_maps(a, m) &&
         (d == 256 || (p.dq_fixed ? cuda::make_acc_tensor_map(&m->dq, p.dq_fixed, true, d, rows, 64) &&
                                        cuda::make_f32_vec_tensor_map(&m->unit, const_cast<float*>(p.dq_unit), rows, 68)
                                  : cuda::make_acc_tensor_map(&m->dq, p.dq_acc, false, d, rows, 64))) &&
         cuda::make_f32_vec_tensor_map(&m->lse, p.lse2, a.heads_q * p.rows_q_cap, 68) &&
         cuda::make_f32_vec_tensor_map(&m->bound, p.bound2, a.heads_q * p.rows_q_cap, 68) &&
         cuda::make_f32_vec_tensor_map(&m->dsum, p.dsum, a.heads_q * p.rows_q_cap, 68);
}

// Whether a d = 256 call runs the warp-specialized kernels, which need no dQ accumulator: decided
// with the plan (the workspace's size depends on it) and followed by choose_kernel.
bool d256_direct(const BackwardArgs& a, int n_q_tiles) {
  if (a.head_dim != 256 || kernel_override().bwd != BwdVariant::automatic || n_q_tiles >= 65536 || a.heads_q >= 65536)
    return false;
  const bool usable = a.dtype == DType::bf16 ? cuda::bwd_wgmma_usable<__nv_bfloat16, 256>()
                                             : cuda::bwd_wgmma_usable<__half, 256>();
  cuda::BwdTmaMaps m;
  return usable && make_input_maps(a, &m);
}

struct Plan {
  Tiles tiles;
  int n_q_tiles = 0, n_k_tiles = 0;
  int64_t rows_q_cap = 0, rows_k_cap = 0;
  int heads_per_cta = 1, head_splits = 1;
  bool kv_atomic = false;  // dK/dV through the fp32 workspace (head splits)
  int kv_slices = 0;       // > 0: one workspace slice per split (deterministic), else atomics
  bool dq_direct = false;  // d = 256 on the warp-specialized kernels: dQ needs no fp32 accumulator
  bool dq_fixed = false;   // deterministic at d = 64 / 128: the dQ accumulator in int32 fixed point
  size_t off_dsum = 0, off_lse2 = 0, off_bound2 = 0, off_dq = 0, off_dk = 0, off_dv = 0, off_unit = 0, off_kv_max = 0,
         off_mask = 0, bytes = 0;
};

size_t align_up(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

Plan make_plan(const BackwardArgs& a) {
  Plan pl;
  pl.tiles = tiles_for_dim(a.head_dim);
  pl.n_q_tiles = static_cast<int>(rule::ceil_div(static_cast<int>(a.seqlen_q), pl.tiles.block_q));
  pl.n_k_tiles = static_cast<int>(rule::ceil_div(static_cast<int>(a.seqlen_k), pl.tiles.block_k));
  pl.rows_q_cap = a.batch * a.seqlen_q;
  pl.rows_k_cap = a.batch * a.seqlen_k;
  const int group = static_cast<int>(a.heads_q / a.heads_kv);
  // Split the query-head group over CTAs only while the grid is small against the GPU.
  int splits = 1;
  const int forced = kernel_override().bwd_head_splits;
  if (forced >= 1 && forced <= group && group % forced == 0) {
    splits = forced;
  } else {
    const int64_t base = static_cast<int64_t>(pl.n_k_tiles) * a.batch * a.heads_kv;
    const int64_t want = 4 * device_attribute(cudaDevAttrMultiProcessorCount, 132);
    auto more = [&] {
      int next = splits + 1;
      while (group % next != 0) ++next;
      splits = next;
    };
    while (splits < group && base * splits < want) more();
    // At most two heads per CTA: CTAs that loop over more heads drift apart (a CTA with fewer query
    // tiles reaches the next head sooner) and stop sharing the L2 lines of the dQ rows they add to,
    // so the dQ reduce-adds go to DRAM.  (Not at d = 256, whose key-major kernel adds no dQ.)  One at
    // d = 128 from 32K query rows, outside the deterministic mode (whose dK/dV slices grow with the
    // splits): a sink's key tile, which every row keeps at tau > 0, is then one head's work, not
    // two, and where the rest is skipped that walk is the critical path; dense calls do not notice.
    // Shorter sequences keep two: not measured there, and each CTA's dK/dV atomics weigh more
    // against its shorter walk.  The measurements: docs/journal.md.
    const int max_heads = a.head_dim == 128 && !a.deterministic && a.seqlen_q >= 32768 ? 1 : 2;
    if (a.head_dim != 256)
      while (group / splits > max_heads) more();
  }
  pl.head_splits = splits;
  pl.heads_per_cta = group / splits;
  pl.kv_atomic = splits > 1;
  // Deterministic: each head split stores its dK/dV partial into a slice of its own, summed in split
  // order by the convert kernel, instead of adding it with atomics in arrival order.
  pl.kv_slices = a.deterministic && splits > 1 ? splits : 0;
  const size_t d = static_cast<size_t>(a.head_dim);
  size_t off = 0;
  pl.off_dsum = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap));
  pl.off_lse2 = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap));
  pl.dq_direct = d256_direct(a, pl.n_q_tiles);
  pl.dq_fixed = a.deterministic && a.head_dim != 256;  // (at d = 256 the dQ kernel adds nothing)
  pl.off_dq = off;
  if (!pl.dq_direct)
    off = align_up(off + 4 * static_cast<size_t>(a.heads_q * pl.rows_q_cap) * d);
  if (pl.kv_atomic) {
    const size_t n = static_cast<size_t>(std::max(pl.kv_slices, 1)) * static_cast<size_t>(a.heads_kv * pl.rows_k_cap) * d;
    pl.off_dk = off;
    off = align_up(off + sizeof(float) * n);
    pl.off_dv = off;
    off = align_up(off + sizeof(float) * n);
  }
  // Last, so that the accumulators keep their offsets (the backward's speed is sensitive to the dQ
  // accumulator's placement).
  pl.off_bound2 = off;
  off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap));
  // d = 256 kernels, tau > 0, no tile mask requested: the decisions the dQ kernel reads.
  if (pl.dq_direct && !rule::dense(a.tau) && a.tile_mask == nullptr) {
    pl.off_mask = off;
    off = align_up(off + static_cast<size_t>(a.batch * a.heads_q) * pl.n_q_tiles * pl.n_k_tiles);
  }
  if (pl.dq_fixed) {  // the rows' fixed-point units, the K/V maxima they come from
    pl.off_unit = off;
    off = align_up(off + sizeof(float) * static_cast<size_t>(a.heads_q * pl.rows_q_cap));
    pl.off_kv_max = off;
    off = align_up(off + 2 * sizeof(float));
  }
  pl.bytes = off;
  return pl;
}

// d = 64 / 128: whether the wgmma kernels can serve the call (the device, and BwdWork::Tile, which
// packs a head and a query tile into 16 bits each).
template <typename T, int D>
bool wgmma_fits(const BackwardArgs& a, const Plan& pl) {
  return pl.n_q_tiles < 65536 && a.heads_q < 65536 && cuda::bwd_wgmma_usable<T, D>();
}

// Whether the main kernel reads the forward's tile mask (BackwardArgs::forward_tile_mask): only the
// warp-specialized kernel at d = 64 / 128 does (deterministic or not), and not at tau = 0 (nothing is
// skipped), nor where a CTA's tiles outnumber its scored-tile bitmap.  (Where choose_kernel falls back
// to another kernel for want of tensor maps, that kernel ignores the mask.)
template <typename T, int D>
bool reads_fwd_mask(const BackwardArgs& a, const Plan& pl) {
  return D != 256 && !rule::dense(a.tau) && kernel_override().bwd == BwdVariant::automatic && wgmma_fits<T, D>(a, pl) &&
         static_cast<int64_t>(pl.heads_per_cta) * pl.n_q_tiles <= cuda::kBwdWsScoredTiles;
}

// The main kernel for this call (see the top of the file); maps is filled for sm90_ws.
template <typename T, int D>
cuda::BwdLaunch choose_kernel(const BackwardArgs& a, const Plan& pl, const BwdParams& p, bool dense,
                              cuda::BwdTmaMaps* maps) {
  cuda::BwdLaunch l;
  l.dense = dense;
  l.fwd_mask = p.fwd_mask != nullptr;  // (reads_fwd_mask: set only where sm90_ws at d = 64 / 128 can run)
  l.dq_fixed = p.dq_fixed != nullptr;  // (the plan's dq_fixed: deterministic, d = 64 / 128)
  l.kernel = cuda::BwdKernelKind::sm80;
  if (D == 256) {  // as the plan decided (d256_direct); a map that fails now leaves maps null
    if (pl.dq_direct) {
      l.kernel = cuda::BwdKernelKind::sm90_ws;
      if (make_tma_maps(a, p, maps)) l.maps = maps;
    }
    return l;
  }
  if (kernel_override().bwd == BwdVariant::mma_sync || !wgmma_fits<T, D>(a, pl)) return l;
  // Where the TMA cannot describe the tensors: the mma.sync kernel, as set above (docs/kernels.md,
  // "Known limits", states what that costs).
  if (make_tma_maps(a, p, maps)) {
    l.kernel = cuda::BwdKernelKind::sm90_ws;
    l.maps = maps;
  }
  return l;
}

template <typename T, int D>
cudaError_t run_typed(const BackwardArgs& a, const Plan& pl, char* ws, cudaStream_t stream) {
  const int64_t d = a.head_dim;
  const RowStrides qs = strides(a.q_strides, a.seqlen_q, a.heads_q, d),
                   ks = strides(a.k_strides, a.seqlen_k, a.heads_kv, d),
                   vs = strides(a.v_strides, a.seqlen_k, a.heads_kv, d),
                   os = strides(a.o_strides, a.seqlen_q, a.heads_q, d),
                   dos = strides(a.dout_strides, a.seqlen_q, a.heads_q, d),
                   dqs = strides(a.dq_strides, a.seqlen_q, a.heads_q, d),
                   dks = strides(a.dk_strides, a.seqlen_k, a.heads_kv, d),
                   dvs = strides(a.dv_strides, a.seqlen_k, a.heads_kv, d);
  float* dsum = reinterpret_cast<float*>(ws + pl.off_dsum);
  float* lse2 = reinterpret_cast<float*>(ws + pl.off_lse2);
  float* bound2 = reinterpret_cast<float*>(ws + pl.off_bound2);
  float* dq_acc = pl.dq_direct || pl.dq_fixed ? nullptr : reinterpret_cast<float*>(ws + pl.off_dq);
  float* dk_acc = pl.kv_atomic ? reinterpret_cast<float*>(ws + pl.off_dk) : nullptr;
  float* dv_acc = pl.kv_atomic ? reinterpret_cast<float*>(ws + pl.off_dv) : nullptr;
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  // Shared by the preprocess kernel (the raw-score bound) and the main kernel (P, the test).
  const float scale_log2 = rule::scale_log2(scale);
  const float log2_tau = rule::log2_tau(a.tau);
  const bool dense = rule::dense(a.tau);
  cudaError_t err;

  // The main kernel's parameters and choice, first: a deterministic call that no kernel serves
  // fails before anything is written.
  BwdParams p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.dout = a.dout;
  p.q_b = qs.b; p.q_r = qs.r; p.q_h = qs.h;
  p.k_b = ks.b; p.k_r = ks.r; p.k_h = ks.h;
  p.v_b = vs.b; p.v_r = vs.r; p.v_h = vs.h;
  p.do_b = dos.b; p.do_r = dos.r; p.do_h = dos.h;
  p.dk = a.dk;
  p.dv = a.dv;
  p.dq = a.dq;
  p.dq_b = dqs.b; p.dq_r = dqs.r; p.dq_h = dqs.h;
  p.dk_b = dks.b; p.dk_r = dks.r; p.dk_h = dks.h;
  p.dv_b = dvs.b; p.dv_r = dvs.r; p.dv_h = dvs.h;
  p.bwd_slots = a.bwd_slots;
  p.tile_mask = a.tile_mask;
  p.cu_q = a.cu_seqlens_q;
  p.cu_k = a.cu_seqlens_k;
  p.batch = static_cast<int>(a.batch);
  p.seqlen_q = static_cast<int>(a.seqlen_q);
  p.seqlen_k = static_cast<int>(a.seqlen_k);
  p.heads_q = static_cast<int>(a.heads_q);
  p.heads_kv = static_cast<int>(a.heads_kv);
  p.group = static_cast<int>(a.heads_q / a.heads_kv);
  p.n_q_tiles = pl.n_q_tiles;
  p.n_k_tiles = pl.n_k_tiles;
  p.rows_q_cap = pl.rows_q_cap;
  p.rows_k_cap = pl.rows_k_cap;
  p.causal = a.causal;
  p.scale = scale;
  p.scale_log2 = scale_log2;
  p.log2_tau = log2_tau;
  p.rows_before = static_cast<int>(a.rows_before);
  p.dsum = dsum;
  p.lse2 = lse2;
  p.bound2 = bound2;
  p.dq_acc = dq_acc;
  p.dk_acc = dk_acc;
  p.dv_acc = dv_acc;
  p.kv_slice = pl.kv_slices > 0 ? a.heads_kv * pl.rows_k_cap * a.head_dim : 0;
  p.heads_per_cta = pl.heads_per_cta;
  p.q_stages = pick_q_stages(cuda::bwd_smem_bytes<D>(3));
  p.head_splits = pl.head_splits;
  // Deterministic mode: dQ in fixed point (before the kernel choice: its tensor maps).
  p.dq_fixed = pl.dq_fixed ? reinterpret_cast<int32_t*>(ws + pl.off_dq) : nullptr;
  p.dq_unit = pl.dq_fixed ? reinterpret_cast<float*>(ws + pl.off_unit) : nullptr;
  p.fwd_mask = a.forward_tile_mask != nullptr && reads_fwd_mask<T, D>(a, pl) ? a.forward_tile_mask : nullptr;
  p.fwd_bq = std::max(a.forward_block_q, 1);
  p.fwd_bk = std::max(a.forward_block_k, 1);
  p.fwd_n_q_tiles = static_cast<int>(rule::ceil_div(static_cast<int64_t>(a.seqlen_q), int64_t{p.fwd_bq}));
  p.fwd_n_k_tiles = static_cast<int>(rule::ceil_div(static_cast<int64_t>(a.seqlen_k), int64_t{p.fwd_bk}));
  cuda::BwdTmaMaps maps;
  const cuda::BwdLaunch launch = choose_kernel<T, D>(a, pl, p, dense, &maps);
  if (launch.kernel == cuda::BwdKernelKind::sm90_ws && launch.maps == nullptr) return cudaErrorInvalidValue;
  if (a.deterministic && launch.kernel != cuda::BwdKernelKind::sm90_ws)
    return cudaErrorNotSupported;  // backward() words it
  // d = 256 on Hopper: dQ is written by its own kernel, which reads the decisions from the tile mask.
  const bool dq_direct = pl.dq_direct;
  if (dq_direct && !dense && p.tile_mask == nullptr) {
    p.tile_mask = reinterpret_cast<uint8_t*>(ws + pl.off_mask);
    err = cudaMemsetAsync(p.tile_mask, 0, static_cast<size_t>(a.batch * a.heads_q) * pl.n_q_tiles * pl.n_k_tiles, stream);
    if (err != cudaSuccess) return err;
  }
  // 1. zero accumulators, tile_mask; D and slot zeroing.
  if (!dq_direct) {
    err = cudaMemsetAsync(ws + pl.off_dq, 0, 4 * static_cast<size_t>(a.heads_q * pl.rows_q_cap * d),
                          stream);
    if (err != cudaSuccess) return err;
  }
  if (pl.kv_atomic && pl.kv_slices == 0) {  // (slices: every valid row is stored)
    err = cudaMemsetAsync(ws + pl.off_dk, 0, pl.bytes - pl.off_dk, stream);
    if (err != cudaSuccess) return err;
  }
  // Fixed-point dQ: the K/V maxima that the rows' units come from.
  unsigned int* kv_max = pl.dq_fixed ? reinterpret_cast<unsigned int*>(ws + pl.off_kv_max) : nullptr;
  // (Never at d = 256, where make_plan sets no fixed point: no instance of the kernel there.)
  if constexpr (D != 256) {
    if (kv_max) {
      if ((err = cudaMemsetAsync(kv_max, 0, 2 * sizeof(unsigned int), stream)) != cudaSuccess) return err;
      cuda::KvMaxParams km{};
      km.k = a.k;
      km.v = a.v;
      km.k_s = ks;
      km.v_s = vs;
      km.cu = a.cu_seqlens_k;
      km.batch = static_cast<int>(a.batch);
      km.seqlen = static_cast<int>(a.seqlen_k);
      km.heads = static_cast<int>(a.heads_kv);
      km.rows_cap = pl.rows_k_cap;
      km.out = kv_max;
      const int64_t warps = pl.rows_k_cap * a.heads_kv;
      const int blocks = static_cast<int>(std::min<int64_t>((warps + 7) / 8, 1024));
      if (blocks > 0) {
        cuda::bwd_rowwise_kernel<cuda::BwdKvMax, T, D><<<blocks, 256, 0, stream>>>(km);
        if ((err = cudaGetLastError()) != cudaSuccess) return err;
      }
    }
  }
  if (a.tile_mask) {
    err = cudaMemsetAsync(a.tile_mask, 0,
                          static_cast<size_t>(a.batch * a.heads_q) * pl.n_q_tiles * pl.n_k_tiles, stream);
    if (err != cudaSuccess) return err;
  }
  RowParams rq{};
  rq.o = a.o;
  rq.dout = a.dout;
  rq.o_s = os;
  rq.do_s = dos;
  rq.dsum = dsum;
  rq.dq_unit = pl.dq_fixed ? reinterpret_cast<float*>(ws + pl.off_unit) : nullptr;
  rq.kv_max = reinterpret_cast<const float*>(kv_max);
  rq.dq_mass = 1.f + std::max(a.tau, 0.f);
  rq.lse2 = lse2;
  rq.bound2 = dense ? nullptr : bound2;
  rq.cu_k = a.cu_seqlens_k;
  rq.seqlen_k = static_cast<int>(a.seqlen_k);
  rq.causal = a.causal;
  rq.log2_tau = log2_tau;
  rq.rows_before = static_cast<int>(a.rows_before);
  rq.inv_scale_log2 = 1.0f / scale_log2;
  rq.lse = a.lse;
  rq.slots = a.bwd_slots;
  rq.cu = a.cu_seqlens_q;
  rq.batch = static_cast<int>(a.batch);
  rq.seqlen = static_cast<int>(a.seqlen_q);
  rq.heads = static_cast<int>(a.heads_q);
  rq.rows_cap = pl.rows_q_cap;
  const int64_t q_warps = pl.rows_q_cap * a.heads_q;
  if (q_warps > 0) {
    cuda::bwd_rowwise_kernel<cuda::BwdPreprocess, T, D><<<static_cast<unsigned>((q_warps + 7) / 8), 256, 0, stream>>>(rq);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  // 2. fused kernel.
  if ((err = cuda::launch_bwd_main<T, D>(p, launch, stream)) != cudaSuccess) return err;

  // 3. converts.
  if (q_warps > 0 && !dq_direct) {
    RowParams rc = rq;
    rc.dst = a.dq;
    rc.dst_s = dqs;
    rc.src = dq_acc;
    rc.src_fixed = p.dq_fixed;
    rc.mul = scale;
    rc.slices = 1;
    cuda::bwd_rowwise_kernel<cuda::BwdConvert, T, D><<<static_cast<unsigned>((q_warps + 7) / 8), 256, 0, stream>>>(rc);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (pl.kv_atomic) {
    RowParams rk{};
    rk.cu = a.cu_seqlens_k;
    rk.batch = static_cast<int>(a.batch);
    rk.seqlen = static_cast<int>(a.seqlen_k);
    rk.heads = static_cast<int>(a.heads_kv);
    rk.rows_cap = pl.rows_k_cap;
    rk.mul = 1.f;
    rk.slices = std::max(pl.kv_slices, 1);
    rk.slice_stride = a.heads_kv * pl.rows_k_cap * a.head_dim;
    const int64_t k_warps = pl.rows_k_cap * a.heads_kv;
    if (k_warps > 0) {
      rk.dst = a.dk;
      rk.dst_s = dks;
      rk.src = dk_acc;
      cuda::bwd_rowwise_kernel<cuda::BwdConvert, T, D><<<static_cast<unsigned>((k_warps + 7) / 8), 256, 0, stream>>>(rk);
      rk.dst = a.dv;
      rk.dst_s = dvs;
      rk.src = dv_acc;
      cuda::bwd_rowwise_kernel<cuda::BwdConvert, T, D><<<static_cast<unsigned>((k_warps + 7) / 8), 256, 0, stream>>>(rk);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
bool strides_ok(const Strides& s) { return s.batch % 8 == 0 && s.row % 8 == 0 && s.head % 8 == 0; }

}  // namespace

Tiles backward_tiles(const BackwardArgs& a) { return tiles_for_dim(a.head_dim); }

size_t backward_workspace_size(const BackwardArgs& a) { return make_plan(a).bytes; }

bool backward_reads_forward_tile_mask(const BackwardArgs& a) {
  if (a.dtype != DType::bf16 && a.dtype != DType::f16) return false;
  const bool bf16 = a.dtype == DType::bf16;
  const Plan pl = make_plan(a);
  switch (a.head_dim) {
    case 64: return bf16 ? reads_fwd_mask<__nv_bfloat16, 64>(a, pl) : reads_fwd_mask<__half, 64>(a, pl);
    case 128: return bf16 ? reads_fwd_mask<__nv_bfloat16, 128>(a, pl) : reads_fwd_mask<__half, 128>(a, pl);
    default: return false;
  }
}

Status backward(const BackwardArgs& a) {
  if (a.dtype != DType::bf16 && a.dtype != DType::f16)
    return Status::error("dtype: CUDA backward supports bfloat16 and float16 (got " + std::string(dtype_name(a.dtype)) + ")");
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256)
    return Status::error("head_dim: CUDA backward supports 64, 128, 256 (got " + std::to_string(a.head_dim) + ")");
  const Tiles t = tiles_for_dim(a.head_dim);
  if ((a.block_q != 0 && a.block_q != t.block_q) || (a.block_k != 0 && a.block_k != t.block_k))
    return Status::error("block_q: CUDA backward tiles are " + std::to_string(t.block_q) + "x" +
                         std::to_string(t.block_k) + " for head_dim " + std::to_string(a.head_dim));
  const struct {
    const void* p;
    const Strides* s;
    const char* name;
  } tensors[] = {{a.q, &a.q_strides, "q"},       {a.k, &a.k_strides, "k"},   {a.v, &a.v_strides, "v"},
                 {a.o, &a.o_strides, "o"},       {a.dout, &a.dout_strides, "dout"}, {a.dq, &a.dq_strides, "dq"},
                 {a.dk, &a.dk_strides, "dk"},    {a.dv, &a.dv_strides, "dv"}};
  for (const auto& x : tensors) {
    if (!aligned16(x.p)) return Status::error(std::string(x.name) + ": CUDA backward needs 16-byte aligned tensors");
    if (!strides_ok(*x.s))
      return Status::error(std::string(x.name) + "_strides: CUDA backward needs strides that are multiples of 8 elements");
  }
  const Plan pl = make_plan(a);
  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  char* ws = static_cast<char*>(a.workspace);
  bool owned = false;
  cudaError_t err = cudaSuccess;
  if (ws == nullptr) {
    err = cudaMallocAsync(reinterpret_cast<void**>(&ws), pl.bytes, stream);
    if (err != cudaSuccess) return Status::error(std::string("workspace: cudaMallocAsync failed: ") + cudaGetErrorString(err));
    owned = true;
  }
  const bool bf16 = a.dtype == DType::bf16;
  switch (a.head_dim) {
    case 64: err = bf16 ? run_typed<__nv_bfloat16, 64>(a, pl, ws, stream) : run_typed<__half, 64>(a, pl, ws, stream); break;
    case 128: err = bf16 ? run_typed<__nv_bfloat16, 128>(a, pl, ws, stream) : run_typed<__half, 128>(a, pl, ws, stream); break;
    default: err = bf16 ? run_typed<__nv_bfloat16, 256>(a, pl, ws, stream) : run_typed<__half, 256>(a, pl, ws, stream); break;
  }
  if (owned) {
    cudaError_t e2 = cudaFreeAsync(ws, stream);
    if (err == cudaSuccess) err = e2;
  }
  if (err == cudaErrorNotSupported && a.deterministic)
    return Status::error("deterministic: needs the Hopper backward (sm_90 with an sm_90a build, "
                         "tensors the TMA can describe; varlen calls must give total_q and total_k)");
  if (err != cudaSuccess) return Status::error(std::string("device: CUDA backward failed: ") + cudaGetErrorString(err));
  return Status::success();
}

}  // namespace cuda_backend
}  // namespace mala
