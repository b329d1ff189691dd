// Rings of shared-memory slots between a TMA producer and wgmma consumers (sm_90).  Each slot has a
// full mbarrier (the producer's arrive.expect_tx, completed by the copy's bytes, or a plain arrival
// for a use that loads nothing) and an empty mbarrier (one arrival per consumer warp once the slot
// has been read).  The use u of a ring of N slots is slot u % N with phase parity (u / N) & 1: the
// consumers wait on full for that parity, the producer, before refilling the slot, on empty for the
// parity of the slot's previous use (u >= N).
//
// RingPos is a position in such a ring, from a running count (at) or stepped once per use
// (advance); MbarRing is one ring's mbarrier pair arrays and the waits and arrivals on them.  Slot
// and parity stay plain values the kernels may also compute their own way (a tile index counted
// down, a shift and mask): the helpers take the slot in whatever integer type the kernel has, so
// the address arithmetic is what it was by hand.
#pragma once

#include <stdint.h>

#include "cuda/core/ptx.cuh"

namespace mala {
namespace cuda {

// A ring slot and the phase parity of its current use.
struct RingPos {
  int slot;
  uint32_t phase;
  // Use i of a ring of N slots.
  template <int N>
  __device__ __forceinline__ static RingPos at(int i) {
    return {i % N, static_cast<uint32_t>(i / N) & 1u};
  }
  // The next use.
  template <int N>
  __device__ __forceinline__ void advance() {
    if (++slot == N) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// The mbarriers of a ring of N slots: full[N] at `full0`, empty[N] at `empty0` (8 bytes each;
// at(base): empty right after full).
template <int N>
struct MbarRing {
  static constexpr int kSlots = N;
  uint32_t full0, empty0;
  __device__ __forceinline__ static MbarRing at(uint32_t base) { return {base, base + 8 * N}; }
  template <typename S>
  __device__ __forceinline__ uint32_t full(S slot) const {
    return full0 + 8 * slot;
  }
  template <typename S>
  __device__ __forceinline__ uint32_t empty(S slot) const {
    return empty0 + 8 * slot;
  }
  // One thread, before the fence_mbarrier_init and the CTA barrier: full_count arrivals fill a slot
  // (the producer's one), empty_count drain it.
  __device__ __forceinline__ void init(int full_count, int empty_count) const {
    for (int i = 0; i < N; ++i) init_slot(i, full_count, empty_count);
  }
  // Slot i's pair alone, for rings initialised slot by slot side by side (the order of the inits
  // reaches the PTX).
  __device__ __forceinline__ void init_slot(int i, int full_count, int empty_count) const {
    mbar_init(full(i), full_count);
    mbar_init(empty(i), empty_count);
  }
  // A slot and a parity the kernel computes its own way go to mbar_wait<true>(ring.full(slot),
  // parity) (or empty): the address is computed before the parity, as by hand; a helper taking both
  // would compute the parity first, an order that reaches ptxas's schedule.
  // Consumer (one lane a warp): the slot's current use is read.
  template <typename S>
  __device__ __forceinline__ void release(S slot) const {
    mbar_arrive(empty(slot));
  }
  // A use that loads nothing: its full phase completes with a plain arrival (no bytes), so the
  // consumers' waits and the ring's phases are as with a load.
  template <typename S>
  __device__ __forceinline__ void fill_empty(S slot) const {
    mbar_arrive(full(slot));
  }
  // At a RingPos (by reference: a copy of the pair reorders its updates in the PTX): the
  // consumers' wait for use r, their release of it, the producer's wait before refilling its slot
  // (the parity of the slot's previous use).
  __device__ __forceinline__ void consumer_wait(const RingPos& r) const { mbar_wait<true>(full(r.slot), r.phase); }
  __device__ __forceinline__ void producer_wait(const RingPos& r) const {
    mbar_wait<true>(empty(r.slot), r.phase ^ 1u);
  }
  __device__ __forceinline__ void consumer_release(const RingPos& r) const { mbar_arrive(empty(r.slot)); }
};

}  // namespace cuda
}  // namespace mala
