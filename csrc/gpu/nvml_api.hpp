#pragma once

// The NVML functions and the one struct inprocess uses, declared here instead
// of taken from nvml.h (design principle 6). tests/test_gpu_abi.py compiles
// them against the nvml.h of the nvidia-nvml-dev-cu12 wheel.

struct nvmlDevice_st;

namespace inprocess::nvml {

using nvmlReturn_t = int;  // enums in nvml.h: int-sized values
using nvmlDevice_t = nvmlDevice_st*;

constexpr nvmlReturn_t kSuccess = 0;
constexpr nvmlReturn_t kErrorInvalidArgument = 2;
constexpr nvmlReturn_t kErrorNotSupported = 3;
constexpr nvmlReturn_t kErrorNotFound = 6;
constexpr nvmlReturn_t kErrorGpuIsLost = 15;
constexpr int kMemoryErrorTypeUncorrected = 1;  // NVML_MEMORY_ERROR_TYPE_UNCORRECTED
constexpr int kVolatileEcc = 0;                 // NVML_VOLATILE_ECC
constexpr int kFeatureEnabled = 1;              // NVML_FEATURE_ENABLED
constexpr unsigned kFieldGpuRecoveryAction = 230;  // NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (driver 570+)
constexpr unsigned kMaxNvLinks = 18;               // NVML_NVLINK_MAX_LINKS

// nvmlFieldValue_t: the layout is checked against nvml.h by the ABI test.
struct FieldValue {
  unsigned int fieldId;
  unsigned int scopeId;
  long long timestamp;
  long long latencyUsec;
  int valueType;
  nvmlReturn_t nvmlReturn;
  union {
    double dVal;
    int siVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    unsigned short usVal;
  } value;
};

#define INPROCESS_NVML_FUNCTIONS(X)                                                                  \
  X(nvmlInit_v2, nvmlReturn_t (*)(void))                                                             \
  X(nvmlShutdown, nvmlReturn_t (*)(void))                                                            \
  X(nvmlErrorString, const char* (*)(nvmlReturn_t))                                                  \
  X(nvmlDeviceGetHandleByIndex_v2, nvmlReturn_t (*)(unsigned int, nvmlDevice_t*))                    \
  X(nvmlDeviceGetHandleByUUID, nvmlReturn_t (*)(const char*, nvmlDevice_t*))                         \
  X(nvmlDeviceGetHandleByPciBusId_v2, nvmlReturn_t (*)(const char*, nvmlDevice_t*))                  \
  X(nvmlDeviceGetTotalEccErrors, nvmlReturn_t (*)(nvmlDevice_t, int, int, unsigned long long*))      \
  X(nvmlDeviceGetRemappedRows, nvmlReturn_t (*)(nvmlDevice_t, unsigned int*, unsigned int*, unsigned int*, unsigned int*)) \
  X(nvmlDeviceGetRetiredPagesPendingStatus, nvmlReturn_t (*)(nvmlDevice_t, int*))                    \
  X(nvmlDeviceGetNvLinkState, nvmlReturn_t (*)(nvmlDevice_t, unsigned int, int*))                    \
  X(nvmlDeviceGetFieldValues, nvmlReturn_t (*)(nvmlDevice_t, int, FieldValue*))

}  // namespace inprocess::nvml
