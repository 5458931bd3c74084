#pragma once

// The CUDA driver functions inprocess calls, declared here instead of taken
// from cuda.h (design principle 6: no CUDA header or library at build time).
// Handles are the same incomplete structs cuda.h names, so a test compiles
// this list against the real cuda.h and fails on any disagreement
// (tests/test_gpu_abi.py). Symbol names are the exported ones: cuda.h maps
// cuMemAlloc to cuMemAlloc_v2 and so on by macro.

#include <cstddef>

struct CUctx_st;
struct CUstream_st;

namespace inprocess::cuda {

using CUresult = int;  // an enum in cuda.h: an int-sized value on every ABI we build for
using CUdevice = int;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUdeviceptr = unsigned long long;  // CUdeviceptr_v2 on 64-bit platforms

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorNotReady = 600;
constexpr CUresult kErrorUnknown = 999;

// X(symbol, function type). Every one is required: a driver without one of
// them is older than anything torch supports.
#define INPROCESS_CUDA_FUNCTIONS(X)                                                                       \
  X(cuInit, CUresult (*)(unsigned int))                                                                   \
  X(cuDriverGetVersion, CUresult (*)(int*))                                                               \
  X(cuDeviceGetCount, CUresult (*)(int*))                                                                 \
  X(cuDeviceGet, CUresult (*)(CUdevice*, int))                                                            \
  X(cuDeviceGetPCIBusId, CUresult (*)(char*, int, CUdevice))                                              \
  X(cuDevicePrimaryCtxGetState, CUresult (*)(CUdevice, unsigned int*, int*))                              \
  X(cuDevicePrimaryCtxRetain, CUresult (*)(CUcontext*, CUdevice))                                         \
  X(cuDevicePrimaryCtxRelease_v2, CUresult (*)(CUdevice))                                                 \
  X(cuCtxSetCurrent, CUresult (*)(CUcontext))                                                             \
  X(cuCtxSynchronize, CUresult (*)(void))                                                                 \
  X(cuStreamQuery, CUresult (*)(CUstream))                                                                \
  X(cuMemAlloc_v2, CUresult (*)(CUdeviceptr*, size_t))                                                    \
  X(cuMemFree_v2, CUresult (*)(CUdeviceptr))                                                              \
  X(cuMemcpyHtoD_v2, CUresult (*)(CUdeviceptr, const void*, size_t))                                      \
  X(cuMemcpyDtoH_v2, CUresult (*)(void*, CUdeviceptr, size_t))                                            \
  X(cuGetErrorName, CUresult (*)(CUresult, const char**))                                                 \
  X(cuGetErrorString, CUresult (*)(CUresult, const char**))

}  // namespace inprocess::cuda
