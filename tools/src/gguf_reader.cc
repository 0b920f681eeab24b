#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "specache/gguf.h"

namespace specache::gguf {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint64_t kMaxStringBytes = uint64_t{1} << 30;
constexpr int kMaxArrayDepth = 4;
// Metadata values in all (array elements included): a Llama-3 vocabulary with its merges is
// ~0.5 M; each value decodes to ~48 bytes, so a file cannot ask for more than ~800 MB of them.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 24;

// The fewest bytes one element of `type` takes in the file (0 for an unknown type).
uint64_t MinEncodedBytes(ValueType type) {
  switch (type) {
    case ValueType::kUint8: case ValueType::kInt8: case ValueType::kBool: return 1;
    case ValueType::kUint16: case ValueType::kInt16: return 2;
    case ValueType::kUint32: case ValueType::kInt32: case ValueType::kFloat32: return 4;
    case ValueType::kUint64: case ValueType::kInt64: case ValueType::kFloat64: return 8;
    case ValueType::kString: return 8;   // its length
    case ValueType::kArray: return 12;   // element type and count
  }
  return 0;
}

// Bounds-checked little-endian cursor over the mapped file.
class Cursor {
 public:
  Cursor(const uint8_t* base, uint64_t size) : base_(base), size_(size) {}
  uint64_t offset() const { return offset_; }
  uint64_t remaining() const { return size_ - offset_; }
  // Counts one more metadata value; DATA_LOSS past kMaxMetadataValues.
  Status CountValue() {
    if (++values_ > kMaxMetadataValues) {
      return Status::DataLoss("GGUF metadata holds more than " + std::to_string(kMaxMetadataValues) +
                              " values (no model has that many)");
    }
    return Status::Ok();
  }

  template <typename T>
  Status Read(T* out, const char* what) {
    if (size_ - offset_ < sizeof(T)) return Truncated(what);
    std::memcpy(out, base_ + offset_, sizeof(T));
    offset_ += sizeof(T);
    return Status::Ok();
  }

  Status ReadString(std::string* out, const char* what) {
    uint64_t n = 0;
    SPECACHE_RETURN_IF_ERROR(Read(&n, what));
    if (n > kMaxStringBytes || size_ - offset_ < n) return Truncated(what);
    out->assign(reinterpret_cast<const char*>(base_ + offset_), n);
    offset_ += n;
    return Status::Ok();
  }

  Status Truncated(const char* what) const {
    return Status::DataLoss(std::string("GGUF truncated or corrupt reading ") + what + " at byte " +
                            std::to_string(offset_) + " of " + std::to_string(size_));
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  uint64_t offset_ = 0;
  uint64_t values_ = 0;
};

Status ReadValue(Cursor* c, ValueType type, int depth, Value* out) {
  SPECACHE_RETURN_IF_ERROR(c->CountValue());
  out->type = type;
  switch (type) {
    case ValueType::kUint8: { uint8_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "uint8 value")); out->data = uint64_t{v}; return Status::Ok(); }
    case ValueType::kBool: { uint8_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "bool value")); out->data = uint64_t{v != 0}; return Status::Ok(); }
    case ValueType::kInt8: { int8_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "int8 value")); out->data = int64_t{v}; return Status::Ok(); }
    case ValueType::kUint16: { uint16_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "uint16 value")); out->data = uint64_t{v}; return Status::Ok(); }
    case ValueType::kInt16: { int16_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "int16 value")); out->data = int64_t{v}; return Status::Ok(); }
    case ValueType::kUint32: { uint32_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "uint32 value")); out->data = uint64_t{v}; return Status::Ok(); }
    case ValueType::kInt32: { int32_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "int32 value")); out->data = int64_t{v}; return Status::Ok(); }
    case ValueType::kUint64: { uint64_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "uint64 value")); out->data = v; return Status::Ok(); }
    case ValueType::kInt64: { int64_t v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "int64 value")); out->data = v; return Status::Ok(); }
    case ValueType::kFloat32: { float v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "float32 value")); out->data = double{v}; return Status::Ok(); }
    case ValueType::kFloat64: { double v = 0; SPECACHE_RETURN_IF_ERROR(c->Read(&v, "float64 value")); out->data = v; return Status::Ok(); }
    case ValueType::kString: {
      std::string s;
      SPECACHE_RETURN_IF_ERROR(c->ReadString(&s, "string value"));
      out->data = std::move(s);
      return Status::Ok();
    }
    case ValueType::kArray: {
      if (depth >= kMaxArrayDepth) return Status::DataLoss("GGUF arrays nested too deep");
      uint32_t element_type = 0;
      uint64_t count = 0;
      SPECACHE_RETURN_IF_ERROR(c->Read(&element_type, "array element type"));
      SPECACHE_RETURN_IF_ERROR(c->Read(&count, "array length"));
      // A count of more elements than the rest of the file could hold is corrupt.
      const uint64_t least = MinEncodedBytes(static_cast<ValueType>(element_type));
      if (count > 0 && least == 0) return Status::DataLoss("GGUF array of unknown type " + std::to_string(element_type));
      if (least > 0 && count > c->remaining() / least) return c->Truncated("array length");
      std::vector<Value> items;
      items.reserve(std::min<uint64_t>(count, 1 << 20));
      for (uint64_t i = 0; i < count; ++i) {
        Value v;
        SPECACHE_RETURN_IF_ERROR(ReadValue(c, static_cast<ValueType>(element_type), depth + 1, &v));
        items.push_back(std::move(v));
      }
      out->data = std::move(items);
      return Status::Ok();
    }
  }
  return Status::DataLoss("GGUF metadata value of unknown type " + std::to_string(static_cast<uint32_t>(type)));
}

}  // namespace

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd_ < 0) {
    const int err = errno;
    const std::string msg = "cannot open " + path + ": " + std::strerror(err);
    return err == ENOENT ? Status::NotFound(msg) : err == EACCES ? Status::PermissionDenied(msg) : Status::Unavailable(msg);
  }
  struct stat st {};
  if (::fstat(f->fd_, &st) != 0) return Status::Unavailable("cannot stat " + path);
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ < 24) return Status::DataLoss(path + " is too small to be a GGUF file (" + std::to_string(f->size_) + " bytes)");
  void* m = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, f->fd_, 0);
  if (m == MAP_FAILED) return Status::Unavailable("cannot map " + path + ": " + std::strerror(errno));
  f->map_ = static_cast<const uint8_t*>(m);
  SPECACHE_RETURN_IF_ERROR(f->Parse().WithContext(path));
  return f;
}

GgufFile::~GgufFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
  if (fd_ >= 0) ::close(fd_);
}

Status GgufFile::Parse() {
  Cursor c(map_, size_);
  uint32_t magic = 0;
  uint64_t n_tensors = 0, n_kv = 0;
  SPECACHE_RETURN_IF_ERROR(c.Read(&magic, "magic"));
  if (magic != kMagic) return Status::InvalidArgument("not a GGUF file (bad magic)");
  SPECACHE_RETURN_IF_ERROR(c.Read(&version_, "version"));
  if (version_ != 3) return Status::InvalidArgument("GGUF version " + std::to_string(version_) + " unsupported (need 3)");
  SPECACHE_RETURN_IF_ERROR(c.Read(&n_tensors, "tensor count"));
  SPECACHE_RETURN_IF_ERROR(c.Read(&n_kv, "metadata count"));
  if (n_tensors > size_ || n_kv > size_) return c.Truncated("header counts");
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    uint32_t type = 0;
    Value v;
    SPECACHE_RETURN_IF_ERROR(c.ReadString(&key, "metadata key"));
    SPECACHE_RETURN_IF_ERROR(c.Read(&type, "metadata type"));
    SPECACHE_RETURN_IF_ERROR(ReadValue(&c, static_cast<ValueType>(type), 0, &v).WithContext("metadata '" + key + "'"));
    metadata_[key] = std::move(v);
  }
  if (auto a = GetInt("general.alignment"); a.ok()) {
    if (*a <= 0 || (*a & (*a - 1)) != 0) return Status::DataLoss("general.alignment " + std::to_string(*a) + " is not a power of two");
    alignment_ = static_cast<uint64_t>(*a);
  }
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo t;
    uint32_t n_dims = 0;
    SPECACHE_RETURN_IF_ERROR(c.ReadString(&t.name, "tensor name"));
    SPECACHE_RETURN_IF_ERROR(c.Read(&n_dims, "tensor rank"));
    if (n_dims == 0 || n_dims > 4) return Status::DataLoss("tensor '" + t.name + "' has rank " + std::to_string(n_dims));
    t.dims.resize(n_dims);
    t.elements = 1;
    for (uint64_t& d : t.dims) {
      SPECACHE_RETURN_IF_ERROR(c.Read(&d, "tensor dimension"));
      if (d == 0 || d > size_ * 8 || t.elements > (uint64_t{1} << 40) / d) {
        return Status::DataLoss("tensor '" + t.name + "' has an impossible dimension " + std::to_string(d));
      }
      t.elements *= d;
    }
    SPECACHE_RETURN_IF_ERROR(c.Read(&t.type, "tensor type"));
    SPECACHE_RETURN_IF_ERROR(c.Read(&t.offset, "tensor offset"));
    auto bytes = StoredBytes(t.type, t.elements);
    if (!bytes.ok()) return bytes.status().WithContext("tensor '" + t.name + "'");
    t.bytes = *bytes;
    if (t.offset % alignment_ != 0) return Status::DataLoss("tensor '" + t.name + "' offset is not aligned");
    tensors_.push_back(std::move(t));
  }
  const uint64_t data_start = (c.offset() + alignment_ - 1) / alignment_ * alignment_;
  if (data_start > size_) return c.Truncated("padding before tensor data");
  data_ = map_ + data_start;
  for (const TensorInfo& t : tensors_) {
    if (t.offset > size_ - data_start || t.bytes > size_ - data_start - t.offset) {
      return Status::DataLoss("tensor '" + t.name + "' (" + std::to_string(t.bytes) + " bytes at data offset " +
                              std::to_string(t.offset) + ") extends past the end of the file");
    }
  }
  // Tensors never share bytes: one blob named by many tensors would make a small file decode into
  // any number of large ones.
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors_.size());
  for (const TensorInfo& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& a = *by_offset[i - 1];
    if (a.offset + a.bytes > by_offset[i]->offset) {
      return Status::DataLoss("tensors '" + a.name + "' and '" + by_offset[i]->name + "' overlap in the file");
    }
  }
  return Status::Ok();
}

Result<int64_t> GgufFile::GetInt(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return Status::NotFound("metadata '" + key + "' missing");
  if (auto* u = std::get_if<uint64_t>(&it->second.data)) return static_cast<int64_t>(*u);
  if (auto* s = std::get_if<int64_t>(&it->second.data)) return *s;
  return Status::InvalidArgument("metadata '" + key + "' is not an integer");
}

Result<double> GgufFile::GetFloat(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return Status::NotFound("metadata '" + key + "' missing");
  if (auto* d = std::get_if<double>(&it->second.data)) return *d;
  return Status::InvalidArgument("metadata '" + key + "' is not a float");
}

Result<std::string> GgufFile::GetString(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return Status::NotFound("metadata '" + key + "' missing");
  if (auto* s = std::get_if<std::string>(&it->second.data)) return *s;
  return Status::InvalidArgument("metadata '" + key + "' is not a string");
}

Result<const std::vector<Value>*> GgufFile::GetArray(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) return Status::NotFound("metadata '" + key + "' missing");
  if (auto* a = std::get_if<std::vector<Value>>(&it->second.data)) return a;
  return Status::InvalidArgument("metadata '" + key + "' is not an array");
}

Result<const TensorInfo*> GgufFile::FindTensor(const std::string& name) const {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return Status::NotFound("tensor '" + name + "' not in the file");
}

Result<std::vector<float>> GgufFile::Dequantize(const TensorInfo& t) const {
  std::vector<float> out(CanDequantize(t.type) ? t.elements : 0);
  SPECACHE_RETURN_IF_ERROR(
      DequantizeRow(t.type, TensorData(t), t.elements, out.data()).WithContext("tensor '" + t.name + "'"));
  return out;
}

}  // namespace specache::gguf
