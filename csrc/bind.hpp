#pragma once

// The shapes every binding repeats, once each (boost-histogram's register_storage<A> is the model):
// convert the Python arguments with the GIL held, release it for the native call, convert the
// result back. The register_*.cpp files use these instead of writing the shape out.

#include <pybind11/pybind11.h>

#include <string>
#include <utility>

namespace inprocess::bindings {

// `call()` without the GIL (design principle 7: every blocking native call releases it); its result.
template <class Call>
auto without_gil(Call&& call) -> decltype(call()) {
  pybind11::gil_scoped_release nogil;
  return std::forward<Call>(call)();
}

// `call()` without the GIL, its std::string result as Python bytes (built once the GIL is back).
template <class Call>
pybind11::bytes bytes_without_gil(Call&& call) {
  std::string out = without_gil(std::forward<Call>(call));
  return pybind11::bytes(out);
}

// A timeout from Python: a datetime.timedelta or a number of seconds, >= 0; `name` in the error.
double seconds(const pybind11::handle& value, const char* name);

// A store value from Python: str (UTF-8), bytes, bytearray or memoryview.
std::string value_bytes(const pybind11::handle& value);

}  // namespace inprocess::bindings
