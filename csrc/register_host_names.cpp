#include "register.hpp"

#include <pybind11/stl.h>

#include "numeric_host_names.hpp"

namespace py = pybind11;

namespace inprocess::bindings {

void register_host_names(py::module_& m) {
  m.def("force_numeric_host_names", &inprocess::force_numeric_host_names, py::arg("prefixes"),
        "getnameinfo() called by the loaded libraries whose file name starts with one of `prefixes` "
        "answers with the address in numbers (NI_NUMERICHOST), never asking a resolver. Idempotent; "
        "returns the paths of the libraries redirected so far among them.");
  m.def("restore_host_names", &inprocess::restore_host_names,
        "Undo force_numeric_host_names everywhere; returns the number of slots put back (for tests).");
}

}  // namespace inprocess::bindings
