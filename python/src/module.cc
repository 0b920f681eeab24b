// specache._core: the extension module behind the `specache` Python package (python/specache).
#include <nanobind/nanobind.h>

#include "agent_binding.h"
#include "service_binding.h"
#include "specache/status.h"
#include "specache/version.h"
#include "status_error.h"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  m.doc() = "specache's agent and client library (C++), for the specache package";
  specache::python::RegisterStatusError(m);
  specache::python::BindAgent(m);
  m.attr("has_service") = specache::python::BindService(m);
#ifdef SPECACHE_PY_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.attr("__version__") = SPECACHE_VERSION;
}
