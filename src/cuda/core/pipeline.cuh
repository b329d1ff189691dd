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

// A decision ring (the forward's V skip, fwd/sm90_kernel.cuh): publishers (consumer warps or
// warpgroups) tell the producer per use whether some of them retains it.  N slots, each an mbarrier
// that the P publishers arrive on once per use and a flag word of 8 bytes, byte i publisher i's
// decision; no empty barriers: the kernel's ring proof says when a slot is free again.  Use u is
// slot u % N with phase parity (u / N) & 1; its mbarrier is at bar0 + 8 (u % N) and its word at
// flag0 + 8 (u % N), one offset for both.
// Each method spells that arithmetic out, addresses before parities, as MbarRing's waits do: a
// nested helper for the offset reordered the kernel's PTX and changed the SASS of every tau > 0
// instance at d = 128.
template <int N, int P>
struct DecisionRing {
  static_assert(P == 2 || P == 8, "DecisionRing: the producer reads a word of 2 or 8 flag bytes");
  static constexpr int kSlots = N, kPublishers = P;
  uint32_t bar0, flag0;  // shared addresses of mbarrier[N] and flag[N][8]
  // One thread, before the fence_mbarrier_init and the CTA barrier.
  __device__ __forceinline__ void init() const {
    for (int i = 0; i < N; ++i) mbar_init(bar0 + 8 * i, P);
  }
  // Publisher `index`, where `publisher` != 0: its decision for use u into its byte, then its
  // arrival.  Predicated in PTX rather than branched around: a branch on a lane costs a BSSY/BSYNC
  // pair.
  __device__ __forceinline__ void publish(uint32_t u, uint32_t publisher, int index, bool retain) const {
    const uint32_t off = u % N * 8;
    asm volatile(
        "{\n .reg .pred p;\n .reg .b64 st;\n setp.ne.u32 p, %0, 0;\n @p st.shared.u8 [%1], %2;\n"
        " @p mbarrier.arrive.shared.b64 st, [%3];\n}\n" ::"r"(publisher),
        "r"(flag0 + index + off), "r"(retain ? 1u : 0u), "r"(bar0 + off)
        : "memory");
  }
  // Producer: whether every publisher's decision on use u is out, without waiting (acquire when it
  // is); the wait for them.
  __device__ __forceinline__ bool test(uint32_t u) const { return mbar_test(bar0 + u % N * 8, (u / N) & 1u); }
  __device__ __forceinline__ void wait(uint32_t u) const { mbar_wait<true>(bar0 + u % N * 8, (u / N) & 1u); }
  // Producer, once use u's decisions are out: whether some publisher retains it.  A C++ volatile
  // load through `flags`, the generic pointer of the flag array (flag0's bytes): an inline-PTX
  // ld.shared from use u's flag word changed how ptxas addressed it and the producer's SASS.
  __device__ __forceinline__ static bool retained(const volatile unsigned char* flags, uint32_t u) {
    const volatile unsigned char* f = flags + u % N * 8;
    if constexpr (P == 8)
      return *reinterpret_cast<const volatile uint64_t*>(f) != 0;
    else
      return *reinterpret_cast<const volatile uint16_t*>(f) != 0;
  }
};

}  // namespace cuda
}  // namespace mala
