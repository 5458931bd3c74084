#pragma once

// NCCL communicators by pointer: abort and revoke (all of them as one NCCL
// group), async errors. Only the NCCL torch itself calls may act on torch's
// communicators: the loader resolves it through torch's own library
// (libtorch_cuda.so, which finds an NCCL linked into it statically too) and
// never maps a second copy. Every call runs on a DeadlineWorker thread bound
// to the rank's device: a hung abort returns "timed out" to the caller
// instead of hanging it.

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu/deadline_worker.hpp"
#include "gpu/dynamic_library.hpp"
#include "gpu/gpu_status.hpp"
#include "gpu/nccl_api.hpp"

namespace inprocess::gpu {

// Makes a device's primary context current on the calling thread, through
// the CUDA driver, only where that context already exists: nothing is ever
// created. NCCL's blocking ncclGroupEnd saves the calling thread's device and
// sets it back afterwards (nccl src/group.cc, ncclGroupEndInternal, v2.30.7-1
// lines 860-863): on a thread with no device that is device 0, and since CUDA
// 12 cudaSetDevice creates the primary context there. A thread bound here
// saves and restores the rank's own device instead.
class CurrentDevice {
 public:
  static constexpr const char* kDriver = "libcuda.so.1";
  // The driver at `path` ("" = libcuda.so.1, the loaded copy first); throws
  // std::runtime_error when it cannot be loaded or lacks a function.
  static std::shared_ptr<CurrentDevice> open(const std::string& path);
  // "" when CUDA ordinal `device` is now current on the calling thread;
  // otherwise why not (its primary context is not active, a driver error).
  std::string bind(int device) const;
  struct Api;

 private:
  CurrentDevice(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api);
  std::shared_ptr<DynamicLibrary> library_;
  std::shared_ptr<Api> api_;
};

struct NcclOutcome {
  GpuStatus status = GpuStatus::kDone;
  std::vector<int> results;  // per communicator, in the order given (abort/revoke: the call's result;
                             // async_errors: the communicator's async error)
  std::string message;       // what failed, for the exception or the log
  int64_t elapsed_ns = 0;
};

class NcclLibrary {
 public:
  static constexpr const char* kLoadedPrefix = "libnccl.so";
  static constexpr const char* kTorchCuda = "libtorch_cuda.so";
  // Added to a timeout before a call is abandoned (see NcclLibrary::run).
  static constexpr int64_t kReportGraceNs = 20'000'000;

  // The NCCL torch calls: resolved through torch's loaded libtorch_cuda.so
  // (dlsym on its handle searches the library, where a static NCCL lives,
  // then the libraries it needs, where its libnccl is), else, where torch's
  // CUDA library is not loaded, the first libnccl loaded. nullptr when there
  // is none, or when libtorch_cuda.so is loaded but reaches no NCCL.
  static std::shared_ptr<NcclLibrary> find_loaded();
  // An explicit file (tests, benchmarks, tools). Refuses with
  // std::invalid_argument when another libnccl file is already loaded: its
  // communicators must never meet a second copy. Throws std::runtime_error
  // when the file cannot be loaded or lacks a required symbol.
  static std::shared_ptr<NcclLibrary> open(const std::string& path);

  // The file the NCCL functions are in (libtorch_cuda.so for a static NCCL).
  const std::string& path() const { return path_; }
  bool was_loaded_before() const { return library_->was_loaded_before(); }
  int version() const { return version_; }
  bool has_revoke() const;
  std::string error_string(int result) const;
  // Every symbol this layer uses and whether the library has it.
  std::vector<std::pair<std::string, bool>> symbols() const;

  // ncclCommAbort of each communicator; `grouped`: between ncclGroupStart and
  // ncclGroupEnd, so that NCCL tears them down together (aborting one by one
  // can hang while an operation on another still waits for it), where the
  // NCCL takes aborts in a group (2.22 and later; one by one before). The pointers are
  // freed by NCCL: their owner must not use them again.
  NcclOutcome abort(const std::vector<uint64_t>& comms, bool grouped, int64_t timeout_ns);
  // ncclCommRevoke of each, then until none reports ncclInProgress: in-flight
  // operations are stopped, and the communicators stay valid for their
  // owner's own abort or destroy. The revokes are grouped: each call sets its
  // communicator's abort flag at once and ncclGroupEnd runs the waits for
  // quiescence after all flags are set (nccl src/init.cc, ncclCommRevoke,
  // v2.30.7-1 lines 2965-3022), so a kernel stuck on one communicator cannot
  // hold the revoke of another that shares its stream. Blocking and
  // non-blocking communicators cannot share a group (src/group.cc lines
  // 54-62): `blocking[i]` says which `comms[i]` is; the non-blocking group
  // goes first, its ncclGroupEnd returns at once. kError when the library has
  // no revoke.
  NcclOutcome revoke(const std::vector<uint64_t>& comms, const std::vector<bool>& blocking, int64_t timeout_ns);
  NcclOutcome async_errors(const std::vector<uint64_t>& comms, int64_t timeout_ns);

  // Every later call runs on a worker thread with CUDA ordinal `device`
  // current (set once per worker thread); a negative device: none is set.
  // Returns why the device could not be made current, "" when it was (on the
  // calling thread, as a check that it can be).
  std::string use_device(std::shared_ptr<CurrentDevice> driver, int device);
  int device() const;

  struct Api;

 private:
  NcclLibrary(std::shared_ptr<DynamicLibrary> library, std::shared_ptr<Api> api);
  template <class Body>
  NcclOutcome run(size_t count, int64_t timeout_ns, const char* what, Body body);

  std::shared_ptr<DynamicLibrary> library_;
  std::shared_ptr<Api> api_;
  std::string path_;
  int version_ = 0;
  DeadlineWorker worker_{"inprocess-nccl"};
  mutable std::mutex device_mu_;
  std::shared_ptr<CurrentDevice> driver_;
  int device_ = -1;
};

}  // namespace inprocess::gpu
