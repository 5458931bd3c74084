// The extension module inprocess._native: one register function per family
// (csrc/register_*.cpp).
#include <pybind11/pybind11.h>

#include "register.hpp"

#ifndef INPROCESS_VERSION
#error "INPROCESS_VERSION must be defined by the build (CMakeLists.txt reads pyproject.toml's version)"
#endif

PYBIND11_MODULE(_native, m) {
  namespace b = inprocess::bindings;
  m.doc() = "Native core of inprocess: shared-memory heartbeats and GIL-free monitoring.";
  m.attr("__version__") = INPROCESS_VERSION;
  b::register_clock(m);
  b::register_heartbeat(m);
  b::register_host_names(m);
  b::register_killer(m);
  b::register_node_board(m);
  b::register_store_connection(m);
  b::register_relay_layout(m);
  b::register_node_relay(m);
  b::register_watchdog(m);
  b::register_gpu(m);
  b::register_testing(m);
}
