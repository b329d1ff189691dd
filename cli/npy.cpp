// .npy reader/writer.  The format: 6-byte magic "\x93NUMPY", a major/minor version byte pair, a
// little-endian header length (2 bytes in 1.0, 4 bytes in 2.0/3.0), then an ASCII Python dict
// literal {'descr': ..., 'fortran_order': ..., 'shape': (...), } padded with spaces and a newline
// so the data starts on a 64-byte boundary, then the raw elements.
#include "npy.h"

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mala {
namespace npy {

const char* type_descr(Type t) {
  switch (t) {
    case Type::f32: return "<f4";
    case Type::f16: return "<f2";
    case Type::i32: return "<i4";
  }
  return "?";
}

const char* type_name(Type t) {
  switch (t) {
    case Type::f32: return "float32";
    case Type::f16: return "float16";
    case Type::i32: return "int32";
  }
  return "?";
}

size_t type_size(Type t) { return t == Type::f16 ? 2 : 4; }

int64_t Array::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

std::string Array::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

namespace {

// A tiny parser for the header's dict literal: string keys; values are strings, True/False, or
// tuples of non-negative integers.
struct HeaderParser {
  const std::string& text;
  size_t pos = 0;
  std::string error;

  explicit HeaderParser(const std::string& t) : text(t) {}

  void skip_space() {
    while (pos < text.size() && std::isspace(static_cast<unsigned char>(text[pos]))) ++pos;
  }
  bool eat(char c) {
    skip_space();
    if (pos < text.size() && text[pos] == c) {
      ++pos;
      return true;
    }
    return false;
  }
  bool parse_string(std::string* out) {
    skip_space();
    if (pos >= text.size() || (text[pos] != '\'' && text[pos] != '"')) return false;
    char quote = text[pos++];
    size_t end = text.find(quote, pos);
    if (end == std::string::npos) return false;
    *out = text.substr(pos, end - pos);
    pos = end + 1;
    return true;
  }
  bool parse_word(std::string* out) {
    skip_space();
    size_t start = pos;
    while (pos < text.size() && std::isalpha(static_cast<unsigned char>(text[pos]))) ++pos;
    *out = text.substr(start, pos - start);
    return !out->empty();
  }
  bool parse_int(int64_t* out) {
    skip_space();
    size_t start = pos;
    if (pos < text.size() && text[pos] == '-') ++pos;
    while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) ++pos;
    // numpy may write Python 2 longs as "3L".
    size_t digits_end = pos;
    if (pos < text.size() && text[pos] == 'L') ++pos;
    if (digits_end == start || (digits_end == start + 1 && text[start] == '-')) return false;
    std::string digits = text.substr(start, digits_end - start);
    if (digits.size() > 18) return false;
    *out = std::stoll(digits);
    return true;
  }
  bool parse_tuple(std::vector<int64_t>* out) {
    if (!eat('(')) return false;
    out->clear();
    if (eat(')')) return true;
    while (true) {
      int64_t v;
      if (!parse_int(&v)) return false;
      out->push_back(v);
      if (eat(')')) return true;
      if (!eat(',')) return false;
      if (eat(')')) return true;  // trailing comma, as in (5,)
    }
  }
};

std::string byte_count(size_t n) { return std::to_string(n) + (n == 1 ? " byte" : " bytes"); }

}  // namespace

Status parse(const unsigned char* bytes, size_t size, const std::string& name, Array* out,
             unsigned accept) {
  static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (size < 10 || std::memcmp(bytes, magic, 6) != 0)
    return Status::error(name + ": not a .npy file (missing the \\x93NUMPY magic)");
  const int major = bytes[6], minor = bytes[7];
  if (major < 1 || major > 3 || minor != 0)
    return Status::error(name + ": unsupported .npy version " + std::to_string(major) + "." +
                         std::to_string(minor) + " (supported: 1.0, 2.0, 3.0)");
  size_t header_len, header_start;
  if (major == 1) {
    header_len = bytes[8] | (static_cast<size_t>(bytes[9]) << 8);
    header_start = 10;
  } else {
    if (size < 12) return Status::error(name + ": truncated .npy header");
    header_len = bytes[8] | (static_cast<size_t>(bytes[9]) << 8) |
                 (static_cast<size_t>(bytes[10]) << 16) | (static_cast<size_t>(bytes[11]) << 24);
    header_start = 12;
  }
  if (header_start + header_len > size)
    return Status::error(name + ": truncated .npy header (header length " +
                         std::to_string(header_len) + " runs past the end of the " +
                         byte_count(size) + " file)");
  const std::string header(reinterpret_cast<const char*>(bytes + header_start), header_len);

  HeaderParser p(header);
  std::string descr;
  bool have_descr = false, have_order = false, have_shape = false, fortran = false;
  std::vector<int64_t> shape;
  auto malformed = [&](const std::string& why) {
    return Status::error(name + ": malformed .npy header (" + why + "): " + header.substr(0, 120));
  };
  if (!p.eat('{')) return malformed("expected '{'");
  while (!p.eat('}')) {
    std::string key;
    if (!p.parse_string(&key)) return malformed("expected a quoted key");
    if (!p.eat(':')) return malformed("expected ':' after '" + key + "'");
    if (key == "descr") {
      if (!p.parse_string(&descr)) return malformed("'descr' must be a string");
      have_descr = true;
    } else if (key == "fortran_order") {
      std::string w;
      if (!p.parse_word(&w) || (w != "True" && w != "False"))
        return malformed("'fortran_order' must be True or False");
      fortran = w == "True";
      have_order = true;
    } else if (key == "shape") {
      if (!p.parse_tuple(&shape)) return malformed("'shape' must be a tuple of integers");
      have_shape = true;
    } else {
      return malformed("unexpected key '" + key + "'");
    }
    if (!p.eat(',')) {
      if (!p.eat('}')) return malformed("expected ',' or '}'");
      break;
    }
  }
  if (!have_descr) return malformed("missing 'descr'");
  if (!have_order) return malformed("missing 'fortran_order'");
  if (!have_shape) return malformed("missing 'shape'");

  Type type;
  bool known = true;
  if (descr == "<f4") {
    type = Type::f32;
  } else if (descr == "<f2") {
    type = Type::f16;
  } else if (descr == "<i4") {
    type = Type::i32;
  } else {
    known = false;
  }
  if (!known || !(accept & (1u << static_cast<int>(type)))) {
    std::string supported;
    for (Type t : {Type::f32, Type::f16, Type::i32})
      if (accept & (1u << static_cast<int>(t)))
        supported += std::string(supported.empty() ? "" : ", ") + "'" + type_descr(t) + "' " + type_name(t);
    return Status::error(name + ": unsupported dtype '" + descr + "'" +
                         (known ? std::string(" (") + type_name(type) + ")" : std::string()) +
                         " (supported: " + supported + ")");
  }
  if (fortran)
    return Status::error(name + ": fortran_order True is not supported (save a C-contiguous array)");

  int64_t numel = 1;
  for (int64_t s : shape) {
    if (s < 0) return malformed("negative dimension");
    if (s > 0 && numel > std::numeric_limits<int64_t>::max() / s) return malformed("shape overflows");
    numel *= s;
  }
  // The byte count, not only the element count, must fit: 2^62 float32 elements are 2^64 bytes,
  // which wrapped to 0 and matched an empty payload.
  if (numel > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(type_size(type)))
    return malformed("shape overflows: more than 2^63 bytes of data");
  const size_t data_start = header_start + header_len;
  const size_t available = size - data_start;
  const uint64_t need = static_cast<uint64_t>(numel) * type_size(type);
  if (available < need)
    return Status::error(name + ": truncated data: shape " +
                         Array{type, shape, {}}.shape_string() + " " + type_name(type) + " needs " +
                         byte_count(need) + ", the file has " + byte_count(available));
  if (available > need)
    return Status::error(name + ": " + byte_count(available - need) +
                         " of unexpected data after the array");

  out->type = type;
  out->shape = shape;
  out->data.assign(bytes + data_start, bytes + data_start + need);
  return Status::success();
}

Status read(const std::string& path, Array* out, unsigned accept) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return Status::error(path + ": is a directory");
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return Status::error(path + ": cannot open (" + std::strerror(errno) + ")");
  std::vector<unsigned char> bytes;
  unsigned char buf[1 << 16];
  size_t n;
  errno = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + n);
  const bool failed = std::ferror(f);
  const int err = errno;
  std::fclose(f);
  if (failed) return Status::error(path + ": read error (" + std::strerror(err ? err : EIO) + ")");
  return parse(bytes.data(), bytes.size(), path, out, accept);
}

Status write(const std::string& path, Type type, const std::vector<int64_t>& shape,
             const void* data, bool create_new) {
  std::string dict = std::string("{'descr': '") + type_descr(type) +
                     "', 'fortran_order': False, 'shape': (";
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) return Status::error(path + ": negative dimension in shape");
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
    numel *= shape[i];
  }
  dict += "), }";
  // Pad with spaces so magic + version + length + header (ending in '\n') is a multiple of 64.
  size_t prefix = 10;
  size_t total = prefix + dict.size() + 1;
  int major = 1;
  if (((total + 63) / 64) * 64 - prefix > 65535) {
    major = 2;
    prefix = 12;
    total = prefix + dict.size() + 1;
  }
  total = (total + 63) / 64 * 64;
  std::string header = dict;
  header.append(total - prefix - dict.size() - 1, ' ');
  header += '\n';
  const size_t hlen = header.size();

  std::vector<unsigned char> head = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  if (major == 1) {
    head.push_back(hlen & 0xff);
    head.push_back((hlen >> 8) & 0xff);
  } else {
    for (int b = 0; b < 4; ++b) head.push_back((hlen >> (8 * b)) & 0xff);
  }
  // create_new: the file must not exist, not even as a symlink (O_EXCL fails on any existing name,
  // O_NOFOLLOW also for a dangling link): nothing planted at the name is followed.
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (create_new ? O_EXCL | O_NOFOLLOW : O_TRUNC);
  const int fd = ::open(path.c_str(), flags, 0666);
  if (fd < 0) return Status::error(path + ": cannot create (" + std::strerror(errno) + ")");
  FILE* f = ::fdopen(fd, "wb");
  if (!f) {
    const int err = errno;
    ::close(fd);
    return Status::error(path + ": cannot create (" + std::strerror(err) + ")");
  }
  const size_t bytes = static_cast<size_t>(numel) * type_size(type);
  errno = 0;
  bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size() &&
            std::fwrite(header.data(), 1, hlen, f) == hlen &&
            (bytes == 0 || std::fwrite(data, 1, bytes, f) == bytes) && std::fflush(f) == 0;
  int err = ok ? 0 : errno;
  if (std::fclose(f) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    return Status::error(path + ": write failed (" + std::strerror(err ? err : EIO) + ")");
  }
  return Status::success();
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0);  // inf / nan
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds past 65504: inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t mant = (abs & 0x7fffff) | 0x800000;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    uint32_t v = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (v & 1))) ++v;
    return sign | static_cast<uint16_t>(v);
  }
  uint32_t v = ((abs >> 23) - 127 + 15) << 10 | (abs & 0x7fffff) >> 13;
  const uint32_t rem = abs & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (v & 1))) ++v;  // carries into the exponent correctly
  return sign | static_cast<uint16_t>(v);
}

std::vector<float> to_float(const Array& a) {
  const int64_t n = a.numel();
  std::vector<float> out(n);
  const unsigned char* p = a.data.data();
  for (int64_t i = 0; i < n; ++i) {
    switch (a.type) {
      case Type::f32: std::memcpy(&out[i], p + 4 * i, 4); break;
      case Type::f16: {
        uint16_t h = static_cast<uint16_t>(p[2 * i] | p[2 * i + 1] << 8);
        out[i] = half_to_float(h);
        break;
      }
      case Type::i32: {
        int32_t v;
        std::memcpy(&v, p + 4 * i, 4);
        out[i] = static_cast<float>(v);
        break;
      }
    }
  }
  return out;
}

}  // namespace npy
}  // namespace mala
