#include "clock.hpp"

#include <algorithm>
#include <ctime>
#include <limits>

namespace inprocess {

int64_t monotonic_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

int64_t add_saturated(int64_t a, int64_t b) noexcept {
  int64_t sum;
  if (__builtin_add_overflow(a, b, &sum)) return b > 0 ? std::numeric_limits<int64_t>::max() : 0;
  return sum;
}

std::chrono::steady_clock::time_point steady_deadline(int64_t timeout_ns) {
  constexpr int64_t kLongest = 1'000'000'000'000'000'000;
  return std::chrono::steady_clock::now() + std::chrono::nanoseconds(std::clamp<int64_t>(timeout_ns, 0, kLongest));
}

}  // namespace inprocess
