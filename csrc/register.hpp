#pragma once

// One register function per family (a class, or a few free functions) of the extension module
// inprocess._native (csrc/module.cpp calls each once); the shapes they share are bind.hpp's. These files are the only pybind11 code
// of the project besides the watchdog's Python runtime (python_watchdog.*);
// the core they bind (inprocess_core) has no Python dependency.
//
// Every call that can block releases the GIL (design principle 7). The
// heartbeat page's methods are a few atomic loads and stores: they keep the
// GIL, since releasing and re-taking it would cost several times the write
// and could hand the GIL to another thread in the middle of a ping().

#include <pybind11/pybind11.h>

namespace inprocess::bindings {

void register_clock(pybind11::module_& m);
void register_heartbeat(pybind11::module_& m);
void register_host_names(pybind11::module_& m);  // getnameinfo without a resolver
void register_killer(pybind11::module_& m);
void register_node_board(pybind11::module_& m);
void register_store_connection(pybind11::module_& m);  // StoreConnection, the errors it raises
void register_relay_layout(pybind11::module_& m);
void register_node_relay(pybind11::module_& m);
void register_watchdog(pybind11::module_& m);
void register_gpu(pybind11::module_& m);  // CUDA driver, NCCL, NVML
void register_testing(pybind11::module_& m);

}  // namespace inprocess::bindings
