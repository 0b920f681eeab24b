#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "specache/cuda_quantize.h"
#include "specache/cuda_replica.h"
#include "specache/cuda_tensors.h"
#include "specache/quantizer.h"

namespace specache::cuda {
namespace {

Status Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  if (err == cudaErrorMemoryAllocation) return Status::ResourceExhausted(std::string(what) + ": out of device memory");
  return Status::Unavailable(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

// Device arrays, each sized for the capacity at creation.
struct DeviceHeadReplica::Buffers {
  std::vector<void*> owned;
  uint32_t* key_codes = nullptr;
  Half* key_scale = nullptr;
  Half* key_zero = nullptr;
  Half* key_half = nullptr;
  Half* key_residual = nullptr;  // [R][d]
  uint32_t* value_codes = nullptr;
  Half* value_scale = nullptr;
  Half* value_zero = nullptr;
  Half* value_half = nullptr;
  Half* window = nullptr;        // [3R][d]: window_begin .. +window_count in use
  ~Buffers() {
    for (void* p : owned) cudaFree(p);
  }
  int64_t bytes = 0;  // allocated
  template <typename T>
  Status Alloc(T** out, size_t n, const char* what) {
    if (n == 0) return Status::Ok();
    void* p = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMalloc(&p, n * sizeof(T)), what));
    owned.push_back(p);
    bytes += static_cast<int64_t>(n * sizeof(T));
    *out = static_cast<T*>(p);
    return Status::Ok();
  }
};

Result<std::unique_ptr<DeviceHeadReplica>> DeviceHeadReplica::Create(const ReplicaParams& p, int32_t capacity,
                                                                     void* stream) {
  const bool packed_k = IsPackedBitWidth(p.key_bits), packed_v = IsPackedBitWidth(p.value_bits);
  if ((!packed_k && p.key_bits != 16) || (!packed_v && p.value_bits != 16)) {
    return Status::InvalidArgument("bits must be 1, 2, 4 or 16");
  }
  if (p.group_size <= 0 || p.group_size % 32 || p.group_size > 128 || p.residual_tokens % p.group_size ||
      p.head_dim % p.group_size || p.head_dim % 32) {
    return Status::InvalidArgument("group_size must be 32..128 (x32), divide head_dim and R; head_dim a multiple of 32");
  }
  if (capacity <= 0) return Status::InvalidArgument("capacity must be positive");
  std::unique_ptr<DeviceHeadReplica> r(new DeviceHeadReplica());
  r->params_ = p;
  r->capacity_ = capacity;
  r->stream_ = stream;
  r->b_ = std::make_unique<Buffers>();
  Buffers& b = *r->b_;
  const size_t d = p.head_dim, groups = (capacity + p.group_size - 1) / p.group_size, R = p.residual_tokens;
  if (packed_k) {
    SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.key_codes, groups * d * WordsPerGroup(p.group_size, p.key_bits), "key codes"));
    SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.key_scale, groups * d, "key scales"));
    SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.key_zero, groups * d, "key zeros"));
  } else {
    SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.key_half, groups * p.group_size * d, "fp16 keys"));
  }
  SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.key_residual, R * d, "key residual"));
  const size_t vgroups = d / p.group_size;
  if (packed_v) {
    SPECACHE_RETURN_IF_ERROR(
        b.Alloc(&b.value_codes, size_t(capacity) * vgroups * WordsPerGroup(p.group_size, p.value_bits), "value codes"));
    SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.value_scale, size_t(capacity) * vgroups, "value scales"));
    SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.value_zero, size_t(capacity) * vgroups, "value zeros"));
  } else {
    SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.value_half, size_t(capacity) * d, "fp16 values"));
  }
  SPECACHE_RETURN_IF_ERROR(b.Alloc(&b.window, 3 * R * d, "value window"));
  return Result<std::unique_ptr<DeviceHeadReplica>>(std::move(r));
}

DeviceHeadReplica::~DeviceHeadReplica() = default;

Status DeviceHeadReplica::Append(const Half* keys, const Half* values, int32_t n) {
  if (n < 0) return Status::InvalidArgument("negative token count");
  if (n > capacity_ - length_) {
    return Status::ResourceExhausted("replica capacity of " + std::to_string(capacity_) + " tokens reached");
  }
  const ReplicaParams& p = params_;
  const int d = p.head_dim, R = p.residual_tokens;
  const cudaStream_t s = static_cast<cudaStream_t>(stream_);
  Buffers& b = *b_;
  const size_t row = static_cast<size_t>(d) * sizeof(Half);
  // Chunks of at most R tokens: the same final state as HeadReplica's token-by-token rule, since
  // each group and each value token is quantized from its own elements only.
  for (int32_t done = 0; done < n;) {
    const int32_t chunk = std::min<int32_t>(n - done, R - residual_);
    const Half* k = keys + static_cast<size_t>(done) * d;
    const Half* v = values + static_cast<size_t>(done) * d;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.key_residual + static_cast<size_t>(residual_) * d, k, chunk * row,
                                                  cudaMemcpyDeviceToDevice, s), "key residual copy"));
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.window + static_cast<size_t>(window_begin_ + window_count_) * d, v,
                                                  chunk * row, cudaMemcpyDeviceToDevice, s), "value window copy"));
    residual_ += chunk;
    window_count_ += chunk;
    length_ += chunk;
    done += chunk;
    if (residual_ == R) SPECACHE_RETURN_IF_ERROR(FlushKeyGroups());
    if (window_count_ > R) SPECACHE_RETURN_IF_ERROR(RetireOldestValues(window_count_ - R));
    if (window_begin_ > R) SPECACHE_RETURN_IF_ERROR(CompactWindow());
  }
  return Status::Ok();
}

Status DeviceHeadReplica::FlushKeyGroups() {  // the full residual becomes R/G key groups
  const ReplicaParams& p = params_;
  const int d = p.head_dim, R = p.residual_tokens, G = p.group_size, groups = R / G;
  Buffers& b = *b_;
  if (IsPackedBitWidth(p.key_bits)) {
    const size_t words = static_cast<size_t>(d) * WordsPerGroup(G, p.key_bits);
    SPECACHE_RETURN_IF_ERROR(QuantizeKeyGroups(b.key_residual, groups, G, d, p.key_bits, b.key_codes + key_groups_ * words,
                                               b.key_scale + size_t(key_groups_) * d, b.key_zero + size_t(key_groups_) * d,
                                               stream_));
  } else {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.key_half + static_cast<size_t>(key_groups_) * G * d, b.key_residual,
                                                  static_cast<size_t>(R) * d * sizeof(Half), cudaMemcpyDeviceToDevice,
                                                  static_cast<cudaStream_t>(stream_)),
                                  "fp16 key flush"));
  }
  key_groups_ += groups;
  residual_ = 0;
  return Status::Ok();
}

ValueTokenTask DeviceHeadReplica::OldestValueTask() const {
  const ReplicaParams& p = params_;
  const int d = p.head_dim, vg = d / p.group_size;
  const size_t words = static_cast<size_t>(vg) * WordsPerGroup(p.group_size, p.value_bits);
  const Buffers& b = *b_;
  return {b.window + static_cast<size_t>(window_begin_) * d, b.value_codes + static_cast<size_t>(quantized_values_) * words,
          b.value_scale + static_cast<size_t>(quantized_values_) * vg, b.value_zero + static_cast<size_t>(quantized_values_) * vg};
}

Status DeviceHeadReplica::RetireOldestValues(int32_t m) {  // the oldest m values leave the window
  const ReplicaParams& p = params_;
  const int d = p.head_dim;
  Buffers& b = *b_;
  const Half* oldest = b.window + static_cast<size_t>(window_begin_) * d;
  if (IsPackedBitWidth(p.value_bits)) {
    const ValueTokenTask t = OldestValueTask();
    SPECACHE_RETURN_IF_ERROR(QuantizeValueTokens(oldest, m, d, p.group_size, p.value_bits, t.codes, t.scale, t.zero, stream_));
  } else {
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.value_half + static_cast<size_t>(quantized_values_) * d, oldest,
                                                  m * d * sizeof(Half), cudaMemcpyDeviceToDevice,
                                                  static_cast<cudaStream_t>(stream_)),
                                  "fp16 value copy"));
  }
  quantized_values_ += m;
  window_begin_ += m;
  window_count_ -= m;
  return Status::Ok();
}

Status DeviceHeadReplica::CompactWindow() {  // [begin, begin + count) -> [0, count), no overlap as count <= R < begin
  const int d = params_.head_dim;
  Buffers& b = *b_;
  SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.window, b.window + static_cast<size_t>(window_begin_) * d,
                                                window_count_ * d * sizeof(Half), cudaMemcpyDeviceToDevice,
                                                static_cast<cudaStream_t>(stream_)),
                                "value window compaction"));
  window_begin_ = 0;
  return Status::Ok();
}

Status DeviceHeadReplica::AppendTokens(const std::vector<DeviceHeadReplica*>& replicas,
                                       const std::vector<const Half*>& keys, const std::vector<const Half*>& values) {
  if (keys.size() != replicas.size() || values.size() != replicas.size()) {
    return Status::InvalidArgument("one key and one value row per replica");
  }
  if (replicas.empty()) return Status::Ok();
  const ReplicaParams& p = replicas[0]->params_;
  void* stream = replicas[0]->stream_;
  for (const DeviceHeadReplica* r : replicas) {
    const ReplicaParams& q = r->params_;
    if (q.head_dim != p.head_dim || q.key_bits != p.key_bits || q.value_bits != p.value_bits ||
        q.group_size != p.group_size || q.residual_tokens != p.residual_tokens || r->stream_ != stream) {
      return Status::InvalidArgument("replicas of one batched append must share parameters and stream");
    }
    if (r->length_ >= r->capacity_) {
      return Status::ResourceExhausted("replica capacity of " + std::to_string(r->capacity_) + " tokens reached");
    }
  }
  const int d = p.head_dim, R = p.residual_tokens;
  const bool packed_values = IsPackedBitWidth(p.value_bits);
  std::vector<RowCopy> copies;
  copies.reserve(2 * replicas.size());
  for (size_t i = 0; i < replicas.size(); ++i) {  // residual_ < R and window_count_ <= R: both rows have room
    Buffers& b = *replicas[i]->b_;
    copies.push_back({keys[i], b.key_residual + static_cast<size_t>(replicas[i]->residual_) * d});
    copies.push_back({values[i], b.window + static_cast<size_t>(replicas[i]->window_begin_ + replicas[i]->window_count_) * d});
  }
  SPECACHE_RETURN_IF_ERROR(CopyRows(copies.data(), static_cast<int>(copies.size()), d * static_cast<int>(sizeof(Half)), stream));
  // The window's oldest value leaves it (steady state: one per token), for all replicas at once.
  std::vector<ValueTokenTask> retire;
  std::vector<RowCopy> retire_half;
  std::vector<DeviceHeadReplica*> compact;
  for (DeviceHeadReplica* r : replicas) {
    ++r->residual_;
    ++r->window_count_;
    ++r->length_;
    if (r->residual_ == R) SPECACHE_RETURN_IF_ERROR(r->FlushKeyGroups());
    if (r->window_count_ > R) {
      const ValueTokenTask t = r->OldestValueTask();
      if (packed_values) {
        retire.push_back(t);
      } else {
        retire_half.push_back({t.value, r->b_->value_half + static_cast<size_t>(r->quantized_values_) * d});
      }
      ++r->quantized_values_;
      ++r->window_begin_;
      --r->window_count_;
      if (r->window_begin_ > R) compact.push_back(r);
    }
  }
  if (!retire.empty()) {
    SPECACHE_RETURN_IF_ERROR(
        QuantizeValueTokenBatch(retire.data(), static_cast<int>(retire.size()), d, p.group_size, p.value_bits, stream));
  }
  if (!retire_half.empty()) {
    SPECACHE_RETURN_IF_ERROR(
        CopyRows(retire_half.data(), static_cast<int>(retire_half.size()), d * static_cast<int>(sizeof(Half)), stream));
  }
  for (DeviceHeadReplica* r : compact) SPECACHE_RETURN_IF_ERROR(r->CompactWindow());
  return Status::Ok();
}

DeviceReplicaView DeviceHeadReplica::view() const {
  DeviceReplicaView v;
  v.head_dim = params_.head_dim;
  v.group_size = params_.group_size;
  v.key_bits = params_.key_bits;
  v.value_bits = params_.value_bits;
  v.length = length_;
  v.quantized_keys = quantized_keys();
  v.quantized_values = quantized_values_;
  v.key_codes = b_->key_codes;
  v.key_scale = b_->key_scale;
  v.key_zero = b_->key_zero;
  v.key_half = b_->key_half;
  v.residual_keys = b_->key_residual;
  v.value_codes = b_->value_codes;
  v.value_scale = b_->value_scale;
  v.value_zero = b_->value_zero;
  v.value_half = b_->value_half;
  v.window_values = b_->window + static_cast<size_t>(window_begin_) * params_.head_dim;
  return v;
}

int64_t DeviceHeadReplica::device_bytes() const {
  const ReplicaParams& p = params_;
  const int64_t d = p.head_dim, G = p.group_size;
  int64_t bytes = int64_t{residual_} * d * 2 + int64_t{window_count_} * d * 2;
  bytes += IsPackedBitWidth(p.key_bits) ? int64_t{key_groups_} * d * (WordsPerGroup(G, p.key_bits) * 4 + 4)
                                        : int64_t{key_groups_} * G * d * 2;
  bytes += IsPackedBitWidth(p.value_bits) ? int64_t{quantized_values_} * (d / G) * (WordsPerGroup(G, p.value_bits) * 4 + 4)
                                          : int64_t{quantized_values_} * d * 2;
  return bytes;
}

int64_t DeviceHeadReplica::reserved_bytes() const { return b_->bytes; }

}  // namespace specache::cuda
