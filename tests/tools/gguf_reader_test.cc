#include "specache/gguf.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

#include "specache/half.h"
#include "testing/gguf_writer.h"

namespace specache::gguf {
namespace {

using Writer = testing::GgufWriter;

struct Tensor {
  std::string name;
  std::vector<uint64_t> dims;
  uint32_t type;
  std::vector<uint8_t> data;
};

std::vector<uint8_t> BuildFile(const std::vector<Tensor>& tensors, uint64_t alignment = 32) {
  Writer w;
  w.Header(tensors.size(), 5);
  w.Str("general.architecture"); w.Put<uint32_t>(8); w.Str("llama");
  w.Str("llama.rope.freq_base"); w.Put<uint32_t>(6); w.Put<float>(10000.0f);
  w.Str("llama.block_count"); w.Put<uint32_t>(4); w.Put<uint32_t>(30);
  w.Str("general.alignment"); w.Put<uint32_t>(4); w.Put<uint32_t>(static_cast<uint32_t>(alignment));
  w.Str("tokenizer.ggml.tokens"); w.Put<uint32_t>(9); w.Put<uint32_t>(8); w.Put<uint64_t>(3);
  w.Str("<s>"); w.Str("a"); w.Str("Ġthe");
  uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    w.Str(t.name);
    w.Put<uint32_t>(static_cast<uint32_t>(t.dims.size()));
    for (uint64_t d : t.dims) w.Put<uint64_t>(d);
    w.Put<uint32_t>(t.type);
    w.Put<uint64_t>(offset);
    offset += (t.data.size() + alignment - 1) / alignment * alignment;
  }
  w.Pad(alignment);
  for (const Tensor& t : tensors) {
    w.Raw(t.data);
    w.Pad(alignment);
  }
  return w.bytes();
}

std::string WriteTemp(const std::vector<uint8_t>& bytes) {
  char path[] = "/tmp/gguf_test_XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  close(fd);
  return path;
}

void PutHalf(std::vector<uint8_t>* b, float f) {
  const Half h = FloatToHalf(f);
  b->push_back(h & 0xFF);
  b->push_back(h >> 8);
}

// Known tensors of each supported type and the floats they must decode to.
struct Fixture {
  std::vector<Tensor> tensors;
  std::vector<std::vector<float>> expected;
  Fixture() {
    std::mt19937 rng(1);
    std::vector<float> f32(6);
    Tensor a{"f32", {3, 2}, 0, {}};
    for (auto& x : f32) {
      x = std::normal_distribution<float>()(rng);
      const auto* p = reinterpret_cast<const uint8_t*>(&x);
      a.data.insert(a.data.end(), p, p + 4);
    }
    tensors.push_back(a);
    expected.push_back(f32);

    Tensor h{"f16", {4}, 1, {}};
    std::vector<float> f16 = {1.0f, -2.5f, 0.333f, 1000.0f};
    for (auto& x : f16) { PutHalf(&h.data, x); x = RoundToHalf(x); }
    tensors.push_back(h);
    expected.push_back(f16);

    // Q4_1, two blocks: x = q * d + m, q = element index pattern.
    Tensor q41{"q4_1", {64}, 3, {}};
    std::vector<float> e41;
    for (int b = 0; b < 2; ++b) {
      const float d = 0.5f + b, m = -3.0f;
      PutHalf(&q41.data, d);
      PutHalf(&q41.data, m);
      std::vector<int> q(32);
      for (int j = 0; j < 32; ++j) q[j] = (j * 7 + b) % 16;
      for (int j = 0; j < 16; ++j) q41.data.push_back(static_cast<uint8_t>(q[j] | (q[j + 16] << 4)));
      for (int j = 0; j < 32; ++j) e41.push_back(q[j] * d + m);
    }
    tensors.push_back(q41);
    expected.push_back(e41);

    Tensor q40{"q4_0", {32}, 2, {}};
    std::vector<float> e40;
    PutHalf(&q40.data, 0.25f);
    for (int j = 0; j < 16; ++j) q40.data.push_back(static_cast<uint8_t>(j | ((15 - j) << 4)));
    for (int j = 0; j < 32; ++j) e40.push_back(((j < 16 ? j : 31 - j) - 8) * 0.25f);
    tensors.push_back(q40);
    expected.push_back(e40);

    Tensor q80{"q8_0", {32}, 8, {}};
    std::vector<float> e80;
    PutHalf(&q80.data, 0.125f);
    for (int j = 0; j < 32; ++j) {
      const int8_t q = static_cast<int8_t>(j * 9 - 128);
      q80.data.push_back(static_cast<uint8_t>(q));
      e80.push_back(q * 0.125f);
    }
    tensors.push_back(q80);
    expected.push_back(e80);

    tensors.push_back({"q6k", {256}, 14, std::vector<uint8_t>(210, 0)});  // indexed, not decodable
  }
};

TEST(GgufReaderTest, ReadsMetadataTensorsAndDequantizesEverySupportedType) {
  Fixture fx;
  for (uint64_t alignment : {32, 64}) {
    const std::string path = WriteTemp(BuildFile(fx.tensors, alignment));
    auto file = GgufFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    const GgufFile& f = **file;
    EXPECT_EQ(f.version(), 3u);
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(*f.GetString("general.architecture"), "llama");
    EXPECT_EQ(*f.GetFloat("llama.rope.freq_base"), 10000.0);
    EXPECT_EQ(*f.GetInt("llama.block_count"), 30);
    EXPECT_EQ(f.GetInt("general.architecture").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(f.GetInt("missing.key").status().code(), StatusCode::kNotFound);
    const auto* tokens = *f.GetArray("tokenizer.ggml.tokens");
    ASSERT_EQ(tokens->size(), 3u);
    EXPECT_EQ(std::get<std::string>((*tokens)[2].data), "Ġthe");
    ASSERT_EQ(f.tensors().size(), fx.tensors.size());
    for (size_t i = 0; i + 1 < fx.tensors.size(); ++i) {
      auto t = f.FindTensor(fx.tensors[i].name);
      ASSERT_TRUE(t.ok());
      EXPECT_EQ((*t)->dims, fx.tensors[i].dims);
      auto values = f.Dequantize(**t);
      ASSERT_TRUE(values.ok()) << values.status().ToString();
      EXPECT_EQ(*values, fx.expected[i]) << fx.tensors[i].name;
    }
    auto q6k = f.FindTensor("q6k");
    ASSERT_TRUE(q6k.ok());
    const Status s = f.Dequantize(**q6k).status();
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
    EXPECT_NE(s.message().find("Q6_K"), std::string::npos) << s.ToString();
    EXPECT_EQ(f.FindTensor("nope").status().code(), StatusCode::kNotFound);
    unlink(path.c_str());
  }
}

// Every prefix of a valid file is rejected with a clear error, never a crash.
TEST(GgufReaderTest, TruncatedFilesAreDataLoss) {
  Fixture fx;
  const std::vector<uint8_t> bytes = BuildFile(fx.tensors);
  // The file ends with the last tensor's data (210 bytes of Q6_K) and padding to 32; cutting only
  // padding leaves a valid file, so the cuts stop at the end of that data.
  const size_t data_end = bytes.size() - (32 - 210 % 32) % 32;
  for (size_t cut = 0; cut < data_end; cut += (cut < 600 || cut + 97 > data_end ? 1 : 97)) {
    const std::string path = WriteTemp(std::vector<uint8_t>(bytes.begin(), bytes.begin() + cut));
    auto file = GgufFile::Open(path);
    unlink(path.c_str());
    ASSERT_FALSE(file.ok()) << "prefix of " << cut << " bytes was accepted";
    EXPECT_EQ(file.status().code(), StatusCode::kDataLoss) << cut << ": " << file.status().ToString();
  }
}

TEST(GgufReaderTest, CorruptHeadersGiveSpecificErrors) {
  Fixture fx;
  const std::vector<uint8_t> good = BuildFile(fx.tensors);
  auto open_modified = [&](size_t offset, const std::vector<uint8_t>& patch) {
    std::vector<uint8_t> b = good;
    std::copy(patch.begin(), patch.end(), b.begin() + offset);
    const std::string path = WriteTemp(b);
    auto file = GgufFile::Open(path);
    unlink(path.c_str());
    return file.status();
  };
  EXPECT_EQ(open_modified(0, {'G', 'G', 'U', 'X'}).code(), StatusCode::kInvalidArgument);  // magic
  EXPECT_EQ(open_modified(4, {2, 0, 0, 0}).code(), StatusCode::kInvalidArgument);          // version 2
  EXPECT_EQ(open_modified(8, {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F}).code(), StatusCode::kDataLoss);
  EXPECT_EQ(open_modified(24, {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0, 0}).code(), StatusCode::kDataLoss);  // key length
  EXPECT_EQ(GgufFile::Open("/nonexistent/model.gguf").status().code(), StatusCode::kNotFound);
}

Status OpenStatus(const std::vector<uint8_t>& bytes) {
  const std::string path = WriteTemp(bytes);
  auto file = GgufFile::Open(path);
  unlink(path.c_str());
  return file.status();
}

// An array longer than the rest of the file could hold is refused at its count, before any
// element is decoded (each decodes to ~48 bytes: a 2 GiB file of one-byte elements asked for
// ~100 GiB); so is an array of an unknown element type.
TEST(GgufReaderTest, AnArrayLongerThanTheFileIsRefusedAtItsCount) {
  for (const auto& [type, bytes_each] : std::vector<std::pair<uint32_t, uint64_t>>{{0, 1}, {4, 4}, {8, 8}, {9, 12}}) {
    Writer w;
    w.Header(0, 1);
    w.Str("big");
    w.Put<uint32_t>(9);
    w.Put<uint32_t>(type);
    const uint64_t left = 4096;  // bytes after the count
    w.Put<uint64_t>(left / bytes_each + 1);
    w.Raw(std::vector<uint8_t>(left, 0));
    const Status s = OpenStatus(w.bytes());
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << type;
    EXPECT_NE(s.message().find("array length"), std::string::npos) << type << ": " << s.ToString();
  }
  Writer w;
  w.Header(0, 1);
  w.Str("odd");
  w.Put<uint32_t>(9);
  w.Put<uint32_t>(77);
  w.Put<uint64_t>(3);
  w.Raw(std::vector<uint8_t>(64, 0));
  EXPECT_NE(OpenStatus(w.bytes()).message().find("unknown type 77"), std::string::npos);
}

// Two tensors naming the same bytes (a small file would decode into any number of large tensors).
TEST(GgufReaderTest, TensorsThatShareBytesAreRefused) {
  Fixture fx;
  std::vector<uint8_t> bytes = BuildFile(fx.tensors);
  ASSERT_TRUE(OpenStatus(bytes).ok());
  // The second tensor ("f16") is at data offset 32: point it at 0, inside "f32".
  const std::string name = "f16";
  const auto at = std::search(bytes.begin(), bytes.end(), name.begin(), name.end());
  ASSERT_NE(at, bytes.end());
  const size_t offset_field = static_cast<size_t>(at - bytes.begin()) + name.size() + 4 + 8 + 4;  // rank, dim, type
  uint64_t offset = 0;
  std::memcpy(&offset, bytes.data() + offset_field, 8);
  ASSERT_EQ(offset, 32u);
  std::memset(bytes.data() + offset_field, 0, 8);
  const Status s = OpenStatus(bytes);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("overlap"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace specache::gguf
