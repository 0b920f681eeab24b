#include "step_kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace specache::bench {
namespace {

__device__ float Uniform(uint64_t i, uint32_t seed) {  // splitmix-style hash to [-1, 1)
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}

__global__ void FillHalfKernel(__half* out, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2half_rn(scale * Uniform(static_cast<uint64_t>(i), seed));
  }
}
__global__ void FillFloatKernel(float* out, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = scale * Uniform(static_cast<uint64_t>(i), seed);
  }
}
__global__ void ToHalfKernel(const float* in, __half* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = __float2half_rn(in[i]);
  }
}
__global__ void SiluMulKernel(const __half* gate_up, __half* out, int rows, int ffn) {
  const int64_t n = int64_t{rows} * ffn;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / ffn, c = i % ffn;
    const float g = __half2float(gate_up[r * 2 * ffn + c]), u = __half2float(gate_up[r * 2 * ffn + ffn + c]);
    out[i] = __float2half_rn(g / (1.0f + __expf(-g)) * u);
  }
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

}  // namespace

void Fill(Half* p, int64_t n, uint32_t seed, float scale, void* stream) {
  FillHalfKernel<<<1024, 256, 0, S(stream)>>>(reinterpret_cast<__half*>(p), n, seed, scale);
}
void Fill(float* p, int64_t n, uint32_t seed, float scale, void* stream) {
  FillFloatKernel<<<1024, 256, 0, S(stream)>>>(p, n, seed, scale);
}
void FloatToHalf(const float* in, Half* out, int64_t n, void* stream) {
  ToHalfKernel<<<1024, 256, 0, S(stream)>>>(in, reinterpret_cast<__half*>(out), n);
}
void SiluMul(const Half* gate_up, Half* out, int rows, int ffn, void* stream) {
  SiluMulKernel<<<1024, 256, 0, S(stream)>>>(reinterpret_cast<const __half*>(gate_up), reinterpret_cast<__half*>(out),
                                              rows, ffn);
}

void Hold(int microseconds, void* stream) { HoldKernel<<<1, 1, 0, S(stream)>>>(uint64_t(microseconds) * 1000); }

}  // namespace specache::bench
