// Errors of the bindings: a non-OK specache::Status becomes a Python specache.StatusError carrying
// the Status code (a specache.StatusCode) and the message, so Python code can branch on the same
// codes a C++ caller sees. The exception is only thrown inside the bindings and translated at
// the nanobind boundary; no C++ exception leaves the module.
#pragma once

#include <nanobind/nanobind.h>

#include "specache/status.h"

namespace specache::python {

// Thrown by the bindings for a non-OK Status; translated to specache.StatusError.
class StatusException {
 public:
  explicit StatusException(Status status) : status_(std::move(status)) {}
  const Status& status() const { return status_; }

 private:
  Status status_;
};

// Raises (as StatusException) unless the status is OK.
inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusException(status);
}

// The value, or raises the error.
template <typename T>
T ValueOrThrow(Result<T> result) {
  if (!result.ok()) throw StatusException(result.status());
  return std::move(result).value();
}

// Registers the translation to specache._status.StatusError (imported from the package).
void RegisterStatusError(nanobind::module_& m);

}  // namespace specache::python
