// specache.Client, Session, DaemonSource and EmbeddedDaemon: libspecache_client for Python, and a
// specached run inside this process (the same daemon code, on its own temporary socket). Only in
// builds with the service half (gRPC and the other Debian packages); module.cc says which.
#pragma once

#include <nanobind/nanobind.h>

namespace specache::python {

// Returns false (binding nothing) in a build without the service half.
bool BindService(nanobind::module_& m);

}  // namespace specache::python
