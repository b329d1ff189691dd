// mala::check()'s memory-overlap test: every output against every input and every earlier output,
// so that no entry point writes into memory it reads (or writes twice).
#include <cstdint>
#include <string>

#include "common/layout.h"
#include "cuda/backend.h"
#include "mala/mala.h"
#include "validate.h"
#include "validate_util.h"

namespace mala {
namespace internal {
namespace {

// ---- memory overlap of outputs with inputs ----------------------------------------------------
// A tensor's bytes as [begin, end), and, for a [batch, rows, heads, head_dim] tensor whose batch
// stride is a multiple of its row stride, the lattice it lives on: every byte is at
// begin + t * period + [0, width) for some t.  Two tensors on the same lattice whose footprints
// are disjoint modulo the period never overlap even when their extents interleave (q, k, v or
// dq, dk, dv as views of one packed [B, N, 3, H, d] tensor); otherwise overlapping extents are an
// overlap (conservative).
struct Region {
  const char* name;
  uintptr_t begin = 0, end = 0;
  int64_t period = 0, width = 0;  // period 0: no lattice, the extent alone
};

Region flat(const void* p, const char* name, int64_t bytes) {
  Region r;
  r.name = name;
  if (p && bytes > 0) {
    r.begin = reinterpret_cast<uintptr_t>(p);
    r.end = r.begin + static_cast<uintptr_t>(bytes);
  }
  return r;
}

Region strided(const void* p, const char* name, size_t elem, const Strides& s, int64_t batch, int64_t rows,
               int64_t heads, int64_t head_dim) {
  Region r;
  r.name = name;
  if (!p || batch <= 0 || rows <= 0 || heads <= 0 || head_dim <= 0) return r;
  const layout::Resolved st = layout::resolve(s, rows, heads, head_dim);
  const int64_t last = (batch - 1) * st.batch + (rows - 1) * st.row + (heads - 1) * st.head + head_dim;
  r.begin = reinterpret_cast<uintptr_t>(p);
  r.end = r.begin + static_cast<uintptr_t>(last) * elem;
  const int64_t period = st.row * static_cast<int64_t>(elem);
  const int64_t width = ((heads - 1) * st.head + head_dim) * static_cast<int64_t>(elem);
  if (period > 0 && width <= period && (batch == 1 || (st.batch * static_cast<int64_t>(elem)) % period == 0)) {
    r.period = period;
    r.width = width;
  }
  return r;
}

bool overlaps(const Region& a, const Region& b) {
  if (a.begin == a.end || b.begin == b.end) return false;
  if (a.end <= b.begin || b.end <= a.begin) return false;
  if (a.period > 0 && a.period == b.period) {
    const uintptr_t P = static_cast<uintptr_t>(a.period);
    const uintptr_t ab = (b.begin % P + P - a.begin % P) % P;  // b's footprint start, from a's
    const uintptr_t ba = (P - ab) % P;                          // a's, from b's
    if (ab >= static_cast<uintptr_t>(a.width) && ba >= static_cast<uintptr_t>(b.width)) return false;
  }
  return true;
}

// Every output against every input and every earlier output: "<output>: overlaps <other>".
// (Fixed-size arrays: the checks run on every call, so they allocate nothing.)
template <size_t NI, size_t NO>
Status check_no_overlap(const Region (&inputs)[NI], const Region (&outputs)[NO]) {
  for (size_t i = 0; i < NO; ++i) {
    for (const Region& in : inputs)
      if (overlaps(outputs[i], in)) return fail(outputs[i].name, std::string("overlaps ") + in.name);
    for (size_t j = 0; j < i; ++j)
      if (overlaps(outputs[i], outputs[j]))
        return fail(outputs[i].name, std::string("overlaps ") + outputs[j].name);
  }
  return Status::success();
}

// Rows of the whole q (or k) row space: batch * seqlen, or for varlen the packed total (CPU:
// cu_seqlens[batch]; CUDA, where the offsets live on the device: seqlen, the longest sequence,
// a lower bound).
int64_t total_rows(Device d, const int32_t* cu, int64_t batch, int64_t seqlen) {
  if (!cu) return batch * seqlen;
  return d == Device::cpu ? static_cast<int64_t>(cu[batch]) : seqlen;
}

// The row space of q and k (batches, rows per batch) that a forward or backward call addresses:
// varlen calls are one batch of the packed rows, bounded by total_q / total_k where given.
struct Rows {
  bool varlen;
  int64_t nb, rq, rk;
};

template <class Args>
Rows rows_of(const Args& a) {
  const bool varlen = a.cu_seqlens_q != nullptr;
  Rows r{varlen, varlen ? 1 : a.batch, a.seqlen_q, a.seqlen_k};
  if (varlen) {
    r.rq = a.total_q > 0 ? a.total_q : total_rows(a.device, a.cu_seqlens_q, a.batch, a.seqlen_q);
    r.rk = a.total_k > 0 ? a.total_k : total_rows(a.device, a.cu_seqlens_k, a.batch, a.seqlen_k);
  }
  return r;
}

Status overlap_forward(const ForwardArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const Rows r = rows_of(a);
  const bool varlen = r.varlen;
  const int64_t nb = r.nb, rq = r.rq, rk = r.rk;
  // The tiles only for a tile mask: on the GPU they are the dispatch's kernel choice (tensor maps).
  const Tiles t = a.tile_mask ? forward_tiles(a) : Tiles{};
  int64_t row_bytes = 0, mask_bytes = 0;  // of lse / fwd_slots / seed_lse, and of tile_mask
  const char* row_name = a.lse ? "lse" : a.fwd_slots ? "fwd_slots" : "seed_lse";
  if (a.lse || a.fwd_slots || a.seed_lse)
    MALA_TRY(flat_bytes(row_name, {4, a.heads_q, varlen ? rq : a.batch, varlen ? 1 : a.seqlen_q}, &row_bytes));
  if (a.tile_mask)
    MALA_TRY(flat_bytes("tile_mask", {a.batch, a.heads_q, ceil_div(a.seqlen_q, t.block_q), ceil_div(a.seqlen_k, t.block_k)},
                        &mask_bytes));
  const Region in[] = {
      strided(a.q, "q", es, a.q_strides, nb, rq, a.heads_q, a.head_dim),
      strided(a.k, "k", es, a.k_strides, nb, rk, a.heads_kv, a.head_dim),
      strided(a.v, "v", es, a.v_strides, nb, rk, a.heads_kv, a.head_dim),
      flat(a.cu_seqlens_q, "cu_seqlens_q", varlen ? 4 * (a.batch + 1) : 0),
      flat(a.cu_seqlens_k, "cu_seqlens_k", a.cu_seqlens_k ? 4 * (a.batch + 1) : 0),
      flat(a.seed_lse, "seed_lse", row_bytes)};
  const Region out[] = {
      strided(a.o, "o", es, a.o_strides, nb, rq, a.heads_q, a.head_dim),
      flat(a.lse, "lse", row_bytes),
      flat(a.fwd_slots, "fwd_slots", row_bytes),
      flat(a.tile_mask, "tile_mask", mask_bytes)};
  return check_no_overlap(in, out);
}

Status overlap_backward(const BackwardArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const Rows r = rows_of(a);
  const bool varlen = r.varlen;
  const int64_t nb = r.nb, rq = r.rq, rk = r.rk;
  const Tiles t = backward_tiles(a);
  int64_t row_bytes = 0, mask_bytes = 0;  // of lse / bwd_slots, and of tile_mask
  MALA_TRY(flat_bytes("lse", {4, a.heads_q, varlen ? rq : a.batch, varlen ? 1 : a.seqlen_q}, &row_bytes));
  if (a.tile_mask)
    MALA_TRY(flat_bytes("tile_mask", {a.batch, a.heads_q, ceil_div(a.seqlen_q, t.block_q), ceil_div(a.seqlen_k, t.block_k)},
                        &mask_bytes));
  const Region in[] = {
      strided(a.q, "q", es, a.q_strides, nb, rq, a.heads_q, a.head_dim),
      strided(a.k, "k", es, a.k_strides, nb, rk, a.heads_kv, a.head_dim),
      strided(a.v, "v", es, a.v_strides, nb, rk, a.heads_kv, a.head_dim),
      strided(a.o, "o", es, a.o_strides, nb, rq, a.heads_q, a.head_dim),
      strided(a.dout, "dout", es, a.dout_strides, nb, rq, a.heads_q, a.head_dim),
      flat(a.lse, "lse", row_bytes),
      flat(a.cu_seqlens_q, "cu_seqlens_q", varlen ? 4 * (a.batch + 1) : 0),
      flat(a.cu_seqlens_k, "cu_seqlens_k", a.cu_seqlens_k ? 4 * (a.batch + 1) : 0)};
  const Region out[] = {
      strided(a.dq, "dq", es, a.dq_strides, nb, rq, a.heads_q, a.head_dim),
      strided(a.dk, "dk", es, a.dk_strides, nb, rk, a.heads_kv, a.head_dim),
      strided(a.dv, "dv", es, a.dv_strides, nb, rk, a.heads_kv, a.head_dim),
      flat(a.bwd_slots, "bwd_slots", row_bytes),
      flat(a.tile_mask, "tile_mask", mask_bytes),
      flat(a.device == Device::cuda ? a.workspace : nullptr, "workspace",
           static_cast<int64_t>(std::min<size_t>(a.workspace_bytes, INT64_MAX)))};
  return check_no_overlap(in, out);
}

Status overlap_decode(const DecodeArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const bool paged = a.block_table != nullptr;
  const int64_t cache_batch = paged ? a.num_pages : a.batch;
  const int64_t cache_rows = paged ? a.page_size : a.cache_capacity;
  const int64_t capacity = paged ? a.page_size * a.max_pages : a.cache_capacity;  // checked by check_arguments
  const int64_t bt_stride = a.block_table_stride ? a.block_table_stride : a.max_pages;
  const Tiles t = decode_tiles(a);
  const int64_t group = a.heads_q / a.heads_kv;
  const int64_t tile_heads = a.pack_gqa ? a.heads_kv : a.heads_q;
  int64_t tile_rows = 0, row_bytes = 0, mask_bytes = 0;  // of lse / fwd_slots, and of tile_mask
  const char* row_name = a.lse ? "lse" : "fwd_slots";
  if (a.lse || a.fwd_slots) MALA_TRY(flat_bytes(row_name, {4, a.batch, a.heads_q, a.seqlen_q}, &row_bytes));
  if (a.tile_mask) {
    MALA_TRY(flat_bytes("tile_mask", {a.seqlen_q, a.pack_gqa ? group : 1}, &tile_rows));
    MALA_TRY(flat_bytes("tile_mask", {a.batch, tile_heads, ceil_div(tile_rows, t.block_q), ceil_div(capacity, t.block_k)},
                        &mask_bytes));
  }
  const Region q = strided(a.q, "q", es, a.q_strides, a.batch, a.seqlen_q, a.heads_q, a.head_dim);
  const Region k_cache =
      strided(a.k_cache, "k_cache", es, a.k_cache_strides, cache_batch, cache_rows, a.heads_kv, a.head_dim);
  const Region v_cache =
      strided(a.v_cache, "v_cache", es, a.v_cache_strides, cache_batch, cache_rows, a.heads_kv, a.head_dim);
  const Region k_new = strided(a.k_new, "k_new", es, a.k_new_strides, a.batch, a.seqlen_new, a.heads_kv, a.head_dim);
  const Region v_new = strided(a.v_new, "v_new", es, a.v_new_strides, a.batch, a.seqlen_new, a.heads_kv, a.head_dim);
  const Region lens = flat(a.cache_seqlens, "cache_seqlens", 4 * a.batch);
  const Region table = flat(a.block_table, "block_table", paged ? 4 * ((a.batch - 1) * bt_stride + a.max_pages) : 0);
  // Appending writes the caches: each may share bytes with its own new rows only (the rows it is
  // given may already sit in place), never with the other cache -- k_cache is v_cache would make
  // the appended keys the values -- nor with what the append or the attention read.
  if (a.k_new && a.seqlen_new > 0) {
    const Region k_reads[] = {q, v_new, lens, table};
    const Region v_reads[] = {q, k_new, lens, table, k_cache};
    const Region k_out[] = {k_cache};
    const Region v_out[] = {v_cache};
    MALA_TRY(check_no_overlap(k_reads, k_out));
    MALA_TRY(check_no_overlap(v_reads, v_out));
  }
  const Region in[] = {q, k_cache, v_cache, k_new, v_new, lens, table};
  const Region out[] = {
      strided(a.o, "o", es, a.o_strides, a.batch, a.seqlen_q, a.heads_q, a.head_dim),
      flat(a.lse, "lse", row_bytes),
      flat(a.fwd_slots, "fwd_slots", row_bytes),
      flat(a.tile_mask, "tile_mask", mask_bytes),
      flat(a.device == Device::cuda ? a.workspace : nullptr, "workspace",
           static_cast<int64_t>(std::min<size_t>(a.workspace_bytes, INT64_MAX)))};
  return check_no_overlap(in, out);
}

}  // namespace

Status check_overlap(const ForwardArgs& a) { return overlap_forward(a); }
Status check_overlap(const BackwardArgs& a) { return overlap_backward(a); }
Status check_overlap(const DecodeArgs& a) { return overlap_decode(a); }

}  // namespace internal
}  // namespace mala
