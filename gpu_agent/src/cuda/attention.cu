#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "specache/cuda_attention.h"

namespace specache::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxQueries = 64;  // rows x GQA heads

__device__ float H2F(Half h) { return __half2float(__ushort_as_half(h)); }

__device__ uint32_t Code(const uint32_t* words, int i, int bits) {
  const int per_word = 32 / bits;
  return (words[i / per_word] >> ((i % per_word) * bits)) & ((1u << bits) - 1u);
}

// Index of `token` among the substituted rows, or -1.
__device__ int SubstituteOf(const DeviceDecodeRows& r, int32_t token) {
  int lo = 0, hi = r.n_sub - 1;
  while (lo <= hi) {
    const int mid = (lo + hi) >> 1;
    const int32_t t = r.sub_tokens[mid];
    if (t == token) return mid;
    if (t < token) lo = mid + 1; else hi = mid - 1;
  }
  return -1;
}

// Channel c of the key the scores use for `token`.
__device__ float KeyAt(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t token, int sub, int c) {
  const int d = v.head_dim;
  if (token >= v.length) return H2F(r.new_keys[static_cast<size_t>(token - v.length) * d + c]);
  if (token >= v.quantized_keys) return H2F(v.residual_keys[static_cast<size_t>(token - v.quantized_keys) * d + c]);
  if (sub >= 0) return H2F(r.sub_rows[static_cast<size_t>(sub) * 2 * d + c]);
  if (v.key_bits == 16) return H2F(v.key_half[static_cast<size_t>(token) * d + c]);
  const int g = token / v.group_size, t = token % v.group_size;
  const int words = v.group_size * v.key_bits / 32;
  const size_t slot = static_cast<size_t>(g) * d + c;
  return static_cast<float>(Code(v.key_codes + slot * words, t, v.key_bits)) * H2F(v.key_scale[slot]) +
         H2F(v.key_zero[slot]);
}

__device__ float ValueAt(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t token, int sub, int c) {
  const int d = v.head_dim;
  if (sub >= 0) return H2F(r.sub_rows[static_cast<size_t>(sub) * 2 * d + d + c]);
  if (token >= v.length) return H2F(r.new_values[static_cast<size_t>(token - v.length) * d + c]);
  if (token >= v.quantized_values) return H2F(v.window_values[static_cast<size_t>(token - v.quantized_values) * d + c]);
  if (v.value_bits == 16) return H2F(v.value_half[static_cast<size_t>(token) * d + c]);
  const int groups = d / v.group_size, g = c / v.group_size;
  const int words = v.group_size * v.value_bits / 32;
  const size_t slot = static_cast<size_t>(token) * groups + g;
  return static_cast<float>(Code(v.value_codes + slot * words, c % v.group_size, v.value_bits)) *
             H2F(v.value_scale[slot]) + H2F(v.value_zero[slot]);
}

// One block does everything for one head: scores (a warp per token), softmax (a warp per query),
// output (a thread per (query, channel)).
__global__ void DecodeKernel(DeviceReplicaView v, DeviceDecodeRows r) {
  const int d = v.head_dim;
  const int queries = r.n_rows * r.n_heads;
  const int32_t width = v.length + r.n_rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  float* scores = r.scratch;  // [queries][width]

  for (int32_t token = warp; token < width; token += warps) {
    const int sub = token < v.quantized_keys ? SubstituteOf(r, token) : -1;
    float partial[kMaxQueries];
    for (int qi = 0; qi < queries; ++qi) partial[qi] = 0.0f;
    for (int c = lane; c < d; c += 32) {
      const float k = KeyAt(v, r, token, sub, c);
      for (int qi = 0; qi < queries; ++qi) partial[qi] += r.q[static_cast<size_t>(qi) * d + c] * r.scale * k;
    }
    for (int qi = 0; qi < queries; ++qi) {
      float s = partial[qi];
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const bool masked = token >= v.length && token - v.length > qi / r.n_heads;  // causal among new rows
      if (lane == 0) scores[static_cast<size_t>(qi) * width + token] = masked ? -INFINITY : s;
    }
  }
  __syncthreads();

  for (int qi = warp; qi < queries; qi += warps) {
    float* row = scores + static_cast<size_t>(qi) * width;
    float m = -INFINITY;
    for (int32_t t = lane; t < width; t += 32) m = fmaxf(m, row[t]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float sum = 0.0f;
    for (int32_t t = lane; t < width; t += 32) {
      const float e = expf(row[t] - m);
      row[t] = e;
      sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
    for (int32_t t = lane; t < width; t += 32) row[t] *= inv;
  }
  __syncthreads();

  if (r.probs) {
    for (int i = threadIdx.x; i < r.n_heads * r.n_candidates; i += blockDim.x) {
      const int h = i / r.n_candidates, t = i % r.n_candidates;
      r.probs[i] = scores[static_cast<size_t>(r.probs_row * r.n_heads + h) * width + t];
    }
  }
  for (int i = threadIdx.x; i < queries * d; i += blockDim.x) {
    const int qi = i / d, c = i % d;
    const float* w = scores + static_cast<size_t>(qi) * width;
    float acc = 0.0f;
    for (int32_t token = 0; token < width; ++token) {
      if (w[token] == 0.0f) continue;
      const int sub = token < v.quantized_keys ? SubstituteOf(r, token) : -1;
      acc += w[token] * ValueAt(v, r, token, sub, c);
    }
    r.out[i] = acc;
  }
}

// Block b handles (query token, head) pairs b, b + gridDim.x, ...: scores into its scratch row
// (a warp per key), softmax (block reduction), output (a thread per channel).
__global__ void PrefillKernel(const float* q, const __half* keys, const __half* values, int32_t n, int n_heads, int d,
                              float scale, float* out, float* scratch) {
  __shared__ float reduce[32];
  float* s = scratch + static_cast<size_t>(blockIdx.x) * n;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  for (int64_t pair = blockIdx.x; pair < static_cast<int64_t>(n) * n_heads; pair += gridDim.x) {
    const int32_t i = static_cast<int32_t>(pair / n_heads);
    const float* qi = q + static_cast<size_t>(pair) * d;
    for (int32_t j = warp; j <= i; j += warps) {
      float acc = 0.0f;
      for (int c = lane; c < d; c += 32) acc += qi[c] * scale * __half2float(keys[static_cast<size_t>(j) * d + c]);
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) s[j] = acc;
    }
    __syncthreads();
    float m = -INFINITY;
    for (int32_t j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, s[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) reduce[warp] = m;
    __syncthreads();
    m = -INFINITY;
    for (int w = 0; w < warps; ++w) m = fmaxf(m, reduce[w]);
    __syncthreads();
    float sum = 0.0f;
    for (int32_t j = threadIdx.x; j <= i; j += blockDim.x) {
      const float e = expf(s[j] - m);
      s[j] = e;
      sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) reduce[warp] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < warps; ++w) sum += reduce[w];
    const float inv = 1.0f / sum;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = 0.0f;
      for (int32_t j = 0; j <= i; ++j) acc += s[j] * inv * __half2float(values[static_cast<size_t>(j) * d + c]);
      out[static_cast<size_t>(pair) * d + c] = acc;
    }
    __syncthreads();
  }
}

}  // namespace

Status AttendPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_heads, int head_dim,
                     float scale, float* out, float* scratch, void* stream) {
  if (n < 0 || n_heads <= 0 || head_dim <= 0) return Status::InvalidArgument("bad prefill shape");
  if (n == 0) return Status::Ok();
  const int64_t pairs = static_cast<int64_t>(n) * n_heads;
  const int blocks = static_cast<int>(pairs < 1024 ? pairs : 1024);
  PrefillKernel<<<blocks, 128, 0, static_cast<cudaStream_t>(stream)>>>(
      q, reinterpret_cast<const __half*>(keys), reinterpret_cast<const __half*>(values), n, n_heads, head_dim, scale, out,
      scratch);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : Status::Unavailable(std::string("prefill kernel: ") + cudaGetErrorString(err));
}

Status AttendDecodeRows(const DeviceReplicaView& replica, const DeviceDecodeRows& rows, void* stream) {
  if (rows.n_rows < 1 || rows.n_heads < 1 || rows.n_rows * rows.n_heads > kMaxQueries) {
    return Status::InvalidArgument("rows x heads must be in [1, " + std::to_string(kMaxQueries) + "]");
  }
  if (replica.head_dim <= 0 || replica.head_dim % 32 != 0) return Status::InvalidArgument("head_dim must be a multiple of 32");
  if (rows.probs && (rows.probs_row < 0 || rows.probs_row >= rows.n_rows ||
                     rows.n_candidates > replica.length + rows.probs_row + 1)) {
    return Status::InvalidArgument("probs row or candidate count out of range");
  }
  DecodeKernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(replica, rows);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok()
                            : Status::Unavailable(std::string("decode attention kernel: ") + cudaGetErrorString(err));
}

}  // namespace specache::cuda
