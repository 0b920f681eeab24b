// The few elementwise kernels specache-bench step needs around cuBLAS (random fill, fp32 -> fp16,
// SwiGLU) and a stream hold for timing. Device pointers; streams as void*.
#pragma once

#include <cstdint>

#include "specache/half.h"

namespace specache::bench {

// Uniform in [-scale, scale), from a hash of (index, seed): the same values for the same seed.
void Fill(Half* p, int64_t n, uint32_t seed, float scale, void* stream);
void Fill(float* p, int64_t n, uint32_t seed, float scale, void* stream);
void FloatToHalf(const float* in, Half* out, int64_t n, void* stream);
// out[r][c] = silu(gate_up[r][c]) * gate_up[r][ffn + c].
void SiluMul(const Half* gate_up, Half* out, int rows, int ffn, void* stream);
// Keeps the stream busy for about `microseconds` (one thread spinning on the device clock), so
// that work queued behind it meanwhile is timed without the host's launch gaps.
void Hold(int microseconds, void* stream);

}  // namespace specache::bench
