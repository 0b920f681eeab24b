// The fetch path of the CUDA backend: full-precision rows gathered by the GPU's SMs straight from
// registered host memory (the daemon's pages) into device memory. Copy-engine APIs are 50-500x
// slower for rows this small (docs/performance.md); a zero-copy kernel reaches the link.
//
// Plain C++ header (no CUDA types): streams are passed as void* (a cudaStream_t). Without CUDA in
// the build, or without a device, every call returns UNAVAILABLE.
#pragma once

#include <cstddef>
#include <cstdint>

#include "specache/status.h"

namespace specache::cuda {

// Pins and maps host memory for the GPU (cudaHostRegister, mapped); returns the address the GPU
// uses for `host` (the same on unified-addressing systems, but ask). Counted per `host`: each
// Register needs one Unregister, and the last one unpins.
Result<uint64_t> RegisterHostMemory(void* host, size_t bytes);
Status UnregisterHostMemory(void* host);

// dst[i] = row at src_addresses[i] (GPU-visible addresses of registered host memory) for i < n_rows,
// rows of row_bytes (a multiple of 16; rows 16-byte aligned), dst in device memory, packed.
// Consecutive threads copy consecutive 16-byte pieces (a 512-byte row is one warp's load).
// Sorting the addresses makes the host reads sequential within each (sequence, layer, head) run.
// At most max_blocks blocks of 256 threads, so the gather leaves SMs to the layers it overlaps.
// With `device_dst_rows` (may be null), source i goes to destination row device_dst_rows[i]: the
// sources can then be sorted by address across the whole batch (fewer GPU/IOMMU translation
// misses over a large host span) while the destination keeps the agent's order.
Status LaunchGatherRows(const uint64_t* device_src_addresses, void* device_dst, int64_t n_rows, int row_bytes,
                        int max_blocks, void* stream, const uint32_t* device_dst_rows = nullptr);

}  // namespace specache::cuda
