// Tensors handed to the agent through DLPack (NumPy arrays, PyTorch CPU and CUDA tensors, anything
// with __dlpack__): checked, never copied. The agent reads and writes the caller's memory in
// place, so a tensor that is not exactly what the agent needs is refused with INVALID_ARGUMENT
// naming the argument and what is wrong, instead of being converted behind the caller's back.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nanobind/ndarray.h>

#include "specache/status.h"

namespace specache::python {

// Where an agent computes: DLPack device type (1 = CPU, 2 = CUDA) and the device's index.
struct TensorDevice {
  int type = 1;
  int id = 0;
  std::string Describe() const;
};

// What an argument must be: float32, on `device`, C-contiguous (dimensions of extent 1 may have
// any stride), its last dimensions equal to `trailing` and its leading dimensions multiplying to
// `rows` (so [n, heads, head_dim] and [b, r, heads, head_dim] with b * r = n are both accepted).
// `rows` < 0 accepts any leading extent; then *rows_out (if given) receives it.
Result<float*> FloatTensor(const nanobind::ndarray<>& tensor, const char* name, const TensorDevice& device,
                           int64_t rows, const std::vector<int64_t>& trailing, int64_t* rows_out = nullptr);

// A one-dimensional int32 or int64 host array (NumPy, a CPU tensor) or a Python sequence of ints,
// copied into a vector (indices are small and read once).
Result<std::vector<int64_t>> IntegerList(nanobind::handle values, const char* name);

}  // namespace specache::python
