#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace inprocess {

// Phases of a rank's restart loop, published so that a monitor can tell what
// the rank was doing when it stopped.
enum class Phase : int32_t {
  kStarting = 0,
  kInitialBarrier = 1,
  kRunning = 2,       // inside the wrapped function
  kAborting = 3,
  kFinalizing = 4,
  kHealthCheck = 5,
  kRestartBarrier = 6,
  kCompletion = 7,
  kTerminated = 8,
  kDone = 9,
};

// Bits of HeartbeatLayout::flags.
enum HeartbeatFlag : uint32_t {
  kManualArmed = 1u << 0,        // ping() was called in this iteration
  kHangProtectionOff = 1u << 1,  // inside CallWrapper.disable_hang_protection()
  // 1u << 2 was "arrived at barrier": the store's per-rank seat replaced it.
};

constexpr uint64_t kHeartbeatMagic = 0x696e70726f630001ULL;  // "inproc" + version 1
constexpr uint32_t kHeartbeatVersion = 1;

// Fixed binary layout of the shared page (design principle 5: no pickle).
// Every field is a lock-free atomic, so the rank, its watchdog thread and its
// monitor process read and write it without locks and without the GIL.
struct HeartbeatLayout {
  uint64_t magic;
  uint32_t version;
  uint32_t pid;
  std::atomic<int64_t> created_ns;
  std::atomic<int64_t> auto_progress_ns;
  std::atomic<int64_t> manual_progress_ns;
  std::atomic<int64_t> iteration;
  std::atomic<int32_t> phase;
  std::atomic<uint32_t> flags;
  std::atomic<int64_t> soft_timeout_ns;
  std::atomic<int64_t> hard_timeout_ns;
  std::atomic<int64_t> phase_since_ns;
  std::atomic<int64_t> world_size;  // ranks in the current membership (a monitor arrives for them)
};
static_assert(std::atomic<int64_t>::is_always_lock_free, "shared-memory atomics must be lock-free");

struct HeartbeatSnapshot {
  uint32_t pid;
  int64_t created_ns;
  int64_t auto_progress_ns;
  int64_t manual_progress_ns;
  int64_t iteration;
  int32_t phase;
  uint32_t flags;
  int64_t soft_timeout_ns;
  int64_t hard_timeout_ns;
  int64_t phase_since_ns;
  int64_t world_size;
};

// One page of anonymous shared memory (memfd, mode 0600). It has no name in
// /dev/shm, so no exit path can leave it behind; a monitor process receives
// the file descriptor by inheritance and maps the same page.
class HeartbeatPage {
 public:
  // Creates a fresh page owned by the calling process.
  static HeartbeatPage create();
  // Maps an existing page from an inherited descriptor (the monitor side).
  static HeartbeatPage attach(int fd);

  HeartbeatPage(HeartbeatPage&& other) noexcept;
  HeartbeatPage& operator=(HeartbeatPage&& other) noexcept;
  HeartbeatPage(const HeartbeatPage&) = delete;
  HeartbeatPage& operator=(const HeartbeatPage&) = delete;
  ~HeartbeatPage();

  int fd() const noexcept { return fd_; }
  bool closed() const noexcept { return page_ == nullptr; }
  void close() noexcept;

  // Manual progress: CallWrapper.ping(). Also arms the manual timeout.
  void ping() noexcept;
  // Automatic progress: stamped when the main thread ran Python bytecode.
  void stamp_auto() noexcept;
  void set_phase(Phase phase) noexcept;
  void set_timeouts(int64_t soft_ns, int64_t hard_ns) noexcept;
  void set_flag(uint32_t flag, bool on) noexcept;
  // A new iteration restarts the clocks and disarms the manual timeout.
  void begin_iteration(int64_t iteration, int64_t world_size) noexcept;

  HeartbeatSnapshot snapshot() const;
  HeartbeatLayout* layout() const noexcept { return page_; }

 private:
  HeartbeatPage(int fd, HeartbeatLayout* page) noexcept : fd_(fd), page_(page) {}
  int fd_ = -1;
  HeartbeatLayout* page_ = nullptr;
};

}  // namespace inprocess
