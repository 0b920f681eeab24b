// Small device tensor conversions the CUDA agent needs between the engine's float32 tensors and the
// cache's fp16 rows. Device pointers; streams as void*.
#pragma once

#include <cstdint>

#include "specache/half.h"
#include "specache/status.h"

namespace specache::cuda {

class DecodePlan;  // cuda_attention.h

// dst[i][c] = fp16(src[i * src_stride + c]) (round to nearest even, as FloatToHalf) for i < n, c < d.
Status FloatRowsToHalf(const float* src, int32_t n, int d, int64_t src_stride, Half* dst, void* stream);
// FloatRowsToHalf of a layer's new keys and values in one launch: k_dst from k, v_dst from v, each
// n rows of d at src_stride (a decode step's launch fewer: its host, not its GPU, sets its pace).
Status FloatKeyValueRowsToHalf(const float* k, const float* v, int32_t n, int d, int64_t src_stride, Half* k_dst,
                               Half* v_dst, void* stream);
// Copies of many small rows (device to device) in one launch: dst[i] = src[i], row_bytes each (a
// multiple of 16, 16-byte aligned). The copies reach the kernel through a slot of `plan`
// (cuda_attention.h; null: a plan of the call's own, which waits for the kernel).
struct RowCopy {
  const void* src = nullptr;
  void* dst = nullptr;
};
Status CopyRows(const RowCopy* copies, int n, int row_bytes, void* stream, DecodePlan* plan = nullptr);

// rows[i] = [k[i] | v[i]] ([n][2][d]), the layout of a full-precision source row.
Status InterleaveKv(const Half* k, const Half* v, int32_t n, int d, Half* rows, void* stream);

}  // namespace specache::cuda
