#include "server_hooks/bindings/status_to_python.h"

#include <string>

namespace llep::bindings {
namespace py = pybind11;
namespace {

PyObject* g_base = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_timeout = nullptr;
PyObject* g_unavailable = nullptr;
PyObject* g_precondition = nullptr;

PyObject* Make(py::module_& m, const char* name, PyObject* bases, const char* doc) {
  const std::string qualified = std::string("llep._llep.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (cls == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(cls));
  return cls;
}

}  // namespace

void RegisterExceptions(py::module_& m) {
  g_base = Make(m, "LlepError", PyExc_RuntimeError, "Base of every llep error; .code names the status code.");
  g_invalid = Make(m, "LlepInvalidArgumentError",
                   py::make_tuple(py::handle(g_base), py::handle(PyExc_ValueError)).release().ptr(),
                   "A shape, dtype, value or combination of arguments llep cannot accept.");
  g_timeout =
      Make(m, "LlepTimeoutError", py::make_tuple(py::handle(g_base), py::handle(PyExc_TimeoutError)).release().ptr(),
           "A peer did not answer within the configured timeout.");
  g_unavailable = Make(m, "LlepUnavailableError", g_base, "A peer or the transport failed.");
  g_precondition = Make(m, "LlepFailedPreconditionError", g_base, "A call made in a state that does not allow it.");
}

void ThrowIfError(const absl::Status& s) {
  if (s.ok()) return;
  PyObject* cls = g_base;
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      cls = g_invalid;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      cls = g_timeout;
      break;
    case absl::StatusCode::kUnavailable:
      cls = g_unavailable;
      break;
    case absl::StatusCode::kFailedPrecondition:
      cls = g_precondition;
      break;
    default:
      break;
  }
  const std::string msg(s.message());
  py::object err = py::reinterpret_borrow<py::object>(cls)(msg);
  err.attr("code") = absl::StatusCodeToString(s.code());
  PyErr_SetObject(cls, err.ptr());
  throw py::error_already_set();
}

}  // namespace llep::bindings
