#include "heartbeat.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "anonymous_memory.hpp"
#include "clock.hpp"

namespace inprocess {
namespace {

constexpr size_t kPageBytes = 4096;
static_assert(sizeof(HeartbeatLayout) <= kPageBytes, "layout must fit one page");

std::runtime_error os_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

HeartbeatLayout* map_page(int fd) {
  void* p = mmap(nullptr, kPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw os_error("mmap(heartbeat page)");
  return static_cast<HeartbeatLayout*>(p);
}

}  // namespace

HeartbeatPage HeartbeatPage::create() {
  std::string tried;
  int fd = create_anonymous_fd("inprocess-heartbeat", "/inprocess-hb-", tried);
  if (fd < 0) throw os_error("shm_open(" + tried + ")");
  if (ftruncate(fd, kPageBytes) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    throw os_error("ftruncate(heartbeat page)");
  }
  HeartbeatLayout* page;
  try {
    page = map_page(fd);
  } catch (...) {
    ::close(fd);
    throw;
  }
  // The page is zero-filled; placement-new gives the atomics their initial values.
  new (page) HeartbeatLayout{};
  const int64_t now = monotonic_ns();
  page->magic = kHeartbeatMagic;
  page->version = kHeartbeatVersion;
  page->pid = static_cast<uint32_t>(getpid());
  page->created_ns.store(now);
  page->auto_progress_ns.store(now);
  page->manual_progress_ns.store(now);
  page->phase_since_ns.store(now);
  page->iteration.store(-1);
  return HeartbeatPage(fd, page);
}

HeartbeatPage HeartbeatPage::attach(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) throw os_error("fstat(heartbeat fd " + std::to_string(fd) + ")");
  if (static_cast<size_t>(st.st_size) < kPageBytes) {
    throw std::invalid_argument("fd " + std::to_string(fd) + " is not a heartbeat page (size " +
                                std::to_string(st.st_size) + ", expected " + std::to_string(kPageBytes) + ")");
  }
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) throw os_error("dup(heartbeat fd)");
  HeartbeatLayout* page;
  try {
    page = map_page(own);
  } catch (...) {
    ::close(own);
    throw;
  }
  if (page->magic != kHeartbeatMagic || page->version != kHeartbeatVersion) {
    munmap(page, kPageBytes);
    ::close(own);
    throw std::invalid_argument("fd " + std::to_string(fd) + " holds no inprocess heartbeat page of version " +
                                std::to_string(kHeartbeatVersion));
  }
  return HeartbeatPage(own, page);
}

HeartbeatPage::HeartbeatPage(HeartbeatPage&& other) noexcept : fd_(other.fd_), page_(other.page_) {
  other.fd_ = -1;
  other.page_ = nullptr;
}

HeartbeatPage& HeartbeatPage::operator=(HeartbeatPage&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    page_ = other.page_;
    other.fd_ = -1;
    other.page_ = nullptr;
  }
  return *this;
}

HeartbeatPage::~HeartbeatPage() { close(); }

void HeartbeatPage::close() noexcept {
  if (page_ != nullptr) {
    munmap(page_, kPageBytes);
    page_ = nullptr;
  }
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void HeartbeatPage::ping() noexcept {
  if (page_ == nullptr) return;
  page_->manual_progress_ns.store(monotonic_ns(), std::memory_order_release);
  // Checking first avoids a locked read-modify-write on every call.
  if (!(page_->flags.load(std::memory_order_relaxed) & kManualArmed)) {
    page_->flags.fetch_or(kManualArmed, std::memory_order_acq_rel);
  }
}

void HeartbeatPage::stamp_auto() noexcept {
  if (page_ == nullptr) return;
  page_->auto_progress_ns.store(monotonic_ns(), std::memory_order_release);
}

void HeartbeatPage::set_phase(Phase phase) noexcept {
  if (page_ == nullptr) return;
  page_->phase_since_ns.store(monotonic_ns(), std::memory_order_relaxed);
  page_->phase.store(static_cast<int32_t>(phase), std::memory_order_release);
}

void HeartbeatPage::set_timeouts(int64_t soft_ns, int64_t hard_ns) noexcept {
  if (page_ == nullptr) return;
  page_->soft_timeout_ns.store(soft_ns, std::memory_order_relaxed);
  page_->hard_timeout_ns.store(hard_ns, std::memory_order_release);
}

void HeartbeatPage::set_flag(uint32_t flag, bool on) noexcept {
  if (page_ == nullptr) return;
  if (on) {
    page_->flags.fetch_or(flag, std::memory_order_acq_rel);
  } else {
    page_->flags.fetch_and(~flag, std::memory_order_acq_rel);
  }
}

void HeartbeatPage::begin_iteration(int64_t iteration, int64_t world_size) noexcept {
  if (page_ == nullptr) return;
  const int64_t now = monotonic_ns();
  page_->world_size.store(world_size, std::memory_order_relaxed);
  page_->auto_progress_ns.store(now, std::memory_order_relaxed);
  page_->manual_progress_ns.store(now, std::memory_order_relaxed);
  page_->flags.fetch_and(~kManualArmed, std::memory_order_acq_rel);
  page_->iteration.store(iteration, std::memory_order_release);
}

HeartbeatSnapshot HeartbeatPage::snapshot() const {
  if (page_ == nullptr) throw std::runtime_error("heartbeat page is closed");
  HeartbeatSnapshot s{};
  s.pid = page_->pid;
  s.created_ns = page_->created_ns.load(std::memory_order_acquire);
  s.auto_progress_ns = page_->auto_progress_ns.load(std::memory_order_acquire);
  s.manual_progress_ns = page_->manual_progress_ns.load(std::memory_order_acquire);
  s.iteration = page_->iteration.load(std::memory_order_acquire);
  s.phase = page_->phase.load(std::memory_order_acquire);
  s.flags = page_->flags.load(std::memory_order_acquire);
  s.soft_timeout_ns = page_->soft_timeout_ns.load(std::memory_order_acquire);
  s.hard_timeout_ns = page_->hard_timeout_ns.load(std::memory_order_acquire);
  s.phase_since_ns = page_->phase_since_ns.load(std::memory_order_acquire);
  s.world_size = page_->world_size.load(std::memory_order_acquire);
  return s;
}

}  // namespace inprocess
