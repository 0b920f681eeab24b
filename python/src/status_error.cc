#include "status_error.h"

#include <nanobind/stl/string.h>

namespace nb = nanobind;

namespace specache::python {

void RegisterStatusError(nb::module_& m) {
  // The exception class lives in Python (specache/_status.py) so it is an ordinary class users
  // can subclass-check and pickle; held for the process's life (never released at exit, when
  // the interpreter may already be gone).
  static PyObject* error_class = nb::object(nb::module_::import_("specache._status").attr("StatusError")).release().ptr();
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusException& e) {
      nb::object error = nb::borrow(error_class)(static_cast<int>(e.status().code()), e.status().message());
      PyErr_SetObject(error_class, error.ptr());
    }
  });
  m.attr("StatusError") = nb::borrow(error_class);
}

}  // namespace specache::python
