// The tensor-core path of AttendPrefill (cuda_attention.h): exact causal attention over a prompt
// for every KV head, flash-attention style (prefill_attention.cu). AttendPrefill takes it where it
// serves and keeps its CUDA-core kernel for the rest.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "specache/half.h"

namespace specache::cuda {

// Whether the tensor-core path serves these tensors on the current device: head_dim 64 or 128,
// sm_80+, keys and values 16-byte aligned, q and out 8-byte aligned (its vector loads and stores).
bool TensorPrefillServes(const float* q, const Half* keys, const Half* values, const float* out, int head_dim);

// AttendPrefill's tensors and semantics (cuda_attention.h), n_heads query heads per KV head;
// queued on `stream`, no scratch.
cudaError_t LaunchTensorPrefill(const float* q, const Half* keys, const Half* values, int32_t n, int n_kv, int n_heads,
                                int head_dim, float scale, float* out, cudaStream_t stream);

}  // namespace specache::cuda
