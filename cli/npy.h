// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0), for the `mala` CLI.
// Supported element types: little-endian float32 ('<f4'), float16 ('<f2') and int32 ('<i4'),
// C order only.  Every failure returns a Status whose message starts with the file path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mala/mala.h"

namespace mala {
namespace npy {

enum class Type { f32, f16, i32 };

const char* type_descr(Type t);  // "<f4", "<f2", "<i4"
const char* type_name(Type t);   // "float32", "float16", "int32"
size_t type_size(Type t);

struct Array {
  Type type = Type::f32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> data;  // raw little-endian elements, C order

  int64_t numel() const;
  std::string shape_string() const;  // "[2,5,3]"
};

// Which element types a reader accepts (a bit per Type); an unsupported dtype's message lists
// only the accepted ones.
constexpr unsigned kAcceptF32 = 1u << static_cast<int>(Type::f32);
constexpr unsigned kAcceptF16 = 1u << static_cast<int>(Type::f16);
constexpr unsigned kAcceptI32 = 1u << static_cast<int>(Type::i32);
constexpr unsigned kAcceptAll = kAcceptF32 | kAcceptF16 | kAcceptI32;
constexpr unsigned kAcceptFloat = kAcceptF32 | kAcceptF16;

// Reads a whole file.  Errors: missing/unreadable file (with the system's reason), a directory,
// bad magic, unsupported version, malformed header dictionary, unsupported dtype (named),
// fortran_order True, negative shape, truncated data, or trailing bytes after the data.
Status read(const std::string& path, Array* out, unsigned accept = kAcceptAll);

// Parses an in-memory file image (what read() does after loading the bytes); `name` prefixes errors.
Status parse(const unsigned char* bytes, size_t size, const std::string& name, Array* out,
             unsigned accept = kAcceptAll);

// Writes a version 1.0 file (2.0 when the header does not fit in 65535 bytes) at path itself
// (callers wanting atomic replacement write a temporary name and rename it, and remove it on
// failure).  On failure the message carries the system's reason (strerror).  create_new: fail
// when path exists in any form, a symlink included (O_CREAT | O_EXCL | O_NOFOLLOW).
Status write(const std::string& path, Type type, const std::vector<int64_t>& shape,
             const void* data, bool create_new = false);

// The elements as float32 (float16 widened exactly; int32 converted).
std::vector<float> to_float(const Array& a);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);  // round to nearest even; overflow to inf

}  // namespace npy
}  // namespace mala
