// Tensor-core pieces shared by the attention kernels (lowbit_decode.cu, prefill_attention.cu):
// mma.m16n8k16 with fp16 operands and fp32 accumulators, and fp16x2 operand packing.
//
// Register layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major): a0 = (row g, cols 2t, 2t+1), a1 = (row g+8, same cols),
//                           a2 = (row g, cols 2t+8, 2t+9), a3 = (row g+8, same cols)
//   B (16 x 8):             b0 = (rows 2t, 2t+1, col g), b1 = (rows 2t+8, 2t+9, col g)
//   C (16 x 8, fp32):       c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, same cols)
// The lower 16 bits of a register hold the element of the lower index. The tensor cores
// accumulate with truncation: long chains of mma into one C lose bits, so callers add fresh
// accumulators in fp32 where it matters.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace specache::cuda::mma {

__device__ __forceinline__ uint32_t AsU32(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// x0, x1 as fp16x2 hi + lo parts (the lo part the rounded rest): ~22 bits of mantissa.
__device__ __forceinline__ void Split(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 f = __half22float2(h);
  hi = AsU32(h);
  lo = AsU32(__floats2half2_rn(x0 - f.x, x1 - f.y));
}

// c += A x B. Traps below sm_80: the hosts route only sm_80+ devices to these kernels.
__device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Four 8 x 8 fp16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8 (16 bytes, 16-byte aligned); r[i] gets matrix i's (row g, cols 2t, 2t+1), as in A or C,
// or with kTransposed its (rows 2t, 2t+1, col g), as in B when the matrix's rows run along B's k.
template <bool kTransposed = false>
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (kTransposed) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  }
#else
  __trap();
#endif
}

// The transpose of an 8 x 8 fp16 matrix held one row pair per lane (lane l: row l / 4, cols
// 2 (l % 4), +1, as A's or C's registers): lane l gets (rows 2 (l % 4), +1 of col l / 4), as in A
// when the matrix's rows run along A's k (e.g. rows of values that A must hold transposed).
__device__ __forceinline__ uint32_t Transposed8x8(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
#else
  __trap();
  return 0;
#endif
}

}  // namespace specache::cuda::mma
