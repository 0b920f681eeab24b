// The small elementwise and per-row kernels a Llama decoder needs around cuBLAS on the GPU (the
// GPU model of specache-run and specache-bench step): random fill, fp32 <-> fp16, embedding rows,
// RMSNorm, the Q/K/V split with RoPE, SwiGLU and the argmax of logits rows; and a stream hold for
// timing.
// Device pointers; streams as void*. Launch errors surface at the stream's next synchronisation
// (callers check cudaGetLastError where they return a Status).
#pragma once

#include <cstdint>

#include "specache/half.h"

namespace specache::gpu {

// Uniform in [-scale, scale), from a hash of (index, seed): the same values for the same seed.
void Fill(Half* p, int64_t n, uint32_t seed, float scale, void* stream);
void Fill(float* p, int64_t n, uint32_t seed, float scale, void* stream);
// Token ids uniform in [0, vocab), from a hash of (index, seed).
void FillTokens(int32_t* p, int64_t n, uint32_t seed, int32_t vocab, void* stream);
// p[i] = value.
void Set(float* p, int64_t n, float value, void* stream);
void FloatToHalf(const float* in, Half* out, int64_t n, void* stream);
// out[r][c] = silu(gate_up[r][c]) * gate_up[r][ffn + c].
void SiluMul(const Half* gate_up, Half* out, int rows, int ffn, void* stream);
void SiluMul(const float* gate_up, Half* out, int rows, int ffn, void* stream);

// x[i][:] = table[tokens[i]][:] (fp16 table, float rows of width d). Token ids must be valid.
void EmbedRows(const Half* table, const int32_t* tokens, int n, int d, float* x, void* stream);
// out[i][:] = fp16(x[i][:] / rms(x[i]) * weight[:]), rms over d with eps (as LlamaModel::RmsNorm).
// When d % 4 == 0, x and weight must be 16-byte aligned and out 4-byte aligned (float4 reads).
void RmsNormToHalf(const float* x, int n, int d, const float* weight, float eps, Half* out, void* stream);
// From qkv[n][(n_heads + 2 n_kv) hd]: q[n][n_heads][hd] and k[n][n_kv][hd] rotated by RoPE at
// positions[i] (adjacent pairs, angle = position * inv_freq[pair], computed in double as the CPU
// model does), v[n][n_kv][hd] copied.
void SplitQkvRope(const float* qkv, int n, int n_heads, int n_kv, int hd, const int32_t* positions,
                  const float* inv_freq, float* q, float* k, float* v, void* stream);
// out[i] = the index of the largest of logits[i][0..vocab) (the lowest index among equals).
void ArgmaxRows(const float* logits, int n, int vocab, int32_t* out, void* stream);
// Keeps the stream busy for about `microseconds` (one thread spinning on the device clock), so
// that work queued behind it meanwhile is timed without the host's launch gaps (benchmarks).
void Hold(int microseconds, void* stream);
// Holds `blocks` SM slots of 256 threads each for about `microseconds`, as the CUDA agent's row
// fetch does beside the model's kernels (benchmarks).
void HoldSlots(int microseconds, int blocks, void* stream);

}  // namespace specache::gpu
