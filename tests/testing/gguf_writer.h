// Writes GGUF v3 bytes field by field, independently of the reader (tools/include/specache/gguf.h),
// for tests that hand it well-formed and malformed files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace specache::testing {

class GgufWriter {
 public:
  template <typename T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof v);
  }
  void Str(const std::string& s) {
    Put<uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  // The magic, version 3 and the two counts.
  void Header(uint64_t tensors, uint64_t metadata) {
    Put<uint32_t>(0x46554747);
    Put<uint32_t>(3);
    Put<uint64_t>(tensors);
    Put<uint64_t>(metadata);
  }
  void Pad(size_t alignment) {
    while (bytes_.size() % alignment) bytes_.push_back(0);
  }
  void Raw(const std::vector<uint8_t>& b) { bytes_.insert(bytes_.end(), b.begin(), b.end()); }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

}  // namespace specache::testing
