#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// Where query qi (row qi / n_heads, head qi % n_heads) starts in q and out. Strides are resolved
// on the host (AttendDecodeBatch), never 0 here.
__device__ int64_t QueryAt(const DeviceDecodeRows& r, int qi, int d) {
  return (qi / r.n_heads) * r.q_stride + static_cast<int64_t>(qi % r.n_heads) * d;
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
  if (token >= v.length) return H2F(r.new_keys[(token - v.length) * r.kv_stride + c]);
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
  if (token >= v.length) return H2F(r.new_values[(token - v.length) * r.kv_stride + c]);
  if (token >= v.quantized_values) return H2F(v.window_values[static_cast<size_t>(token - v.quantized_values) * d + c]);
  if (v.value_bits == 16) return H2F(v.value_half[static_cast<size_t>(token) * d + c]);
  const int groups = d / v.group_size, g = c / v.group_size;
  const int words = v.group_size * v.value_bits / 32;
  const size_t slot = static_cast<size_t>(token) * groups + g;
  return static_cast<float>(Code(v.value_codes + slot * words, c % v.group_size, v.value_bits)) *
             H2F(v.value_scale[slot]) + H2F(v.value_zero[slot]);
}

constexpr int kScoreTokens = 256;  // tokens per block of the scores kernel
constexpr int kValueTokens = kDecodeValueTokens;

struct ItemBatch {  // by value: kMaxDecodeItems items fit the 32 KB parameter space of sm_70+
  DeviceDecodeItem items[kMaxDecodeItems];
  int count;
};

__device__ int32_t Width(const DeviceDecodeItem& it) { return it.replica.length + it.rows.n_rows; }
__device__ int Queries(const DeviceDecodeItem& it) { return it.rows.n_rows * it.rows.n_heads; }
__device__ float* Partials(const DeviceDecodeItem& it) {
  return it.rows.scratch + static_cast<size_t>(Queries(it)) * Width(it);
}

// Block (x, item): scores of tokens [x * kScoreTokens, +kScoreTokens), a warp per token.
__global__ void ScoresKernel(ItemBatch batch) {
  const DeviceDecodeItem& it = batch.items[blockIdx.y];
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int d = v.head_dim, queries = Queries(it);
  const int32_t width = Width(it), first = blockIdx.x * kScoreTokens;
  if (first >= width) return;
  const int32_t last = min(width, first + kScoreTokens);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  float* scores = r.scratch;  // [queries][width]
  for (int32_t token = first + warp; token < last; token += warps) {
    const int sub = token < v.quantized_keys ? SubstituteOf(r, token) : -1;
    float partial[kMaxQueries];
    for (int qi = 0; qi < queries; ++qi) partial[qi] = 0.0f;
    for (int c = lane; c < d; c += 32) {
      const float k = KeyAt(v, r, token, sub, c);
      for (int qi = 0; qi < queries; ++qi) partial[qi] += r.q[QueryAt(r, qi, d) + c] * r.scale * k;
    }
    for (int qi = 0; qi < queries; ++qi) {
      float s = partial[qi];
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const bool masked = token >= v.length && token - v.length > qi / r.n_heads;  // causal among new rows
      if (lane == 0) scores[static_cast<size_t>(qi) * width + token] = masked ? -INFINITY : s;
    }
  }
}

// Block (x, item): a warp per query normalises its row in place; the probabilities row is copied.
__global__ void SoftmaxKernel(ItemBatch batch) {
  const DeviceDecodeItem& it = batch.items[blockIdx.y];
  const DeviceDecodeRows& r = it.rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  const int qi = blockIdx.x * warps + warp;
  if (qi >= Queries(it)) return;
  const int32_t width = Width(it);
  float* row = r.scratch + static_cast<size_t>(qi) * width;
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
  if (r.probs && qi / r.n_heads == r.probs_row) {
    float* probs = r.probs + static_cast<size_t>(qi % r.n_heads) * r.n_candidates;
    for (int32_t t = lane; t < r.n_candidates; t += 32) probs[t] = row[t];
  }
}

// Block (x, item): sum over tokens [x * kValueTokens, +kValueTokens) of weight x value, a thread
// per (query, channel), into partial block x.
__global__ void ValuesKernel(ItemBatch batch) {
  __shared__ int subs[kValueTokens];
  const DeviceDecodeItem& it = batch.items[blockIdx.y];
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int d = v.head_dim, queries = Queries(it);
  const int32_t width = Width(it), first = blockIdx.x * kValueTokens;
  if (first >= width) return;
  const int32_t n = min(kValueTokens, width - first);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int32_t token = first + i;
    subs[i] = token < v.quantized_keys ? SubstituteOf(r, token) : -1;
  }
  __syncthreads();
  float* partial = Partials(it) + static_cast<size_t>(blockIdx.x) * queries * d;
  for (int i = threadIdx.x; i < queries * d; i += blockDim.x) {
    const int qi = i / d, c = i % d;
    const float* w = r.scratch + static_cast<size_t>(qi) * width + first;
    float acc = 0.0f;
    for (int32_t j = 0; j < n; ++j) {
      if (w[j] == 0.0f) continue;
      acc += w[j] * ValueAt(v, r, first + j, subs[j], c);
    }
    partial[i] = acc;
  }
}

// Block item: out = the partial sums in block order.
__global__ void ReduceKernel(ItemBatch batch) {
  const DeviceDecodeItem& it = batch.items[blockIdx.x];
  const int size = Queries(it) * it.replica.head_dim;
  const int blocks = (Width(it) + kValueTokens - 1) / kValueTokens;
  const float* partial = Partials(it);
  for (int i = threadIdx.x; i < size; i += blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; ++b) acc += partial[static_cast<size_t>(b) * size + i];
    it.rows.out[QueryAt(it.rows, i / it.replica.head_dim, it.replica.head_dim) + i % it.replica.head_dim] = acc;
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

Status AttendDecodeBatch(const DeviceDecodeItem* items, int n_items, void* stream) {
  for (int i = 0; i < n_items; ++i) {
    const DeviceReplicaView& replica = items[i].replica;
    const DeviceDecodeRows& rows = items[i].rows;
    if (rows.n_rows < 1 || rows.n_heads < 1 || rows.n_rows * rows.n_heads > kMaxQueries) {
      return Status::InvalidArgument("rows x heads must be in [1, " + std::to_string(kMaxQueries) + "]");
    }
    if (replica.head_dim <= 0 || replica.head_dim % 32 != 0) {
      return Status::InvalidArgument("head_dim must be a multiple of 32");
    }
    if (rows.probs && (rows.probs_row < 0 || rows.probs_row >= rows.n_rows ||
                       rows.n_candidates > replica.length + rows.probs_row + 1)) {
      return Status::InvalidArgument("probs row or candidate count out of range");
    }
  }
  auto* s = static_cast<cudaStream_t>(stream);
  for (int first = 0; first < n_items; first += kMaxDecodeItems) {
    ItemBatch batch;
    batch.count = std::min(kMaxDecodeItems, n_items - first);
    int32_t width = 0;
    int queries = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.items[i] = items[first + i];
      DeviceDecodeRows& r = batch.items[i].rows;
      if (r.q_stride == 0) r.q_stride = int64_t{r.n_heads} * batch.items[i].replica.head_dim;
      if (r.kv_stride == 0) r.kv_stride = batch.items[i].replica.head_dim;
      width = std::max(width, batch.items[i].replica.length + batch.items[i].rows.n_rows);
      queries = std::max(queries, batch.items[i].rows.n_rows * batch.items[i].rows.n_heads);
    }
    const unsigned n = static_cast<unsigned>(batch.count);
    ScoresKernel<<<dim3((width + kScoreTokens - 1) / kScoreTokens, n), kThreads, 0, s>>>(batch);
    SoftmaxKernel<<<dim3((queries + kThreads / 32 - 1) / (kThreads / 32), n), kThreads, 0, s>>>(batch);
    ValuesKernel<<<dim3((width + kValueTokens - 1) / kValueTokens, n), kThreads, 0, s>>>(batch);
    ReduceKernel<<<n, kThreads, 0, s>>>(batch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return Status::Unavailable(std::string("decode attention kernels: ") + cudaGetErrorString(err));
  }
  return Status::Ok();
}

Status AttendDecodeRows(const DeviceReplicaView& replica, const DeviceDecodeRows& rows, void* stream) {
  const DeviceDecodeItem item{replica, rows};
  return AttendDecodeBatch(&item, 1, stream);
}

}  // namespace specache::cuda
