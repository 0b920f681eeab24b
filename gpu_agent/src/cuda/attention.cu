#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "specache/cuda_attention.h"
#include "decode_common.cuh"
#include "decode_plan_slots.h"
#include "lowbit_decode.h"
#include "prefill_attention.h"

namespace specache::cuda {
namespace {

using decode::H2F;
using decode::KeyAt;
using decode::QueryAt;
using decode::ValueAt;

constexpr int kThreads = 256;
constexpr int kMaxQueries = kMaxDecodeQueries;

constexpr int kBlockTokens = kDecodeBlockTokens;


__device__ int32_t Width(const DeviceDecodeItem& it) { return it.replica.length + it.rows.n_rows; }
__device__ int Queries(const DeviceDecodeItem& it) { return it.rows.n_rows * it.rows.n_heads; }
__device__ int Blocks(const DeviceDecodeItem& it) { return (Width(it) + kBlockTokens - 1) / kBlockTokens; }
// Scratch: scores [queries][width], then statistics [queries][blocks][2], then partial sums
// [blocks][queries][d].
__device__ float* Statistics(const DeviceDecodeItem& it) {
  return it.rows.scratch + static_cast<size_t>(Queries(it)) * Width(it);
}
__device__ float* Partials(const DeviceDecodeItem& it) {
  return Statistics(it) + static_cast<size_t>(Queries(it)) * Blocks(it) * 2;
}

// Reduces `x` over the block with `op`; every thread gets the result.
template <typename Op>
__device__ float BlockReduce(float x, Op op, float* shared) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int o = 16; o > 0; o >>= 1) x = op(x, __shfl_xor_sync(0xffffffffu, x, o));
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = shared[0];
  for (int w = 1; w < blockDim.x / 32; ++w) x = op(x, shared[w]);
  return x;
}

// subs[j] = the index among the substituted rows of token first + j (j < n), or -1; only quantized
// keys are substituted. One pass over the (short) substitution list per block instead of a
// binary search per token.
__device__ void MapSubstitutes(const DeviceReplicaView& v, const DeviceDecodeRows& r, int32_t first, int32_t n,
                               int* subs) {
  for (int j = threadIdx.x; j < n; j += blockDim.x) subs[j] = -1;
  __syncthreads();
  const int32_t end = min(first + n, v.quantized_keys);
  for (int i = threadIdx.x; i < r.n_sub; i += blockDim.x) {
    const int32_t t = r.sub_tokens[i];
    if (t >= first && t < end) subs[t - first] = i;
  }
  __syncthreads();
}

// Block (x, item): scores of tokens [x * kBlockTokens, +kBlockTokens), a thread per token over
// every channel and every query (Q >= the item's queries, a compile-time bound so the sums stay in
// registers), and per query the block's max and sum of exp(score - max). Threads of a warp hold
// neighbouring tokens, which share their key group's code words, scales and zeros: those loads
// are broadcasts.
template <int Q>
__global__ void ScoresKernel(const DeviceItemSet* set) {
  extern __shared__ float scaled_q[];  // [queries][d]
  __shared__ float reduce[kThreads / 32];
  __shared__ int subs[kBlockTokens];
  const DeviceDecodeItem& it = SetItems(set)[blockIdx.y];
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int d = v.head_dim, queries = Queries(it);
  const int32_t width = Width(it), first = blockIdx.x * kBlockTokens;
  if (first >= width) return;
  // QueryOperand(q) * scale, a warp per query.
  for (int qi = threadIdx.x / 32; qi < queries; qi += blockDim.x / 32) {
    const float* row = r.q + QueryAt(r, qi, d);
    const int e = decode::WarpQueryOperandExponent(row, d, threadIdx.x % 32);
    for (int c = threadIdx.x % 32; c < d; c += 32) scaled_q[qi * d + c] = decode::QueryOperandChannel(row[c], e) * r.scale;
  }
  MapSubstitutes(v, r, first, min(kBlockTokens, width - first), subs);
  const int32_t token = first + threadIdx.x;
  float acc[Q];
#pragma unroll
  for (int qi = 0; qi < Q; ++qi) acc[qi] = 0.0f;
  if (token < width) {
    const int sub = subs[threadIdx.x];
    if (sub < 0 && token < v.quantized_keys && v.key_bits != 16) {  // the low-bit keys: most tokens
      const int G = v.group_size, bits = v.key_bits, per_word = 32 / bits, words = G * bits / 32;
      const int g = token / G, t = token % G, word = t / per_word, shift = (t % per_word) * bits;
      const uint32_t mask = (1u << bits) - 1u;
      const uint32_t* codes = KeyCodes(v, g) + word;
      const Half* scale = KeyScales(v, g);
      const Half* zero = KeyZeros(v, g);
#pragma unroll 4
      for (int c = 0; c < d; ++c) {
        const float k = static_cast<float>((codes[static_cast<size_t>(c) * words] >> shift) & mask) * H2F(scale[c]) +
                        H2F(zero[c]);
#pragma unroll
        for (int qi = 0; qi < Q; ++qi) if (qi < queries) acc[qi] += scaled_q[qi * d + c] * k;
      }
    } else {
      for (int c = 0; c < d; ++c) {
        const float k = KeyAt(v, r, token, sub, c);
#pragma unroll
        for (int qi = 0; qi < Q; ++qi) if (qi < queries) acc[qi] += scaled_q[qi * d + c] * k;
      }
    }
  }
  float* scores = r.scratch;  // [queries][width]
  float* stats = Statistics(it);
  const int blocks = Blocks(it);
#pragma unroll
  for (int qi = 0; qi < Q; ++qi) {
    if (qi >= queries) break;  // uniform over the block
    const bool masked = token >= v.length && token - v.length > qi / r.n_heads;  // causal among new rows
    const float score = token < width && !masked ? acc[qi] : -INFINITY;
    if (token < width) scores[static_cast<size_t>(qi) * width + token] = score;
    const float m = BlockReduce(score, [](float a, float b) { return fmaxf(a, b); }, reduce);
    const float l = BlockReduce(m == -INFINITY ? 0.0f : expf(score - m), [](float a, float b) { return a + b; }, reduce);
    if (threadIdx.x == 0) {
      stats[(static_cast<size_t>(qi) * blocks + blockIdx.x) * 2] = m;
      stats[(static_cast<size_t>(qi) * blocks + blockIdx.x) * 2 + 1] = l;
    }
  }
}

// Block (x, item): sum over tokens [x * kBlockTokens, +kBlockTokens) of weight x value for every
// query, into partial block x. The weights are the softmax of the scores, from the statistics of
// all score blocks; the probabilities row's share is written out for the top-k. Each thread takes
// one channel and every L-th token (L = blockDim / d), each value decoded once for all queries.
template <int Q>
__global__ void ValuesKernel(const DeviceItemSet* set) {
  extern __shared__ float weights[];  // [queries][kBlockTokens], then reused for the lane sums [lanes][queries][d]
  __shared__ int subs[kBlockTokens];
  __shared__ float max_of[kMaxQueries], inv_sum_of[kMaxQueries];
  const DeviceDecodeItem& it = SetItems(set)[blockIdx.y];
  const DeviceReplicaView& v = it.replica;
  const DeviceDecodeRows& r = it.rows;
  const int d = v.head_dim, queries = Queries(it);
  const int32_t width = Width(it), first = blockIdx.x * kBlockTokens;
  if (first >= width) return;
  const int32_t n = min(kBlockTokens, width - first);
  const int blocks = Blocks(it);
  const float* stats = Statistics(it);
  if (threadIdx.x < queries) {  // the softmax's max and sum over all blocks
    const int qi = threadIdx.x;
    float m = -INFINITY;
    for (int b = 0; b < blocks; ++b) m = fmaxf(m, stats[(static_cast<size_t>(qi) * blocks + b) * 2]);
    float l = 0.0f;
    for (int b = 0; b < blocks; ++b) {
      const float mb = stats[(static_cast<size_t>(qi) * blocks + b) * 2];
      if (mb != -INFINITY) l += stats[(static_cast<size_t>(qi) * blocks + b) * 2 + 1] * expf(mb - m);
    }
    max_of[qi] = m;
    inv_sum_of[qi] = 1.0f / l;
    if (blockIdx.x == 0) {
      float* stats = r.probs && r.probs_stats && qi / r.n_heads == r.probs_row ? r.probs_stats
                                                                              : decode::RealRowStats(r, qi / r.n_heads);
      if (stats) stats[(qi % r.n_heads) * 2] = m, stats[(qi % r.n_heads) * 2 + 1] = l;
    }
  }
  MapSubstitutes(v, r, first, n, subs);
  for (int i = threadIdx.x; i < queries * n; i += blockDim.x) {
    const int qi = i / n, j = i % n;
    const float score = r.scratch[static_cast<size_t>(qi) * width + first + j];
    const float w = expf(score - max_of[qi]) * inv_sum_of[qi];
    weights[qi * kBlockTokens + j] = w;
    float* const scores = first + j < r.n_candidates ? decode::ScoresOfRow(r, qi / r.n_heads) : nullptr;
    if (scores) {  // the real row's always raw (real_probs_stats); the probabilities row's unless no stats
      const bool raw = scores != r.probs || r.probs_stats;
      scores[static_cast<size_t>(qi % r.n_heads) * r.n_candidates + first + j] = raw ? score : w;
    }
  }
  __syncthreads();
  const int lanes = blockDim.x / d, lane = threadIdx.x / d, c = threadIdx.x % d;
  const bool packed = v.value_bits != 16;
  const int G = v.group_size, bits = v.value_bits, per_word = 32 / bits, words = G * bits / 32;
  const uint32_t mask = packed ? (1u << bits) - 1u : 0u;
  const int g = c / G, word = (c % G) / per_word, shift = ((c % G) % per_word) * bits;
  float acc[Q];
#pragma unroll
  for (int qi = 0; qi < Q; ++qi) acc[qi] = 0.0f;
#pragma unroll 4
  for (int32_t j = lane; j < n; j += lanes) {
    const int32_t token = first + j;
    float value;
    if (packed && subs[j] < 0 && token < v.quantized_values) {
      value = static_cast<float>((ValueCodes(v, token)[g * words + word] >> shift) & mask) *
                  H2F(ValueScales(v, token)[g]) + H2F(ValueZeros(v, token)[g]);
    } else {
      value = ValueAt(v, r, token, subs[j], c);
    }
#pragma unroll
    for (int qi = 0; qi < Q; ++qi) if (qi < queries) acc[qi] += weights[qi * kBlockTokens + j] * value;
  }
  float* partial = Partials(it) + static_cast<size_t>(blockIdx.x) * queries * d;
  if (lanes == 1) {
#pragma unroll
    for (int qi = 0; qi < Q; ++qi) if (qi < queries) partial[qi * d + c] = acc[qi];
    return;
  }
  __syncthreads();  // the weights are read; their memory takes the lanes' sums ([lane][queries][d])
  float* sums = weights;
#pragma unroll
  for (int qi = 0; qi < Q; ++qi) if (qi < queries) sums[(lane * queries + qi) * d + c] = acc[qi];
  __syncthreads();
  for (int i = threadIdx.x; i < queries * d; i += blockDim.x) {
    float total = 0.0f;
    for (int l = 0; l < lanes; ++l) total += sums[l * queries * d + i];
    partial[i] = total;
  }
}

// Block (x, item): outputs [x * kThreads, +kThreads) = the partial sums in block order.
__global__ void ReduceKernel(const DeviceItemSet* set) {
  const DeviceDecodeItem& it = SetItems(set)[blockIdx.y];
  const int size = Queries(it) * it.replica.head_dim;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= size) return;
  const int blocks = Blocks(it);
  const float* partial = Partials(it);
  float acc = 0.0f;
  for (int b = 0; b < blocks; ++b) acc += partial[static_cast<size_t>(b) * size + i];
  it.rows.out[QueryAt(it.rows, i / it.replica.head_dim, it.replica.head_dim) + i % it.replica.head_dim] = acc;
}

// Block b handles (query token, head) pairs b, b + gridDim.x, ...: scores into its scratch row
// (a warp per key), softmax (block reduction), output (a thread per channel).
// KV head h: keys, values point at its [n][d] rows; q and out at every head's rows (AttendPrefill).
__global__ void PrefillKernel(const float* q, const __half* keys, const __half* values, int32_t n, int n_kv, int h,
                              int n_heads, int d, float scale, float* out, float* scratch) {
  __shared__ float reduce[32];
  float* s = scratch + static_cast<size_t>(blockIdx.x) * n;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  for (int64_t pair = blockIdx.x; pair < static_cast<int64_t>(n) * n_heads; pair += gridDim.x) {
    const int32_t i = static_cast<int32_t>(pair / n_heads);
    const size_t at = ((static_cast<size_t>(i) * n_kv + h) * n_heads + (pair - int64_t{i} * n_heads)) * d;
    const float* qi = q + at;
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
      out[at + c] = acc;
    }
    __syncthreads();
  }
}

}  // namespace

Status AttendPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_kv, int group, int head_dim,
                     float scale, float* out, float* scratch, void* stream) {
  if (n < 0 || n_kv <= 0 || group <= 0 || head_dim <= 0) return Status::InvalidArgument("bad prefill shape");
  if (n == 0) return Status::Ok();
  const auto launched = [](cudaError_t err) {
    return err == cudaSuccess ? Status::Ok() : Status::Unavailable(std::string("prefill kernel: ") + cudaGetErrorString(err));
  };
  if (TensorPrefillServes(q, keys, values, out, head_dim)) {  // the tensor cores (prefill_attention.h); `scratch` unused
    return launched(LaunchTensorPrefill(q, keys, values, n, n_kv, group, head_dim, scale, out,
                                        static_cast<cudaStream_t>(stream)));
  }
  // The CUDA-core kernel, a KV head at a time (they share the scratch).
  if (!scratch) return Status::InvalidArgument("prefill: the CUDA-core kernel needs PrefillScratchFloats of scratch");
  const int64_t pairs = static_cast<int64_t>(n) * group;
  const int blocks = static_cast<int>(pairs < 1024 ? pairs : 1024);
  for (int h = 0; h < n_kv; ++h) {
    const size_t rows_at = static_cast<size_t>(h) * n * head_dim;
    PrefillKernel<<<blocks, 128, 0, static_cast<cudaStream_t>(stream)>>>(
        q, reinterpret_cast<const __half*>(keys + rows_at), reinterpret_cast<const __half*>(values + rows_at), n, n_kv, h,
        group, head_dim, scale, out, scratch);
    SPECACHE_RETURN_IF_ERROR(launched(cudaGetLastError()));
  }
  return Status::Ok();
}


DecodePlan::DecodePlan(SlotReads reads) : impl_(new Impl) {
  impl_->in_place = reads == SlotReads::kInPlace;
  impl_->in_stream = reads == SlotReads::kStreamCopy;
}
DecodePlan::~DecodePlan() { delete impl_; }

namespace {

Status Validate(const DeviceDecodeItem& item) {
  const DeviceReplicaView& replica = item.replica;
  const DeviceDecodeRows& rows = item.rows;
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
  // The kernels read fp16 rows 16 bytes at a time (cuda_attention.h, DeviceDecodeRows).
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (!aligned(replica.residual_keys) || !aligned(replica.window_values) || !aligned(rows.new_keys) ||
      !aligned(rows.new_values) || !aligned(rows.sub_rows) || rows.kv_stride % 8 != 0) {
    return Status::InvalidArgument(
        "key and value rows (residual, window, new, substituted) must start 16-byte aligned, kv_stride a multiple "
        "of 8");
  }
  return Status::Ok();
}

// The CUDA-core path's kernels over the set at `device`.
Status LaunchCudaCoreSet(const std::vector<DeviceDecodeItem>& items, const DeviceItemSet* device, cudaStream_t s) {
  int32_t width = 0;
  int queries = 0, head_dim = 0;
  for (const DeviceDecodeItem& it : items) {
    width = std::max(width, it.replica.length + it.rows.n_rows);
    queries = std::max(queries, it.rows.n_rows * it.rows.n_heads);
    head_dim = std::max(head_dim, it.replica.head_dim);
  }
  const unsigned n = static_cast<unsigned>(items.size());
  const dim3 grid((width + kBlockTokens - 1) / kBlockTokens, n);
  const size_t q_bytes = static_cast<size_t>(queries) * head_dim * sizeof(float);
  // Threads over channels x token lanes; the weights' memory then holds the lanes' sums.
  const int value_threads = std::max(head_dim, kThreads / head_dim * head_dim);
  const size_t weight_bytes =
      std::max<size_t>(kBlockTokens, static_cast<size_t>(value_threads / head_dim) * head_dim) * queries * sizeof(float);
  // The smallest register bound that holds every item's queries.
  if (queries <= 8) {
    ScoresKernel<8><<<grid, kBlockTokens, q_bytes, s>>>(device);  // a thread per token
    ValuesKernel<8><<<grid, value_threads, weight_bytes, s>>>(device);
  } else if (queries <= 16) {
    ScoresKernel<16><<<grid, kBlockTokens, q_bytes, s>>>(device);
    ValuesKernel<16><<<grid, value_threads, weight_bytes, s>>>(device);
  } else {
    ScoresKernel<kMaxQueries><<<grid, kBlockTokens, q_bytes, s>>>(device);
    ValuesKernel<kMaxQueries><<<grid, value_threads, weight_bytes, s>>>(device);
  }
  ReduceKernel<<<dim3((queries * head_dim + kThreads - 1) / kThreads, n), kThreads, 0, s>>>(device);
  return LaunchStatus("decode attention kernels");
}

}  // namespace

Status AttendDecodeBatch(const DeviceDecodeItem* items, int n_items, void* stream, DecodePlan* plan) {
  if (n_items < 0) return Status::InvalidArgument("decode attention: negative item count");
  return AttendDecodeBatch(std::vector<DeviceDecodeItem>(items, items + n_items), stream, plan);
}

Status AttendDecodeBatch(std::vector<DeviceDecodeItem> items, void* stream, DecodePlan* plan) {
  if (plan == nullptr) return Status::InvalidArgument("decode attention: no plan");
  const int n_items = static_cast<int>(items.size());
  for (const DeviceDecodeItem& it : items) SPECACHE_RETURN_IF_ERROR(Validate(it));
  if (n_items == 0) return Status::Ok();
  auto* s = static_cast<cudaStream_t>(stream);
  // Strides resolved in place; the items the tensor-core path takes go there (all of them, the
  // usual call: moved, not copied), the others below.
  std::vector<DeviceDecodeItem> fast, rest;
  const bool lowbit = LowBitDecodeAvailable();
  bool all_fast = true;
  for (DeviceDecodeItem& it : items) {
    if (it.rows.q_stride == 0) it.rows.q_stride = int64_t{it.rows.n_heads} * it.replica.head_dim;
    if (it.rows.kv_stride == 0) it.rows.kv_stride = it.replica.head_dim;
    const bool eligible = LowBitDecodeEligible(it, lowbit);
    if (!eligible && it.replica.mma_codes) {  // the mma layout's groups: only the lean path reads them
      return Status::InvalidArgument("decode attention: a replica in the mma layout needs an item of at most " +
                                     std::to_string(kLeanMaxQueries) +
                                     " queries and its blocks interleaved by group (ReplicaBlockLayout::group_bytes)");
    }
    all_fast = all_fast && eligible;
  }
  if (all_fast) {
    fast = std::move(items);
  } else {
    for (const DeviceDecodeItem& it : items) (LowBitDecodeEligible(it, lowbit) ? fast : rest).push_back(it);
  }
  std::vector<LowBitSet> sets;
  if (!fast.empty()) {
    SPECACHE_RETURN_IF_ERROR(PlanLowBitDecode(std::move(fast), PlanArgsOf(*plan), &sets));
  }
  // One slot for every set of the call: the low-bit sets, then the CUDA-core set; one copy.
  std::vector<size_t> offsets;
  size_t bytes = 0;
  for (const LowBitSet& set : sets) offsets.push_back(bytes), bytes += ItemSetBytes(static_cast<int>(set.items.size()));
  const size_t rest_offset = bytes;
  if (!rest.empty()) bytes += ItemSetBytes(static_cast<int>(rest.size()));
  SPECACHE_ASSIGN_OR_RETURN(const DecodePlan::Impl::Upload up, plan->impl_->Begin(bytes, s));
  char* host = static_cast<char*>(up.host);
  const char* device = static_cast<const char*>(up.device);
  for (size_t i = 0; i < sets.size(); ++i) {
    const LowBitSet& set = sets[i];
    WriteItemSet(host + offsets[i], set.items,
                 ItemSetUnits{&set.unit_begin, &set.tail_begin, set.chunk_blocks, set.tail_units, set.tail_order,
                              set.codes_evict_first});
  }
  if (!rest.empty()) WriteItemSet(host + rest_offset, rest, ItemSetUnits{});
  SPECACHE_RETURN_IF_ERROR(plan->impl_->Send(up, bytes, s));
  const Status status = [&]() -> Status {
    for (size_t i = 0; i < sets.size(); ++i) {
      SPECACHE_RETURN_IF_ERROR(LaunchLowBitSet(sets[i], reinterpret_cast<const DeviceItemSet*>(device + offsets[i]), s));
    }
    if (rest.empty()) return Status::Ok();
    return LaunchCudaCoreSet(rest, reinterpret_cast<const DeviceItemSet*>(device + rest_offset), s);
  }();
  SPECACHE_RETURN_IF_ERROR(plan->impl_->Finish(up, s));  // also after a failed launch: the copy was queued
  return status;
}

Status AttendDecodeBatch(const DeviceDecodeItem* items, int n_items, void* stream) {
  return WithOwnPlan(static_cast<cudaStream_t>(stream), DecodePlan::SlotReads::kDeviceCopy,
                     [&](DecodePlan* own) { return AttendDecodeBatch(items, n_items, stream, own); });
}

Status AttendDecodeRows(const DeviceReplicaView& replica, const DeviceDecodeRows& rows, void* stream) {
  const DeviceDecodeItem item{replica, rows};
  return AttendDecodeBatch(&item, 1, stream);
}

}  // namespace specache::cuda
