#include "register.hpp"

#include "clock.hpp"

namespace py = pybind11;

namespace inprocess::bindings {

void register_clock(py::module_& m) {
  m.def("monotonic_ns", &inprocess::monotonic_ns,
        "CLOCK_MONOTONIC in nanoseconds (the clock of every heartbeat timestamp).");
}

}  // namespace inprocess::bindings
