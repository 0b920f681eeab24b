#include "llama_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>

namespace specache::gpu {
namespace {

constexpr int kThreads = 256;

__device__ float Uniform(uint64_t i, uint32_t seed) {  // splitmix-style hash to [-1, 1)
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); i += int64_t{gridDim.x} * blockDim.x)

__global__ void FillHalfKernel(__half* out, int64_t n, uint32_t seed, float scale) {
  GRID_STRIDE(i, n) out[i] = __float2half_rn(scale * Uniform(static_cast<uint64_t>(i), seed));
}
__global__ void FillFloatKernel(float* out, int64_t n, uint32_t seed, float scale) {
  GRID_STRIDE(i, n) out[i] = scale * Uniform(static_cast<uint64_t>(i), seed);
}
__global__ void FillTokensKernel(int32_t* out, int64_t n, uint32_t seed, int32_t vocab) {
  GRID_STRIDE(i, n) {
    const float u = 0.5f * (Uniform(static_cast<uint64_t>(i), seed) + 1.0f);  // [0, 1)
    out[i] = min(static_cast<int32_t>(u * vocab), vocab - 1);
  }
}
__global__ void SetKernel(float* out, int64_t n, float value) {
  GRID_STRIDE(i, n) out[i] = value;
}
__global__ void ToHalfKernel(const float* in, __half* out, int64_t n) {
  GRID_STRIDE(i, n) out[i] = __float2half_rn(in[i]);
}
template <typename T>
__device__ float ToFloat(T v);
template <>
__device__ float ToFloat<__half>(__half v) { return __half2float(v); }
template <>
__device__ float ToFloat<float>(float v) { return v; }

// One output of SiluMul: silu(g) * u, rounded to fp16 (both kernels below, so they give the same bits).
__device__ __forceinline__ __half SiluTimes(float g, float u) { return __float2half_rn(g / (1.0f + expf(-g)) * u); }

// Block (x, y) takes columns [x * blockDim, ...) of rows y, y + gridDim.y, ...: no index division.
template <typename T>
__global__ void SiluMulKernel(const T* gate_up, __half* out, int rows, int ffn) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= ffn) return;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = gate_up + int64_t{r} * 2 * ffn;
    const float g = ToFloat(row[c]), u = ToFloat(row[ffn + c]);
    out[int64_t{r} * ffn + c] = SiluTimes(g, u);
  }
}

// Four consecutive values as floats, from one 16-byte (float) or 8-byte (half) load.
__device__ void Load4(const float* p, float (&v)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ void Load4(const __half* p, float (&v)[4]) {
  const uint2 x = *reinterpret_cast<const uint2*>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&x.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&x.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

// SiluMulKernel four columns a thread (ffn4 = ffn / 4; rows and out 16- and 8-byte aligned):
// each element through SiluTimes, as there, so the outputs are the same bits.
template <typename T>
__global__ void SiluMul4Kernel(const T* gate_up, __half* out, int rows, int ffn4) {
  const int c4 = blockIdx.x * blockDim.x + threadIdx.x;
  if (c4 >= ffn4) return;
  const int64_t ffn = int64_t{ffn4} * 4;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = gate_up + int64_t{r} * 2 * ffn;
    float g[4], u[4];
    Load4(row + int64_t{c4} * 4, g);
    Load4(row + ffn + int64_t{c4} * 4, u);
    __align__(8) __half2 h[2];  // stored as one uint2
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      h[j] = __halves2half2(SiluTimes(g[2 * j], u[2 * j]), SiluTimes(g[2 * j + 1], u[2 * j + 1]));
    }
    *reinterpret_cast<uint2*>(out + int64_t{r} * ffn + int64_t{c4} * 4) = *reinterpret_cast<const uint2*>(h);
  }
}

__global__ void EmbedKernel(const __half* table, const int32_t* tokens, int n, int d, float* x) {
  const int64_t total = int64_t{n} * d;
  GRID_STRIDE(i, total) {
    const int64_t row = i / d, c = i % d;
    x[i] = __half2float(table[int64_t{tokens[row]} * d + c]);
  }
}

// Sum of `v` over the block (kThreads threads); every thread gets it.
__device__ float BlockSum(float v, float* shared) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += shared[w];
  __syncthreads();
  return total;
}

// One block per row. Rows of a width divisible by 4 are read as float4 (16-byte aligned: the row
// starts at a multiple of 16 bytes), four values per load.
__global__ void RmsNormKernel(const float* x, int d, const float* weight, float eps, __half* out) {
  __shared__ float shared[kThreads / 32];
  const float* row = x + int64_t{blockIdx.x} * d;
  __half* o = out + int64_t{blockIdx.x} * d;
  float ss = 0;
  if (d % 4 == 0) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (int c = threadIdx.x; c < d / 4; c += kThreads) {
      const float4 v = row4[c];
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int c = threadIdx.x; c < d; c += kThreads) ss += row[c] * row[c];
  }
  ss = BlockSum(ss, shared);
  const float inv = rsqrtf(ss / d + eps);
  if (d % 4 == 0) {
    const float4* row4 = reinterpret_cast<const float4*>(row);
    const float4* w4 = reinterpret_cast<const float4*>(weight);
    __half2* o2 = reinterpret_cast<__half2*>(o);
    for (int c = threadIdx.x; c < d / 4; c += kThreads) {
      const float4 v = row4[c], w = w4[c];
      o2[2 * c] = __floats2half2_rn(v.x * inv * w.x, v.y * inv * w.y);
      o2[2 * c + 1] = __floats2half2_rn(v.z * inv * w.z, v.w * inv * w.w);
    }
  } else {
    for (int c = threadIdx.x; c < d; c += kThreads) o[c] = __float2half_rn(row[c] * inv * weight[c]);
  }
}

// One thread per (row, head, pair) of q and k; v rows copied by the same threads.
__global__ void SplitQkvRopeKernel(const float* qkv, int n, int n_heads, int n_kv, int hd, const int32_t* positions,
                                   const float* inv_freq, float* q, float* k, float* v) {
  const int pairs = hd / 2, heads = n_heads + 2 * n_kv, width = heads * hd;
  const int64_t total = int64_t{n} * heads * pairs;
  GRID_STRIDE(i, total) {
    const int64_t row = i / (int64_t{heads} * pairs);
    const int head = static_cast<int>(i / pairs % heads), p = static_cast<int>(i % pairs);
    const float* src = qkv + row * width + int64_t{head} * hd + 2 * p;
    float a = src[0], b = src[1];
    float* dst;
    if (head < n_heads + n_kv) {
      const double angle = double{inv_freq[p]} * positions[row];
      const float cs = static_cast<float>(cos(angle)), sn = static_cast<float>(sin(angle));
      const float ra = a * cs - b * sn, rb = a * sn + b * cs;
      a = ra;
      b = rb;
      dst = head < n_heads ? q + (row * n_heads + head) * hd : k + (row * n_kv + head - n_heads) * hd;
    } else {
      dst = v + (row * n_kv + head - n_heads - n_kv) * hd;
    }
    dst[2 * p] = a;
    dst[2 * p + 1] = b;
  }
}

__global__ void ArgmaxKernel(const float* logits, int vocab, int32_t* out) {
  __shared__ float best_v[kThreads];
  __shared__ int32_t best_i[kThreads];
  const float* row = logits + int64_t{blockIdx.x} * vocab;
  float bv = -FLT_MAX;
  int32_t bi = vocab;
  for (int c = threadIdx.x; c < vocab; c += kThreads) {
    const float x = row[c];
    if (x > bv) {  // strided ascending: the first maximum of this thread's columns
      bv = x;
      bi = c;
    }
  }
  best_v[threadIdx.x] = bv;
  best_i[threadIdx.x] = bi;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      const float ov = best_v[threadIdx.x + s];
      const int32_t oi = best_i[threadIdx.x + s];
      if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
        best_v[threadIdx.x] = ov;
        best_i[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = best_i[0] < vocab ? best_i[0] : 0;
}

__global__ void HoldKernel(uint64_t nanoseconds) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }
int Blocks(int64_t n) { return static_cast<int>(n / kThreads + 1 < 4096 ? n / kThreads + 1 : 4096); }
// Columns across x, rows across y (at most 65535 blocks: SiluMulKernel strides over the rest).
dim3 SiluGrid(int rows, int ffn) { return dim3((ffn + kThreads - 1) / kThreads, rows < 65535 ? rows : 65535); }
// SiluMul4Kernel's loads and stores are whole vectors: ffn a multiple of 4 and 16-byte aligned tensors.
bool SiluMulByFours(const void* gate_up, const void* out, int ffn) {
  return ffn % 4 == 0 && reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
}
template <typename T>
void LaunchSiluMul(const T* gate_up, __half* out, int rows, int ffn, cudaStream_t stream) {
  if (rows <= 0 || ffn <= 0) return;
  if (SiluMulByFours(gate_up, out, ffn)) {
    SiluMul4Kernel<<<SiluGrid(rows, ffn / 4), kThreads, 0, stream>>>(gate_up, out, rows, ffn / 4);
  } else {
    SiluMulKernel<<<SiluGrid(rows, ffn), kThreads, 0, stream>>>(gate_up, out, rows, ffn);
  }
}

}  // namespace

void Fill(Half* p, int64_t n, uint32_t seed, float scale, void* stream) {
  FillHalfKernel<<<Blocks(n), kThreads, 0, S(stream)>>>(reinterpret_cast<__half*>(p), n, seed, scale);
}
void Fill(float* p, int64_t n, uint32_t seed, float scale, void* stream) {
  FillFloatKernel<<<Blocks(n), kThreads, 0, S(stream)>>>(p, n, seed, scale);
}
void FillTokens(int32_t* p, int64_t n, uint32_t seed, int32_t vocab, void* stream) {
  FillTokensKernel<<<Blocks(n), kThreads, 0, S(stream)>>>(p, n, seed, vocab);
}
void Set(float* p, int64_t n, float value, void* stream) { SetKernel<<<Blocks(n), kThreads, 0, S(stream)>>>(p, n, value); }
void FloatToHalf(const float* in, Half* out, int64_t n, void* stream) {
  ToHalfKernel<<<Blocks(n), kThreads, 0, S(stream)>>>(in, reinterpret_cast<__half*>(out), n);
}
void SiluMul(const Half* gate_up, Half* out, int rows, int ffn, void* stream) {
  LaunchSiluMul(reinterpret_cast<const __half*>(gate_up), reinterpret_cast<__half*>(out), rows, ffn, S(stream));
}
void SiluMul(const float* gate_up, Half* out, int rows, int ffn, void* stream) {
  LaunchSiluMul(gate_up, reinterpret_cast<__half*>(out), rows, ffn, S(stream));
}
void EmbedRows(const Half* table, const int32_t* tokens, int n, int d, float* x, void* stream) {
  EmbedKernel<<<Blocks(int64_t{n} * d), kThreads, 0, S(stream)>>>(reinterpret_cast<const __half*>(table), tokens, n, d,
                                                                  x);
}
void RmsNormToHalf(const float* x, int n, int d, const float* weight, float eps, Half* out, void* stream) {
  if (n > 0) RmsNormKernel<<<n, kThreads, 0, S(stream)>>>(x, d, weight, eps, reinterpret_cast<__half*>(out));
}
void SplitQkvRope(const float* qkv, int n, int n_heads, int n_kv, int hd, const int32_t* positions,
                  const float* inv_freq, float* q, float* k, float* v, void* stream) {
  const int64_t total = int64_t{n} * (n_heads + 2 * n_kv) * (hd / 2);
  SplitQkvRopeKernel<<<Blocks(total), kThreads, 0, S(stream)>>>(qkv, n, n_heads, n_kv, hd, positions, inv_freq, q, k,
                                                                v);
}
void ArgmaxRows(const float* logits, int n, int vocab, int32_t* out, void* stream) {
  if (n > 0) ArgmaxKernel<<<n, kThreads, 0, S(stream)>>>(logits, vocab, out);
}
void Hold(int microseconds, void* stream) { HoldKernel<<<1, 1, 0, S(stream)>>>(uint64_t(microseconds) * 1000); }
void HoldSlots(int microseconds, int blocks, void* stream) {
  HoldKernel<<<blocks, kThreads, 0, S(stream)>>>(uint64_t(microseconds) * 1000);
}

}  // namespace specache::gpu
