// The .npy reader/writer used by `mala run` (cli/npy.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <string>
#include <vector>

#include "npy.h"

namespace {

using mala::npy::Array;
using mala::npy::Type;

std::filesystem::path temp_dir() {
  return std::filesystem::temp_directory_path() / ("mala_test_npy_" + std::to_string(::getpid()));
}

std::string temp_path(const std::string& name) {
  const auto dir = temp_dir();
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

// Removes this process's temporary directory once its tests are done (CTest runs each test in a
// process of its own, so every process cleans up after itself).
class TempDirCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(temp_dir(), ec);
  }
};
const ::testing::Environment* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempDirCleanup);

// A file image with the given version, header text (padded by the caller or not) and payload.
std::vector<unsigned char> image(int major, const std::string& header, const std::vector<unsigned char>& payload) {
  std::vector<unsigned char> b = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  const size_t n = header.size();
  if (major == 1) {
    b.push_back(n & 0xff);
    b.push_back(n >> 8);
  } else {
    for (int i = 0; i < 4; ++i) b.push_back((n >> (8 * i)) & 0xff);
  }
  b.insert(b.end(), header.begin(), header.end());
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

std::vector<unsigned char> floats(const std::vector<float>& v) {
  std::vector<unsigned char> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

mala::Status parse(const std::vector<unsigned char>& b, Array* a) {
  return mala::npy::parse(b.data(), b.size(), "x.npy", a);
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& b) {
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(std::fwrite(b.data(), 1, b.size(), f), b.size());
  std::fclose(f);
}

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::vector<unsigned char> b;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return b;
  int c;
  while ((c = std::fgetc(f)) != EOF) b.push_back(static_cast<unsigned char>(c));
  std::fclose(f);
  return b;
}

TEST(Npy, RoundTripFloat32) {
  std::vector<float> x(2 * 3 * 4);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * static_cast<float>(i) - 3.f;
  const std::string path = temp_path("f32.npy");
  ASSERT_TRUE(mala::npy::write(path, Type::f32, {2, 3, 4}, x.data()));

  // numpy's layout: the data starts on a 64-byte boundary and the header ends with '\n'.
  auto bytes = read_bytes(path);
  ASSERT_EQ((bytes.size() - x.size() * 4) % 64, 0u);
  EXPECT_EQ(bytes[bytes.size() - x.size() * 4 - 1], '\n');

  Array a;
  mala::Status s = mala::npy::read(path, &a);
  ASSERT_TRUE(s) << s.message;
  EXPECT_EQ(a.type, Type::f32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(a.shape_string(), "[2,3,4]");
  EXPECT_EQ(mala::npy::to_float(a), x);
}

TEST(Npy, RoundTripInt32AndOneDimension) {
  std::vector<int32_t> x = {-7, 0, 1 << 30, 42, 5};
  const std::string path = temp_path("i32.npy");
  ASSERT_TRUE(mala::npy::write(path, Type::i32, {5}, x.data()));
  Array a;
  ASSERT_TRUE(mala::npy::read(path, &a));
  EXPECT_EQ(a.type, Type::i32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{5}));
  std::vector<int32_t> back(5);
  std::memcpy(back.data(), a.data.data(), 20);
  EXPECT_EQ(back, x);
}

TEST(Npy, RoundTripFloat16) {
  std::vector<float> values = {0.f, 1.f, -2.5f, 65504.f, 6.103515625e-05f, 5.960464477539063e-08f};
  std::vector<uint16_t> h;
  for (float v : values) h.push_back(mala::npy::float_to_half(v));
  const std::string path = temp_path("f16.npy");
  ASSERT_TRUE(mala::npy::write(path, Type::f16, {2, 3}, h.data()));
  Array a;
  ASSERT_TRUE(mala::npy::read(path, &a));
  EXPECT_EQ(a.type, Type::f16);
  EXPECT_EQ(mala::npy::to_float(a), values);  // all exactly representable in float16
}

TEST(Npy, HalfConversion) {
  using mala::npy::float_to_half;
  using mala::npy::half_to_float;
  EXPECT_EQ(float_to_half(1.f), 0x3c00);
  EXPECT_EQ(float_to_half(-2.f), 0xc000);
  EXPECT_EQ(float_to_half(65504.f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.f), 0x7c00);        // rounds past the largest half: inf
  EXPECT_EQ(float_to_half(1.f + 1.f / 2048), 0x3c00);  // tie rounds to even
  EXPECT_EQ(float_to_half(1.f + 3.f / 2048), 0x3c02);  // tie rounds to even (up)
  EXPECT_EQ(float_to_half(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(2.98e-08f), 0x0000);
  EXPECT_EQ(half_to_float(0x0001), 5.960464477539063e-08f);
  EXPECT_EQ(half_to_float(0x0200), std::ldexp(1.f, -15));
  EXPECT_TRUE(std::isinf(half_to_float(0xfc00)) && half_to_float(0xfc00) < 0);
  EXPECT_TRUE(std::isnan(half_to_float(0x7e00)));
  // Every finite half survives half -> float -> half.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00) continue;
    ASSERT_EQ(float_to_half(half_to_float(static_cast<uint16_t>(h))), h) << h;
  }
}

TEST(Npy, ParsesNumpyWrittenHeaders) {
  // Version 1.0 as numpy writes it (spaces, trailing comma, padding), a scalar, and version 2.0.
  std::string h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  h.append(63 - (10 + h.size()) % 64, ' ');  // 10 + header + '\n' is a multiple of 64
  h += '\n';
  Array a;
  ASSERT_TRUE(parse(image(1, h, floats({1.5f, -1.f})), &a));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(mala::npy::to_float(a), (std::vector<float>{1.5f, -1.f}));

  ASSERT_TRUE(parse(image(1, "{'descr':'<f4','fortran_order':False,'shape':()}\n", floats({7.f})), &a));
  EXPECT_TRUE(a.shape.empty());
  EXPECT_EQ(a.numel(), 1);

  ASSERT_TRUE(parse(image(2, "{\"shape\": (1, 2), \"fortran_order\": False, \"descr\": \"<f4\"}\n",
                          floats({1.f, 2.f})),
                    &a));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{1, 2}));
}

TEST(Npy, RejectsMalformedHeaders) {
  Array a;
  const auto payload = floats({1.f, 2.f});
  struct Case {
    std::vector<unsigned char> bytes;
    const char* expect;
  };
  std::vector<unsigned char> bad_magic = image(1, "{}\n", {});
  bad_magic[1] = 'X';
  std::vector<unsigned char> bad_version = image(1, "{}\n", {});
  bad_version[6] = 9;
  std::vector<unsigned char> short_header = image(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", payload);
  short_header[8] = 200;  // header length runs past the end
  const Case cases[] = {
      {bad_magic, "not a .npy file"},
      {bad_version, "unsupported .npy version 9.0"},
      {short_header, "truncated .npy header"},
      {{0x93, 'N', 'U'}, "not a .npy file"},
      {image(1, "{'descr': '<f4', 'fortran_order': False}\n", payload), "missing 'shape'"},
      {image(1, "{'descr': '<f4', 'shape': (2,)}\n", payload), "missing 'fortran_order'"},
      {image(1, "{'fortran_order': False, 'shape': (2,)}\n", payload), "missing 'descr'"},
      {image(1, "{'descr': '<f4', 'fortran_order': False, 'shape': [2]}\n", payload), "'shape' must be a tuple"},
      {image(1, "{'descr': '<f4', 'fortran_order': maybe, 'shape': (2,)}\n", payload), "'fortran_order' must be True or False"},
      {image(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}\n", payload), "unexpected key 'x'"},
      {image(1, "{'descr: '<f4'}\n", payload), "malformed .npy header"},
      {image(1, "'descr': '<f4'\n", payload), "expected '{'"},
      {image(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}\n", payload), "negative dimension"},
  };
  for (const Case& c : cases) {
    mala::Status s = parse(c.bytes, &a);
    ASSERT_FALSE(s) << c.expect;
    EXPECT_NE(s.message.find(c.expect), std::string::npos) << s.message;
    EXPECT_EQ(s.message.rfind("x.npy: ", 0), 0u) << s.message;  // names the file
  }
}

TEST(Npy, RejectsUnsupportedDtypesAndOrder) {
  Array a;
  const auto payload = floats({1.f, 2.f});
  for (const char* descr : {"<f8", ">f4", "|u1", "<i8", "<c8"}) {
    std::string h = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (2,)}\n";
    mala::Status s = parse(image(1, h, payload), &a);
    ASSERT_FALSE(s) << descr;
    EXPECT_NE(s.message.find(std::string("unsupported dtype '") + descr + "'"), std::string::npos)
        << s.message;
  }
  mala::Status s =
      parse(image(1, "{'descr': '<f4', 'fortran_order': True, 'shape': (2,)}\n", payload), &a);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message.find("fortran_order True"), std::string::npos) << s.message;
}

TEST(Npy, RejectsTruncatedAndOverlongData) {
  Array a;
  const std::string h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}\n";
  auto full = floats({1, 2, 3, 4, 5, 6});
  ASSERT_TRUE(parse(image(1, h, full), &a));

  auto cut = full;
  cut.resize(cut.size() - 3);
  mala::Status s = parse(image(1, h, cut), &a);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message.find("truncated data"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("needs 24 bytes, the file has 21 bytes"), std::string::npos) << s.message;

  auto extra = full;
  extra.push_back(0);
  s = parse(image(1, h, extra), &a);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message.find("1 byte of unexpected data"), std::string::npos) << s.message;

  // The same through a real file.
  const std::string path = temp_path("truncated.npy");
  write_bytes(path, image(1, h, cut));
  s = mala::npy::read(path, &a);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.message.rfind(path + ": truncated data", 0), 0u) << s.message;
}

// A shape whose byte count wraps to 0 (2^31 x 2^31 float32 elements are 2^64 bytes) must not match an
// empty payload (issue #64 D11: it was accepted, and failed later naming no file).
TEST(Npy, ShapeWhoseByteCountOverflowsIsMalformed) {
  const std::string h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2147483648, 2147483648), }\n";
  Array a;
  const mala::Status s = parse(image(1, h, {}), &a);
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.message.rfind("x.npy: malformed .npy header (shape overflows", 0), 0u) << s.message;
}

// create_new refuses an existing name, a symlink included, and leaves its target alone (the
// CLI's staged outputs are created this way: issue #64 D7).
TEST(Npy, CreateNewDoesNotFollowASymlink) {
  const std::string victim = temp_path("victim.txt"), link = temp_path("planted.npy");
  { FILE* f = std::fopen(victim.c_str(), "w"); std::fputs("precious", f); std::fclose(f); }
  std::remove(link.c_str());
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0);
  const float x = 1.f;
  EXPECT_FALSE(mala::npy::write(link, Type::f32, {1}, &x, /*create_new=*/true).ok);
  char buf[16] = {};
  FILE* f = std::fopen(victim.c_str(), "r");
  ASSERT_NE(f, nullptr);
  ASSERT_NE(std::fgets(buf, sizeof buf, f), nullptr);
  std::fclose(f);
  EXPECT_STREQ(buf, "precious");
}

TEST(Npy, MissingFileNamesThePath) {
  Array a;
  const std::string path = temp_path("does_not_exist.npy");
  std::remove(path.c_str());
  mala::Status s = mala::npy::read(path, &a);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message.find(path), std::string::npos);
  EXPECT_NE(s.message.find("cannot open"), std::string::npos) << s.message;
}

TEST(Npy, WriteToMissingDirectoryFails) {
  float x = 1.f;
  mala::Status s = mala::npy::write("/nonexistent_dir_for_mala_test/x.npy", Type::f32, {1}, &x);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message.find("cannot create"), std::string::npos) << s.message;
}

TEST(Npy, DirectoryInputSaysSo) {
  Array a;
  const std::string dir = temp_path("a_directory.npy");
  std::filesystem::create_directories(dir);
  mala::Status s = mala::npy::read(dir, &a);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.message, dir + ": is a directory");
}

// A reader restricted to float types (what `mala run` uses) rejects int32 and lists only what it
// accepts.
TEST(Npy, AcceptMaskNamesOnlyAcceptedTypes) {
  Array a;
  const std::vector<unsigned char> payload = {1, 0, 0, 0, 2, 0, 0, 0};
  const auto img = image(1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,)}\n", payload);
  ASSERT_TRUE(parse(img, &a));
  mala::Status s = mala::npy::parse(img.data(), img.size(), "x.npy", &a, mala::npy::kAcceptFloat);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.message, "x.npy: unsupported dtype '<i4' (int32) (supported: '<f4' float32, '<f2' float16)");
  const auto f8 = image(1, "{'descr': '<f8', 'fortran_order': False, 'shape': (1,)}\n", payload);
  s = mala::npy::parse(f8.data(), f8.size(), "x.npy", &a, mala::npy::kAcceptFloat);
  EXPECT_EQ(s.message, "x.npy: unsupported dtype '<f8' (supported: '<f4' float32, '<f2' float16)");
}

// The temporary directory is removed by the environment's TearDown (run it here to check).
TEST(Npy, TemporaryDirectoryIsRemoved) {
  temp_path("x");
  ASSERT_TRUE(std::filesystem::exists(temp_dir()));
  TempDirCleanup().TearDown();
  EXPECT_FALSE(std::filesystem::exists(temp_dir()));
}

}  // namespace
