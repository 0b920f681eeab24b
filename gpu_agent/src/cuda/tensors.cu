#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "specache/cuda_tensors.h"
#include "decode_plan_slots.h"
#include "row_copy.cuh"

namespace specache::cuda {
namespace {

// Tensor blockIdx.y: (src, dst), or (src2, dst2) for y = 1.
__global__ void FloatRowsToHalfKernel(const float* src, int64_t total, int d, int64_t stride, __half* dst,
                                      const float* src2, __half* dst2) {
  if (blockIdx.y == 1) src = src2, dst = dst2;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / d;
    dst[i] = __float2half_rn(src[row * stride + (i - row * d)]);
  }
}

__global__ void InterleaveKernel(const __half* k, const __half* v, int64_t total, int d, __half* rows) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / (2 * d);
    const int c = static_cast<int>(i - row * 2 * d);
    rows[i] = c < d ? k[row * d + c] : v[row * d + c - d];
  }
}

// One thread per 16-byte piece.
__global__ void CopyRowsKernel(const RowCopy* __restrict__ copies, int count, int pieces_per_row) {
  CopyRowPieces(copies, count, pieces_per_row, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                static_cast<int64_t>(gridDim.x) * blockDim.x);
}

}  // namespace

Status FloatRowsToHalf(const float* src, int32_t n, int d, int64_t src_stride, Half* dst, void* stream) {
  const int64_t total = static_cast<int64_t>(n) * d;
  if (total <= 0) return Status::Ok();
  FloatRowsToHalfKernel<<<GridStrideBlocks(total), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      src, total, d, src_stride, reinterpret_cast<__half*>(dst), nullptr, nullptr);
  return LaunchStatus("float to fp16 kernel");
}

Status FloatKeyValueRowsToHalf(const float* k, const float* v, int32_t n, int d, int64_t src_stride, Half* k_dst,
                               Half* v_dst, void* stream) {
  const int64_t total = static_cast<int64_t>(n) * d;
  if (total <= 0) return Status::Ok();
  FloatRowsToHalfKernel<<<dim3(GridStrideBlocks(total), 2), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      k, total, d, src_stride, reinterpret_cast<__half*>(k_dst), v, reinterpret_cast<__half*>(v_dst));
  return LaunchStatus("float to fp16 kernel");
}

Status InterleaveKv(const Half* k, const Half* v, int32_t n, int d, Half* rows, void* stream) {
  const int64_t total = static_cast<int64_t>(n) * 2 * d;
  if (total <= 0) return Status::Ok();
  InterleaveKernel<<<GridStrideBlocks(total), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const __half*>(k), reinterpret_cast<const __half*>(v), total, d, reinterpret_cast<__half*>(rows));
  return LaunchStatus("K/V interleave kernel");
}

Status CopyRows(const RowCopy* copies, int n, int row_bytes, void* stream, DecodePlan* plan) {
  if (row_bytes <= 0 || row_bytes % 16 != 0) return Status::InvalidArgument("row_bytes must be a positive multiple of 16");
  if (n < 0) return Status::InvalidArgument("negative row copy count");
  if (n == 0) return Status::Ok();
  const int64_t pieces = int64_t{n} * (row_bytes / 16);
  auto* s = static_cast<cudaStream_t>(stream);
  return WithDeviceTasks(plan, copies, n, s, "row copy kernel", [&](const RowCopy* on_device) {
    CopyRowsKernel<<<GridStrideBlocks(pieces), 256, 0, s>>>(on_device, n, row_bytes / 16);
  });
}

}  // namespace specache::cuda
