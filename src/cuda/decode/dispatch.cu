// The CUDA decode's host side (split-KV MALA decode over a contiguous or paged KV cache): tiles, the
// num_splits heuristic, the workspace, parameter packing, and the choice of the split kernel's
// instance -- the only place where that happens: the dense instance at tau = 0, and the instance
// sized for 227 KB of shared memory where the device lets a block have it (sm_90; A100: 163 KB),
// else the 163 KB one.  The kernel override (backend.h) forces the 163 KB instance for tests.  The
// kernels are in decode/kernel.cuh (split), combine.cuh and append.cuh.
//
// CUDA-graph safe: the host never reads cache_seqlens (the kernels do), never synchronizes, and
// allocates nothing when args.workspace is given (otherwise stream-ordered cudaMallocAsync/FreeAsync).
// Per call the host only packs parameters and launches: the device's attributes are queried once
// per device (current_device_caps) and the split kernels' shared-memory opt-in is set once per
// device (instance.cuh), both on the device's first call, which may be under stream capture.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>

#include "common/layout.h"
#include "common/rule.h"
#include "common/splits.h"
#include "cuda/backend.h"
#include "cuda/decode/launch.h"

namespace mala {
namespace cuda_backend {

namespace {

using cuda::kDecodeBlockQ;

// tau > 0 uses the same one-wave split count as tau = 0.  Under the seeded rule (the default) a
// split skips about what the unsplit rule skips, so more splits cost little retention (tile 0 and
// the newest tiles are kept, and each split reads the anchors' K once more).  Under per_split each
// split tests against its own partial normalizer and far splits keep nearly everything; fewer
// splits would retain less there, but the lost parallelism costs more than the skipped V saves
// (mala_bench --op decode --sweep shows it).

struct Geometry {
  int64_t block_k, capacity, n_cap, HS, R, NQT;
};

Geometry geometry(const DecodeArgs& a) {
  Geometry g;
  g.block_k = cuda::decode_block_k(static_cast<int>(a.head_dim));
  const bool paged = a.block_table != nullptr;
  g.capacity = paged ? a.page_size * a.max_pages : a.cache_capacity;
  g.n_cap = (g.capacity + g.block_k - 1) / g.block_k;
  const int64_t group = a.heads_q / std::max<int64_t>(a.heads_kv, 1);
  g.HS = a.pack_gqa ? a.heads_kv : a.heads_q;
  g.R = a.pack_gqa ? a.seqlen_q * group : a.seqlen_q;
  g.NQT = (g.R + kDecodeBlockQ - 1) / kDecodeBlockQ;
  return g;
}

// What the host needs to know about the current device.  Queried on the device's first decode call
// and then read from a per-device table: a decode call's host time adds to its latency, and this
// way a call costs one cudaGetDevice instead of attribute queries.  Thread-safe: the queries run
// under a mutex and the result is published with a release store.  A failed query is not cached
// (the next call asks again); the call gets the fallback values.
struct DeviceCaps {
  int device = 0;      // keys the launcher's per-device cache of kernel attributes
  int sms = 132;       // multiprocessors (fallback: an H100's)
  int smem_optin = 0;  // bytes of shared memory one block may opt in to
  bool pdl = false;    // programmatic dependent launch (sm_90+)
};

bool query_caps(int dev, DeviceCaps* c) {
  int major = 0;
  if (cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || c->sms <= 0 ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&c->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  c->pdl = major >= 9;
  return true;
}

DeviceCaps current_device_caps() {
  struct Slot {
    std::atomic<bool> ready{false};
    DeviceCaps caps;
  };
  static Slot table[cuda::kMaxCachedDevices];
  static std::mutex mutex;
  DeviceCaps c;
  if (cudaGetDevice(&c.device) != cudaSuccess) {
    cudaGetLastError();
    return c;
  }
  const bool cacheable = c.device >= 0 && c.device < cuda::kMaxCachedDevices;
  if (cacheable && table[c.device].ready.load(std::memory_order_acquire)) return table[c.device].caps;
  std::lock_guard<std::mutex> lock(mutex);
  if (cacheable && table[c.device].ready.load(std::memory_order_relaxed)) return table[c.device].caps;
  DeviceCaps q = c;
  if (!query_caps(c.device, &q)) return c;
  if (cacheable) {
    table[c.device].caps = q;
    table[c.device].ready.store(true, std::memory_order_release);
  }
  return q;
}

struct WorkspaceLayout {
  size_t o_bytes = 0, lse_bytes = 0, cnt_bytes = 0, total = 0;
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

WorkspaceLayout workspace_layout(const DecodeArgs& a, const Geometry& g, int splits) {
  WorkspaceLayout w;
  if (splits <= 1) return w;
  const size_t entries = static_cast<size_t>(a.batch) * g.HS * g.NQT * splits;
  w.o_bytes = align256(entries * kDecodeBlockQ * a.head_dim * sizeof(float));
  w.lse_bytes = align256(entries * kDecodeBlockQ * sizeof(float));
  w.cnt_bytes = align256(entries * sizeof(int));
  w.total = w.o_bytes + w.lse_bytes + w.cnt_bytes;
  return w;
}

// num_splits resolved: the given count, or at most one wave of CTAs (one CTA per SM; a second
// partial wave would double the time).
int num_splits_for(const DecodeArgs& a, const Geometry& g, int sms) {
  if (a.num_splits > 0) return a.num_splits;
  return splits::auto_num_splits(a.batch * g.HS * g.NQT, g.n_cap, sms);
}

// The split kernel's instance for this call (see the top of the file).
template <int D>
cuda::DecodeLaunch choose_instance(bool dense, const DeviceCaps& caps) {
  cuda::DecodeLaunch l;
  l.dense = dense;
  l.large_smem = kernel_override().decode != DecodeVariant::small_smem &&
                 caps.smem_optin >= cuda::DecodeConfig<D, true>::smem_bytes(dense);
  l.pdl = caps.pdl;
  l.device = caps.device;
  return l;
}

template <typename T, int D>
cudaError_t run(const cuda::DecodeParams& p, bool dense, const DeviceCaps& caps, cudaStream_t stream) {
  return cuda::launch_decode<T, D>(p, choose_instance<D>(dense, caps), stream);
}

Status aligned(const void* p, const char* what) {
  if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0)
    return Status::error(std::string(what) + ": CUDA decode needs 16-byte aligned tensors");
  return Status::success();
}

Status strides_ok(const layout::Resolved& r, const char* what) {
  if (r.batch % 8 || r.row % 8 || r.head % 8)
    return Status::error(std::string(what) + ": CUDA decode needs strides that are multiples of 8 elements (got batch=" +
                         std::to_string(r.batch) + ", row=" + std::to_string(r.row) + ", head=" +
                         std::to_string(r.head) + ")");
  return Status::success();
}

}  // namespace

Tiles decode_tiles(const DecodeArgs& a) {
  return {kDecodeBlockQ, cuda::decode_block_k(static_cast<int>(a.head_dim))};
}

int decode_num_splits(const DecodeArgs& a) {
  if (a.num_splits > 0) return a.num_splits;  // no device query needed
  return num_splits_for(a, geometry(a), current_device_caps().sms);
}

size_t decode_workspace_size(const DecodeArgs& a) {
  return workspace_layout(a, geometry(a), cuda_backend::decode_num_splits(a)).total;
}

Status decode(const DecodeArgs& a) {
  if (a.dtype != DType::bf16 && a.dtype != DType::f16)
    return Status::error("dtype: CUDA decode supports bfloat16 and float16");
  const int d = static_cast<int>(a.head_dim);
  const DeviceCaps caps = current_device_caps();
  const Geometry g = geometry(a);
  const int splits = num_splits_for(a, g, caps.sms);
  const bool paged = a.block_table != nullptr;
  const int64_t cache_rows = paged ? a.page_size : a.cache_capacity;
  const int64_t new_rows = std::max<int64_t>(a.seqlen_new, 1);

  const layout::Resolved qs = layout::resolve(a.q_strides, a.seqlen_q, a.heads_q, d);
  const layout::Resolved os = layout::resolve(a.o_strides, a.seqlen_q, a.heads_q, d);
  const layout::Resolved ks = layout::resolve(a.k_cache_strides, cache_rows, a.heads_kv, d);
  const layout::Resolved vs = layout::resolve(a.v_cache_strides, cache_rows, a.heads_kv, d);
  const layout::Resolved kns = layout::resolve(a.k_new_strides, new_rows, a.heads_kv, d);
  const layout::Resolved vns = layout::resolve(a.v_new_strides, new_rows, a.heads_kv, d);
  const std::pair<const void*, const char*> ptrs[] = {{a.q, "q"},         {a.k_cache, "k_cache"}, {a.v_cache, "v_cache"},
                                                      {a.k_new, "k_new"}, {a.v_new, "v_new"},     {a.o, "o"}};
  for (const auto& pt : ptrs) {
    Status s = aligned(pt.first, pt.second);
    if (!s) return s;
  }
  const std::pair<layout::Resolved, const char*> strs[] = {{qs, "q_strides"},           {os, "o_strides"},
                                                           {ks, "k_cache_strides"},     {vs, "v_cache_strides"},
                                                           {kns, "k_new_strides"},      {vns, "v_new_strides"}};
  for (const auto& st : strs) {
    Status s = strides_ok(st.first, st.second);
    if (!s) return s;
  }
  if (a.batch * g.HS * g.NQT * static_cast<int64_t>(splits) > (int64_t{1} << 31) / 2 || g.HS > 65535 || a.batch > 65535)
    return Status::error("batch: too many query tiles for one CUDA decode launch");

  cuda::DecodeParams p{};
  p.q = a.q;
  p.k_cache = a.k_cache;
  p.v_cache = a.v_cache;
  p.cache_seqlens = a.cache_seqlens;
  p.block_table = a.block_table;
  p.bt_stride = a.block_table_stride ? a.block_table_stride : a.max_pages;
  p.page_size = static_cast<int>(paged ? a.page_size : 0);
  p.capacity = static_cast<int>(g.capacity);
  p.page_shift = -1;
  if (paged && (a.page_size & (a.page_size - 1)) == 0)
    for (int sh = 0; sh < 31; ++sh)
      if ((int64_t{1} << sh) == a.page_size) p.page_shift = sh;
  p.page_in_tile = paged && (a.page_size % g.block_k == 0) ? 1 : 0;
  p.k_new = a.seqlen_new > 0 ? a.k_new : nullptr;
  p.v_new = a.seqlen_new > 0 ? a.v_new : nullptr;
  p.o = a.o;
  p.lse = a.lse;
  p.slots = a.fwd_slots;
  p.tile_mask = a.tile_mask;
  p.B = static_cast<int>(a.batch);
  p.Nq = static_cast<int>(a.seqlen_q);
  p.seqlen_new = static_cast<int>(a.seqlen_new);
  p.Hq = static_cast<int>(a.heads_q);
  p.Hkv = static_cast<int>(a.heads_kv);
  p.G = static_cast<int>(a.heads_q / a.heads_kv);
  p.HS = static_cast<int>(g.HS);
  p.R = static_cast<int>(g.R);
  p.NQT = static_cast<int>(g.NQT);
  p.S = splits;
  p.n_cap = static_cast<int>(g.n_cap);
  p.causal = a.causal ? 1 : 0;
  p.pack = a.pack_gqa ? 1 : 0;
  p.seeded = a.split_rule == SplitRule::seeded && splits > 1 ? 1 : 0;
  const float scale = a.softmax_scale > 0.f ? a.softmax_scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.scale_log2 = rule::scale_log2(scale);
  p.log2_tau = rule::log2_tau(a.tau);
  p.q_sb = qs.batch, p.q_sr = qs.row, p.q_sh = qs.head;
  p.o_sb = os.batch, p.o_sr = os.row, p.o_sh = os.head;
  p.k_sb = ks.batch, p.k_sr = ks.row, p.k_sh = ks.head;
  p.v_sb = vs.batch, p.v_sr = vs.row, p.v_sh = vs.head;
  p.kn_sb = kns.batch, p.kn_sr = kns.row, p.kn_sh = kns.head;
  p.vn_sb = vns.batch, p.vn_sr = vns.row, p.vn_sh = vns.head;

  cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  const WorkspaceLayout wl = workspace_layout(a, g, splits);
  void* ws = nullptr;
  bool owned = false;
  if (wl.total > 0) {
    if (a.workspace) {
      ws = a.workspace;
    } else {
      cudaError_t e = cudaMallocAsync(&ws, wl.total, stream);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return Status::error(std::string("workspace: cudaMallocAsync failed: ") + cudaGetErrorString(e));
      }
      owned = true;
    }
    char* base = static_cast<char*>(ws);
    p.ws_o = reinterpret_cast<float*>(base);
    p.ws_lse = reinterpret_cast<float*>(base + wl.o_bytes);
    p.ws_cnt = reinterpret_cast<int*>(base + wl.o_bytes + wl.lse_bytes);
  }

  const bool dense = rule::dense(a.tau);
  const bool bf16 = a.dtype == DType::bf16;
  cudaError_t err;
  switch (d) {
    case 64: err = bf16 ? run<__nv_bfloat16, 64>(p, dense, caps, stream) : run<__half, 64>(p, dense, caps, stream); break;
    case 128: err = bf16 ? run<__nv_bfloat16, 128>(p, dense, caps, stream) : run<__half, 128>(p, dense, caps, stream); break;
    case 256: err = bf16 ? run<__nv_bfloat16, 256>(p, dense, caps, stream) : run<__half, 256>(p, dense, caps, stream); break;
    default: err = cudaErrorInvalidValue; break;
  }
  if (owned) {
    cudaError_t e = cudaFreeAsync(ws, stream);
    if (err == cudaSuccess) err = e;
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return Status::error(std::string("device: CUDA decode launch failed: ") + cudaGetErrorString(err));
  }
  return Status::success();
}

}  // namespace cuda_backend
}  // namespace mala
