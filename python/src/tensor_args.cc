#include "tensor_args.h"

#include <cstdint>

namespace nb = nanobind;

namespace specache::python {
namespace {

std::string DeviceName(int type, int id) {
  switch (type) {
    case 1:
      return "cpu";
    case 2:
      return "cuda:" + std::to_string(id);
    case 3:
      return "cuda_host";
    case 13:
      return "cuda_managed";
    default:
      return "dlpack device type " + std::to_string(type);
  }
}

std::string ShapeOf(const nb::ndarray<>& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.ndim(); ++i) s += (i ? ", " : "") + std::to_string(t.shape(i));
  return s + "]";
}

}  // namespace

std::string TensorDevice::Describe() const { return DeviceName(type, id); }

Result<float*> FloatTensor(const nb::ndarray<>& t, const char* name, const TensorDevice& device, int64_t rows,
                           const std::vector<int64_t>& trailing, int64_t* rows_out) {
  const std::string what = std::string(name) + ": ";
  const nb::dlpack::dtype dt = t.dtype();
  if (dt.code != static_cast<uint8_t>(nb::dlpack::dtype_code::Float) || dt.bits != 32 || dt.lanes != 1) {
    return Status::InvalidArgument(what + "dtype must be float32 (dlpack code " + std::to_string(dt.code) + ", " +
                                   std::to_string(dt.bits) + " bits given)");
  }
  if (t.device_type() != device.type || (device.type != 1 && t.device_id() != device.id)) {
    return Status::InvalidArgument(what + "tensor on " + DeviceName(t.device_type(), t.device_id()) +
                                   ", the agent computes on " + device.Describe());
  }
  const size_t nd = t.ndim();
  if (nd < trailing.size() + 1) {
    return Status::InvalidArgument(what + "shape " + ShapeOf(t) + " needs at least " +
                                   std::to_string(trailing.size() + 1) + " dimensions");
  }
  for (size_t i = 0; i < trailing.size(); ++i) {
    const size_t dim = nd - trailing.size() + i;
    if (static_cast<int64_t>(t.shape(dim)) != trailing[i]) {
      std::string want = "[..., ";
      for (size_t j = 0; j < trailing.size(); ++j) want += (j ? ", " : "") + std::to_string(trailing[j]);
      return Status::InvalidArgument(what + "shape " + ShapeOf(t) + " does not end in " + want + "]");
    }
  }
  int64_t leading = 1;
  for (size_t i = 0; i + trailing.size() < nd; ++i) leading *= static_cast<int64_t>(t.shape(i));
  if (rows >= 0 && leading != rows) {
    return Status::InvalidArgument(what + "shape " + ShapeOf(t) + " has " + std::to_string(leading) +
                                   " rows, the call needs " + std::to_string(rows));
  }
  // C order, in elements; a dimension of extent 1 never moves the pointer, so its stride is free.
  int64_t expected = 1;
  for (size_t i = nd; i-- > 0;) {
    if (t.shape(i) != 1 && t.stride(i) != expected) {
      return Status::InvalidArgument(what + "not C-contiguous (stride " + std::to_string(t.stride(i)) +
                                     " of dimension " + std::to_string(i) + ", expected " + std::to_string(expected) +
                                     "): pass a contiguous tensor, e.g. .contiguous()");
    }
    expected *= static_cast<int64_t>(t.shape(i));
  }
  if (reinterpret_cast<uintptr_t>(t.data()) % alignof(float) != 0) {
    return Status::InvalidArgument(what + "data is not 4-byte aligned");
  }
  if (rows_out) *rows_out = leading;
  return static_cast<float*>(t.data());
}

Result<std::vector<int64_t>> IntegerList(nb::handle values, const char* name) {
  std::vector<int64_t> out;
  nb::ndarray<> array;
  if (nb::try_cast(values, array, /*convert=*/false)) {
    if (array.device_type() != 1) {
      return Status::InvalidArgument(std::string(name) + ": must be in host memory (" +
                                     DeviceName(array.device_type(), array.device_id()) + " given)");
    }
    const nb::dlpack::dtype dt = array.dtype();
    const bool is_int = dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) ||
                        dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt);
    if (array.ndim() != 1 || !is_int || (dt.bits != 32 && dt.bits != 64) || dt.lanes != 1) {
      return Status::InvalidArgument(std::string(name) + ": a one-dimensional int32 or int64 array is needed");
    }
    const bool is_unsigned = dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt);
    const auto* base = static_cast<const uint8_t*>(array.data());
    for (size_t i = 0; i < array.shape(0); ++i) {
      const uint8_t* e = base + static_cast<int64_t>(i) * array.stride(0) * (dt.bits / 8);
      if (dt.bits == 32) {  // uint32 zero-extended, int32 sign-extended
        out.push_back(is_unsigned ? int64_t{*reinterpret_cast<const uint32_t*>(e)} : *reinterpret_cast<const int32_t*>(e));
      } else if (is_unsigned && *reinterpret_cast<const uint64_t*>(e) > uint64_t{INT64_MAX}) {
        return Status::InvalidArgument(std::string(name) + ": element out of the int64 range");
      } else {
        out.push_back(*reinterpret_cast<const int64_t*>(e));
      }
    }
    return out;
  }
  if (!nb::isinstance<nb::sequence>(values) || nb::isinstance<nb::str>(values)) {
    return Status::InvalidArgument(std::string(name) + ": a sequence of ints or an integer array is needed");
  }
  for (nb::handle v : values) {
    // An int or an integer scalar (numpy's, through __index__); not a bool, not a float.
    if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) {
      return Status::InvalidArgument(std::string(name) + ": every element must be an int");
    }
    PyObject* index = PyNumber_Index(v.ptr());
    if (index == nullptr) {
      PyErr_Clear();
      return Status::InvalidArgument(std::string(name) + ": every element must be an int");
    }
    const long long x = PyLong_AsLongLong(index);
    Py_DECREF(index);
    if (x == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return Status::InvalidArgument(std::string(name) + ": element out of the int64 range");
    }
    out.push_back(x);
  }
  return out;
}

}  // namespace specache::python
