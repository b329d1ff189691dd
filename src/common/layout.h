// Internal helpers shared by the argument checks (src/validate.cpp), the CPU implementation, the
// dense reference and the CUDA backend's host code: resolving the Strides of a tensor, locating
// sequences (dense or varlen), and converting the storage types to and from fp32.  Plain C++, no CUDA.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/checked.h"
#include "mala/mala.h"

namespace mala {
namespace layout {

// Element strides of a [batch, seqlen, heads, head_dim] tensor with every zero field resolved to
// its contiguous value, innermost first: head = head_dim, row = heads * head, batch = seqlen * row.
// (A Strides left all zero is therefore the contiguous layout; a partly set one fills in the rest.)
struct Resolved {
  int64_t batch, row, head;
};

// The one definition of those defaults.  False when a default's product overflows int64 (the
// argument checks refuse such a tensor; *r then holds the wrapped values).
inline bool resolve_checked(const Strides& s, int64_t seqlen, int64_t heads, int64_t head_dim, Resolved* r) {
  r->head = s.head != 0 ? s.head : head_dim;
  bool fits = true;
  r->row = s.row;
  if (s.row == 0) fits = checked::mul(heads, r->head, &r->row);
  r->batch = s.batch;
  if (s.batch == 0) fits = checked::mul(seqlen, r->row, &r->batch) && fits;
  return fits;
}

// For tensors that passed the checks (mala::check), whose defaults fit.
inline Resolved resolve(const Strides& s, int64_t seqlen, int64_t heads, int64_t head_dim) {
  Resolved r;
  resolve_checked(s, seqlen, heads, head_dim, &r);
  return r;
}

// Where sequence b lives.  Dense batches: rows b*seqlen .. b*seqlen+seqlen-1 of a [batch*seqlen]
// row space; varlen: rows cu[b] .. cu[b+1]-1 of the packed [total] row space.  `row0` indexes the
// packed row space (varlen) and `len` is the sequence's own length.
struct Seq {
  int64_t row0;  // first row in the [total] (varlen) or [batch*seqlen] (dense) row space
  int64_t len;
};

inline Seq sequence(const int32_t* cu, int64_t b, int64_t seqlen) {
  if (cu) return {cu[b], static_cast<int64_t>(cu[b + 1]) - cu[b]};
  return {b * seqlen, seqlen};
}

// Element offset of (global row, head) given the sequence index b (dense: batch stride applies;
// varlen: rows are packed and the batch stride is ignored).
inline int64_t offset(const Resolved& st, bool varlen, int64_t b, int64_t row_in_seq, int64_t seq_row0,
                      int64_t head) {
  if (varlen) return (seq_row0 + row_in_seq) * st.row + head * st.head;
  return b * st.batch + row_in_seq * st.row + head * st.head;
}

// ---- storage conversions (round-to-nearest-even) --------------------------------------------

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize the mantissa
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while (!(mant & 0x400u));
      mant &= 0x3ffu;
      bits = sign | (static_cast<uint32_t>(112 - e) << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  return bits_float(bits);
}

inline uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;  // NaN
  uint32_t e = x >> 23;
  if (e >= 143) return sign | 0x7c00u;         // >= 2^16 (or inf): overflows to inf
  if (e >= 113) {                               // normal half
    uint32_t mant = x & 0x7fffffu;
    uint32_t r = ((e - 112) << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // may carry into inf: correct
    return static_cast<uint16_t>(sign | r);
  }
  if (e < 102) return sign;  // below 2^-25: rounds to zero
  uint32_t m = (x & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126 - e;  // 14..24
  uint32_t r = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// Reads n consecutive elements of type t starting at element `off` of `base` into fp32.
inline void load(const void* base, DType t, int64_t off, int64_t n, float* dst) {
  switch (t) {
    case DType::f32: {
      const float* p = static_cast<const float*>(base) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = p[i];
      break;
    }
    case DType::f16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(p[i]);
      break;
    }
    case DType::bf16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(p[i]);
      break;
    }
  }
}

// Writes n fp32 values to consecutive elements of type t (rounded to nearest even).
inline void store(void* base, DType t, int64_t off, int64_t n, const float* src) {
  switch (t) {
    case DType::f32: {
      float* p = static_cast<float*>(base) + off;
      for (int64_t i = 0; i < n; ++i) p[i] = src[i];
      break;
    }
    case DType::f16: {
      uint16_t* p = static_cast<uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_half(src[i]);
      break;
    }
    case DType::bf16: {
      uint16_t* p = static_cast<uint16_t*>(base) + off;
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(src[i]);
      break;
    }
  }
}

// Copies n raw elements of type t (no conversion).
inline void copy_raw(void* dst_base, int64_t dst_off, const void* src_base, int64_t src_off, int64_t n,
                     DType t) {
  size_t es = dtype_size(t);
  std::memcpy(static_cast<char*>(dst_base) + dst_off * static_cast<int64_t>(es),
              static_cast<const char*>(src_base) + src_off * static_cast<int64_t>(es), n * es);
}

}  // namespace layout
}  // namespace mala
