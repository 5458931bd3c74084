#pragma once

// The NCCL functions inprocess calls, declared here instead of taken from
// nccl.h (design principle 6). ncclComm_t is the same incomplete struct
// nccl.h names; tests/test_gpu_abi.py compiles this list against the nccl.h
// of the nvidia-nccl-cu12 wheel and fails on any disagreement.

struct ncclComm;

namespace inprocess::nccl {

using ncclResult_t = int;  // an enum in nccl.h: an int-sized value
using ncclComm_t = ncclComm*;

constexpr ncclResult_t kSuccess = 0;
constexpr ncclResult_t kInProgress = 7;

// NCCL_VERSION(X, Y, Z) of nccl.h for versions after 2.8.
constexpr int version_code(int major, int minor, int patch) { return major * 10000 + minor * 100 + patch; }
// The first NCCL with ncclCommRevoke. It is looked up by symbol; the version
// only goes into messages.
constexpr int kRevokeVersion = version_code(2, 28, 7);
// NCCL 2.21 and older do not take ncclCommAbort inside a group (torch's
// ProcessGroupNCCL began grouping its aborts once past 2.21); there the
// communicators are aborted one after the other.
constexpr int kGroupAbortVersion = version_code(2, 22, 0);

// X(symbol, function type): required.
#define INPROCESS_NCCL_FUNCTIONS(X)                                  \
  X(ncclGetVersion, ncclResult_t (*)(int*))                          \
  X(ncclGetErrorString, const char* (*)(ncclResult_t))               \
  X(ncclCommAbort, ncclResult_t (*)(ncclComm_t))                     \
  X(ncclCommGetAsyncError, ncclResult_t (*)(ncclComm_t, ncclResult_t*)) \
  X(ncclGroupStart, ncclResult_t (*)(void))                          \
  X(ncclGroupEnd, ncclResult_t (*)(void))

// Optional: used where the loaded NCCL has it (2.28.7 and later).
#define INPROCESS_NCCL_OPTIONAL_FUNCTIONS(X) X(ncclCommRevoke, ncclResult_t (*)(ncclComm_t, int))

}  // namespace inprocess::nccl

// The CUDA driver calls that make a device current on a thread (the NCCL
// worker's, the restart trigger's), declared here for the same reason, with
// the handle types of gpu/cuda_api.hpp (tests/abi_check.cpp checks both).
struct CUctx_st;

namespace inprocess::nccl::driver {

using CUresult = int;
using CUdevice = int;
using CUcontext = CUctx_st*;

#define INPROCESS_CURRENT_DEVICE_FUNCTIONS(X)                            \
  X(cuDeviceGet, CUresult (*)(CUdevice*, int))                           \
  X(cuDevicePrimaryCtxGetState, CUresult (*)(CUdevice, unsigned int*, int*)) \
  X(cuDevicePrimaryCtxRetain, CUresult (*)(CUcontext*, CUdevice))        \
  X(cuDevicePrimaryCtxRelease_v2, CUresult (*)(CUdevice))                \
  X(cuCtxSetCurrent, CUresult (*)(CUcontext))                            \
  X(cuCtxGetCurrent, CUresult (*)(CUcontext*))

}  // namespace inprocess::nccl::driver
