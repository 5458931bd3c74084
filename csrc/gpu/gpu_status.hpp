#pragma once

#include <cstdint>

namespace inprocess::gpu {

// How a deadline-bounded GPU library call ended.
enum class GpuStatus : int32_t {
  kDone = 0,       // finished, no error
  kTimedOut = 1,   // the deadline passed first (the call may still be running, abandoned)
  kError = 2,      // the library returned an error (see the outcome's code)
  kNoContext = 3,  // CUDA: the device's primary context is not active: nothing to check, none created
  kCorrupted = 4,  // CUDA probe: the data read back differs from what was written
};

}  // namespace inprocess::gpu
