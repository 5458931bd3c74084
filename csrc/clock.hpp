#pragma once

#include <cstdint>

namespace inprocess {

// CLOCK_MONOTONIC in nanoseconds: comparable between processes of one host,
// never across hosts, and unaffected by wall-clock steps.
int64_t monotonic_ns() noexcept;

}  // namespace inprocess
