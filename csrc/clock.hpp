#pragma once

#include <chrono>
#include <cstdint>

namespace inprocess {

// CLOCK_MONOTONIC in nanoseconds: comparable between processes of one host,
// never across hosts, and unaffected by wall-clock steps.
int64_t monotonic_ns() noexcept;

// a + b, saturating: a timeout of "never" arrives from the page or from
// Python as a huge number and must not wrap into a deadline in the past.
int64_t add_saturated(int64_t a, int64_t b) noexcept;

// A steady_clock deadline `timeout_ns` from now. Negative means now; a
// "forever" beyond ~30 years is cut there so the time point cannot overflow.
std::chrono::steady_clock::time_point steady_deadline(int64_t timeout_ns);

}  // namespace inprocess
