// Reader for GGUF v3 model files (the llama.cpp format): metadata, tensor index, alignment, and
// dequantization of the tensor types this project's models use into float32.
//
// The file is memory-mapped read-only; TensorData() points into the mapping, which lives as long
// as the GgufFile. Every length, count, offset and size read from the file is checked against the
// file's size before use, so a truncated or corrupt file gives DATA_LOSS / INVALID_ARGUMENT with
// the offending field named, never a crash.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "specache/status.h"

namespace specache::gguf {

// GGUF metadata value types (numbers as in the file).
enum class ValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5, kFloat32 = 6, kBool = 7,
  kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};

// ggml tensor types this reader knows by name; only some can be dequantized (CanDequantize).
enum class TensorType : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ8_1 = 9,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15, kBF16 = 30,
};

std::string TensorTypeName(uint32_t type);
bool CanDequantize(uint32_t type);  // F32, F16, Q4_0, Q4_1, Q8_0

struct Value {
  ValueType type = ValueType::kUint8;
  // Integers (signed ones sign-extended), bool as 0/1, floats, strings; arrays hold elements.
  std::variant<uint64_t, int64_t, double, std::string, std::vector<Value>> data;
};

struct TensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // dims[0] varies fastest (a row has dims[0] elements)
  uint32_t type = 0;           // TensorType number
  uint64_t offset = 0;         // from the start of the data section
  uint64_t elements = 0;
  uint64_t bytes = 0;          // stored size
};

class GgufFile {
 public:
  // Errors: NOT_FOUND / PERMISSION_DENIED (open), INVALID_ARGUMENT (not GGUF, unsupported
  // version), DATA_LOSS (truncated or inconsistent: the message names the field).
  static Result<std::unique_ptr<GgufFile>> Open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, Value>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  // Typed metadata lookups: NOT_FOUND if absent, INVALID_ARGUMENT if of another kind.
  Result<int64_t> GetInt(const std::string& key) const;  // any integer type
  Result<double> GetFloat(const std::string& key) const;  // float32 / float64
  Result<std::string> GetString(const std::string& key) const;
  Result<const std::vector<Value>*> GetArray(const std::string& key) const;

  Result<const TensorInfo*> FindTensor(const std::string& name) const;
  const uint8_t* TensorData(const TensorInfo& t) const { return data_ + t.offset; }

  // All elements of a tensor as float32 (row-major, dims[0] fastest). UNIMPLEMENTED for types
  // without a dequantizer (the message names the tensor and type).
  Result<std::vector<float>> Dequantize(const TensorInfo& t) const;

 private:
  GgufFile() = default;
  Status Parse();

  int fd_ = -1;
  const uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the tensor data section
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
};

// Dequantizes n elements of `type` from `src` (n a multiple of the type's block size).
Status DequantizeRow(uint32_t type, const uint8_t* src, uint64_t n, float* dst);

// Bytes that n elements of `type` take, or an error for unknown types / partial blocks.
Result<uint64_t> StoredBytes(uint32_t type, uint64_t n);

}  // namespace specache::gguf
