// Compiled (never linked) by tests/test_gpu_abi.py against the real nccl.h,
// cuda.h and nvml.h of the NVIDIA wheels: every function type csrc/gpu/*_api.hpp
// declares must agree with the header's, parameter by parameter.
#include <cstddef>
#include <type_traits>

#include <cuda.h>
#include <nccl.h>
#include <nvml.h>

#include "gpu/cuda_api.hpp"
#include "gpu/nccl_api.hpp"
#include "gpu/nvml_api.hpp"

// Same ABI: identical types, or an enum of the header against our int of the
// same size, or pointers to such, or integers of one size and signedness.
template <class A, class B, class = void>
struct abi_same : std::false_type {};
template <class A>
struct abi_same<A, A> : std::true_type {};
template <class A, class B>
struct abi_same<A, B, std::enable_if_t<!std::is_same_v<A, B> && std::is_enum_v<A> && std::is_same_v<B, int>>>
    : std::bool_constant<sizeof(A) == sizeof(int)> {};
template <class A, class B>
struct abi_same<A*, B*, std::enable_if_t<!std::is_same_v<A, B>>> : abi_same<std::remove_cv_t<A>, std::remove_cv_t<B>> {
  static_assert(std::is_const_v<A> == std::is_const_v<B>, "constness differs");
};
template <class A, class B>
struct abi_same<A, B,
                std::enable_if_t<!std::is_same_v<A, B> && std::is_integral_v<A> && std::is_integral_v<B> &&
                                 !std::is_enum_v<A>>>
    : std::bool_constant<sizeof(A) == sizeof(B) && std::is_signed_v<A> == std::is_signed_v<B>> {};

// Our copy of nvmlFieldValue_t: its layout is asserted field by field below.
template <>
struct abi_same<nvmlFieldValue_t, inprocess::nvml::FieldValue> : std::true_type {};

template <class A, class B>
struct fn_same : std::false_type {};
template <class RA, class... PA, class RB, class... PB>
struct fn_same<RA (*)(PA...), RB (*)(PB...)>
    : std::bool_constant<sizeof...(PA) == sizeof...(PB) && abi_same<RA, RB>::value &&
                         (abi_same<PA, PB>::value && ...)> {};

#define INPROCESS_CHECK(name, type) \
  static_assert(fn_same<decltype(&::name), type>::value, #name ": declared type differs from the header's");

// Our aliases, declared in each check namespace so that they hide the
// header's global names of the same spelling in the expanded lists.
namespace cuda_check {
using CUresult = inprocess::cuda::CUresult;
using CUdevice = inprocess::cuda::CUdevice;
using CUcontext = inprocess::cuda::CUcontext;
using CUstream = inprocess::cuda::CUstream;
using CUdeviceptr = inprocess::cuda::CUdeviceptr;
INPROCESS_CUDA_FUNCTIONS(INPROCESS_CHECK)
}  // namespace cuda_check

namespace current_device_check {  // the driver calls of the NCCL abort's device (gpu/nccl_api.hpp)
using CUresult = inprocess::nccl::driver::CUresult;
using CUdevice = inprocess::nccl::driver::CUdevice;
using CUcontext = inprocess::nccl::driver::CUcontext;
INPROCESS_CURRENT_DEVICE_FUNCTIONS(INPROCESS_CHECK)
}  // namespace current_device_check

namespace nccl_check {
using ncclResult_t = inprocess::nccl::ncclResult_t;
using ncclComm_t = inprocess::nccl::ncclComm_t;
INPROCESS_NCCL_FUNCTIONS(INPROCESS_CHECK)
INPROCESS_NCCL_OPTIONAL_FUNCTIONS(INPROCESS_CHECK)
static_assert(inprocess::nccl::kSuccess == ncclSuccess && inprocess::nccl::kInProgress == ncclInProgress);
}  // namespace nccl_check

namespace nvml_check {
using nvmlReturn_t = inprocess::nvml::nvmlReturn_t;
using nvmlDevice_t = inprocess::nvml::nvmlDevice_t;
using FieldValue = inprocess::nvml::FieldValue;
using namespace inprocess::nvml;
INPROCESS_NVML_FUNCTIONS(INPROCESS_CHECK)
using Ours = inprocess::nvml::FieldValue;
static_assert(sizeof(Ours) == sizeof(nvmlFieldValue_t));
static_assert(offsetof(Ours, fieldId) == offsetof(nvmlFieldValue_t, fieldId));
static_assert(offsetof(Ours, valueType) == offsetof(nvmlFieldValue_t, valueType));
static_assert(offsetof(Ours, nvmlReturn) == offsetof(nvmlFieldValue_t, nvmlReturn));
static_assert(offsetof(Ours, value) == offsetof(nvmlFieldValue_t, value));
static_assert(kFieldGpuRecoveryAction == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION);
static_assert(kMaxNvLinks == NVML_NVLINK_MAX_LINKS);
static_assert(kErrorGpuIsLost == NVML_ERROR_GPU_IS_LOST && kErrorNotSupported == NVML_ERROR_NOT_SUPPORTED);
static_assert(kMemoryErrorTypeUncorrected == NVML_MEMORY_ERROR_TYPE_UNCORRECTED && kVolatileEcc == NVML_VOLATILE_ECC);
}  // namespace nvml_check

static_assert(inprocess::cuda::kErrorNotReady == CUDA_ERROR_NOT_READY);

#ifdef INPROCESS_ABI_SELFTEST
// Proves the check can fail: a deliberately wrong declaration.
static_assert(fn_same<decltype(&::ncclCommAbort), int (*)(ncclComm_t, int)>::value, "selftest: must fail");
#endif
