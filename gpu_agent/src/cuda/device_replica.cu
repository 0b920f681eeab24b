#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "specache/cuda_quantize.h"
#include "specache/cuda_replica.h"
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
  template <typename T>
  Status Alloc(T** out, size_t n, const char* what) {
    if (n == 0) return Status::Ok();
    void* p = nullptr;
    SPECACHE_RETURN_IF_ERROR(Cuda(cudaMalloc(&p, n * sizeof(T)), what));
    owned.push_back(p);
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
  const int d = p.head_dim, R = p.residual_tokens, G = p.group_size;
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
    if (residual_ == R) {  // flush: R/G key groups
      const int groups = R / G;
      if (IsPackedBitWidth(p.key_bits)) {
        const size_t words = static_cast<size_t>(d) * WordsPerGroup(G, p.key_bits);
        SPECACHE_RETURN_IF_ERROR(QuantizeKeyGroups(b.key_residual, groups, G, d, p.key_bits,
                                                   b.key_codes + key_groups_ * words, b.key_scale + size_t(key_groups_) * d,
                                                   b.key_zero + size_t(key_groups_) * d, stream_));
      } else {
        SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.key_half + static_cast<size_t>(key_groups_) * G * d, b.key_residual,
                                                      static_cast<size_t>(R) * row, cudaMemcpyDeviceToDevice, s),
                                      "fp16 key flush"));
      }
      key_groups_ += groups;
      residual_ = 0;
    }
    if (window_count_ > R) {  // the oldest values leave the window
      const int32_t m = window_count_ - R;
      const Half* oldest = b.window + static_cast<size_t>(window_begin_) * d;
      if (IsPackedBitWidth(p.value_bits)) {
        const int vg = d / G;
        const size_t words = static_cast<size_t>(vg) * WordsPerGroup(G, p.value_bits);
        SPECACHE_RETURN_IF_ERROR(QuantizeValueTokens(oldest, m, d, G, p.value_bits,
                                                     b.value_codes + static_cast<size_t>(quantized_values_) * words,
                                                     b.value_scale + static_cast<size_t>(quantized_values_) * vg,
                                                     b.value_zero + static_cast<size_t>(quantized_values_) * vg, stream_));
      } else {
        SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.value_half + static_cast<size_t>(quantized_values_) * d, oldest,
                                                      m * row, cudaMemcpyDeviceToDevice, s), "fp16 value copy"));
      }
      quantized_values_ += m;
      window_begin_ += m;
      window_count_ = R;
    }
    if (window_begin_ > R) {  // compact: [begin, begin + count) -> [0, count), no overlap as count <= R < begin
      SPECACHE_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(b.window, b.window + static_cast<size_t>(window_begin_) * d,
                                                    window_count_ * row, cudaMemcpyDeviceToDevice, s),
                                    "value window compaction"));
      window_begin_ = 0;
    }
  }
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

}  // namespace specache::cuda
