// specache.ModelShape, KvConfig, StepKind, InMemorySource and Agent: the per-step agent API of
// specache/agent.h for Python, with tensors through DLPack (tensor_args.h).
#pragma once

#include <nanobind/nanobind.h>

namespace specache::python {

void BindAgent(nanobind::module_& m);

}  // namespace specache::python
