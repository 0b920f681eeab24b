// A kernel's per-block task, read once. For the batched kernels whose task lists reach them
// through a DecodePlan slot (decode_plan_slots.h), often read in place from pinned host memory
// (DecodePlan::SlotReads::kInPlace): one read a block, not one per thread and field.
#pragma once

namespace specache::cuda {

// Block `task`'s task, copied once into shared memory by thread 0; every thread of the block must
// call it (it synchronises the block). One call per kernel and task type (one static copy).
template <typename T>
__device__ const T& TaskOfBlock(const T* tasks, unsigned task) {
  __shared__ T mine;
  if (threadIdx.x == 0) mine = tasks[task];
  __syncthreads();
  return mine;
}

}  // namespace specache::cuda
