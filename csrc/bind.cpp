// The conversions every binding shares (bind.hpp).
#include "bind.hpp"

#include <string>

namespace py = pybind11;

namespace inprocess::bindings {

double seconds(const py::handle& value, const char* name) {
  double s;
  if (py::isinstance(value, py::module_::import("datetime").attr("timedelta"))) {
    s = value.attr("total_seconds")().cast<double>();
  } else if (PyFloat_Check(value.ptr()) || (PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr()))) {
    s = value.cast<double>();
  } else {
    throw py::type_error(std::string(name) + " must be a datetime.timedelta or a number of seconds, got " +
                         py::repr(value).cast<std::string>());
  }
  if (!(s >= 0)) throw py::value_error(std::string(name) + " must be >= 0, got " + py::repr(value).cast<std::string>());
  return s;
}

std::string value_bytes(const py::handle& value) {
  if (PyBytes_Check(value.ptr())) return value.cast<std::string>();
  if (PyUnicode_Check(value.ptr())) return value.cast<std::string>();  // UTF-8
  if (PyByteArray_Check(value.ptr()) || PyMemoryView_Check(value.ptr())) {
    return py::bytes(py::reinterpret_borrow<py::object>(value)).cast<std::string>();
  }
  throw py::type_error("a store value is str or bytes, got " +
                       py::str(py::type::handle_of(value).attr("__name__")).cast<std::string>());
}

}  // namespace inprocess::bindings
