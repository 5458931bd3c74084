#include "register.hpp"

#include "clock.hpp"

namespace py = pybind11;

namespace inprocess::bindings {

void register_testing(py::module_& m) {
  auto t = m.def_submodule("testing", "Fault injection helpers for the test suite.");
  t.def(
      "spin_holding_gil",
      [](double seconds) {
        // Deliberately keeps the GIL: models a rank stuck in native code.
        const int64_t end = inprocess::monotonic_ns() + static_cast<int64_t>(seconds * 1e9);
        volatile uint64_t sink = 0;
        while (inprocess::monotonic_ns() < end) sink = sink + 1;
      },
      py::arg("seconds"), "Busy-wait for `seconds` without releasing the GIL.");
}

}  // namespace inprocess::bindings
