#include "node_board.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <new>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "anonymous_memory.hpp"
#include "clock.hpp"

namespace inprocess {
namespace {

constexpr int64_t kNsPerSec = 1'000'000'000;
// The slots begin on a cache line of their own, past the header.
constexpr size_t kHeaderBytes = 128;
static_assert(sizeof(BoardHeader) <= kHeaderBytes, "the header must fit before the slots");
// A decision writer inside the seqlock for this long has died mid-write (a
// 64 MiB copy takes milliseconds): the board can no longer deliver decisions.
constexpr int64_t kWriterStallNs = 2 * kNsPerSec;
// What a wait's condition returns while it does not hold yet.
constexpr int64_t kPending = std::numeric_limits<int64_t>::min();

// The decision bytes are stored as 64-bit words, padded to a whole word.
size_t decision_words(uint64_t capacity) { return (capacity + 7) / 8; }

size_t board_bytes(uint64_t slots, uint64_t capacity) {
  return kHeaderBytes + slots * sizeof(BoardSlot) + decision_words(capacity) * sizeof(uint64_t);
}

std::system_error os_error(const std::string& what) {
  return std::system_error(errno, std::generic_category(), what);
}

// Shared futexes (no FUTEX_PRIVATE_FLAG): the kernel keys them by the
// physical page, so a wake in one process reaches sleepers in every process
// that maps the board.
long futex_wait(std::atomic<uint32_t>& word, uint32_t expected, const timespec* relative) noexcept {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, relative, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>& word) noexcept {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Every change a waiter may be sleeping for ends here: the bump makes a
// waiter that read the old value refuse to sleep, the wake rouses the rest.
void bump_and_wake(std::atomic<uint32_t>& word) noexcept {
  word.fetch_add(1, std::memory_order_release);
  futex_wake_all(word);
}

void check_index(const char* what, int64_t value) {
  if (value < 0 || value > NodeBoard::kMaxIndex) {
    throw std::invalid_argument(std::string(what) + " " + std::to_string(value) + " out of range [0, " +
                                std::to_string(NodeBoard::kMaxIndex) + "]");
  }
}

void check_slot(int64_t slot, uint32_t slots) {
  if (slot < 0 || slot >= slots) {
    throw std::out_of_range("slot " + std::to_string(slot) + " out of range [0, " + std::to_string(slots) + ")");
  }
}

// Sleeps on `word` until `ready(word value)` returns something other than
// kPending, the board is closed (checked first: closure wins) or the
// deadline passes. Spurious wake-ups, EINTR and a word that moved all end
// in the same re-check of the condition and of the time left.
template <class Ready>
int64_t wait_for(const BoardHeader& header, std::atomic<uint32_t>& word, int64_t deadline_ns, bool return_on_signal,
                 Ready ready) {
  for (;;) {
    // Read the word before the condition: a post that lands after this read
    // has bumped it, so the futex refuses to sleep rather than miss the wake.
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (header.closed.load(std::memory_order_acquire) != 0) return NodeBoard::kClosed;
    const int64_t result = ready(seen);
    if (result != kPending) return result;
    timespec relative{};
    timespec* timeout = nullptr;
    if (deadline_ns != NodeBoard::kNoDeadline) {
      // FUTEX_WAIT takes a relative CLOCK_MONOTONIC timeout: recomputed from
      // the fixed deadline on every round, so retries never extend it.
      const int64_t left = deadline_ns - monotonic_ns();
      if (left <= 0) return NodeBoard::kTimeout;
      relative.tv_sec = static_cast<time_t>(left / kNsPerSec);
      relative.tv_nsec = static_cast<long>(left % kNsPerSec);
      timeout = &relative;
    }
    if (futex_wait(word, seen, timeout) != 0) {
      switch (errno) {
        case EAGAIN:     // the word moved before we slept
        case ETIMEDOUT:  // judged above against the deadline: the kernel may round the timeout
          break;
        case EINTR:
          if (return_on_signal) return NodeBoard::kInterrupted;
          break;
        default:
          throw os_error("futex wait on the node board");
      }
    }
  }
}

// Between the retries of a seqlock: yields to the writer, and gives up when
// the same writer stays inside for kWriterStallNs.
class WriterStall {
 public:
  void wait(uint64_t odd_seq) {
    const int64_t now = monotonic_ns();
    if (odd_seq != seq_) {
      seq_ = odd_seq;
      since_ = now;
    } else if (now - since_ > kWriterStallNs) {
      throw std::runtime_error("node board: a decision writer has been mid-write for over " +
                               std::to_string(kWriterStallNs / kNsPerSec) +
                               " s (it died while posting?); read the decision from the store");
    }
    sched_yield();
  }

 private:
  uint64_t seq_ = 0;  // even: no writer seen yet
  int64_t since_ = 0;
};

// The decision bytes move as relaxed atomic words, not with memcpy: a reader
// copies while a writer may be writing, and the seqlock only discards a torn
// copy after the fact; the race itself must be on atomics to be defined.
// Relaxed word loads and stores compile to plain moves.
void copy_in(std::atomic<uint64_t>* words, const void* src, size_t size) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(src);
  const size_t full = size / 8;
  for (size_t i = 0; i < full; ++i) {
    uint64_t w;
    std::memcpy(&w, bytes + 8 * i, 8);
    words[i].store(w, std::memory_order_relaxed);
  }
  if (size % 8 != 0) {
    uint64_t w = 0;
    std::memcpy(&w, bytes + 8 * full, size % 8);
    words[full].store(w, std::memory_order_relaxed);
  }
}

void copy_out(const std::atomic<uint64_t>* words, char* dst, size_t size) noexcept {
  const size_t full = size / 8;
  for (size_t i = 0; i < full; ++i) {
    const uint64_t w = words[i].load(std::memory_order_relaxed);
    std::memcpy(dst + 8 * i, &w, 8);
  }
  if (size % 8 != 0) {
    const uint64_t w = words[full].load(std::memory_order_relaxed);
    std::memcpy(dst + 8 * full, &w, size % 8);
  }
}

}  // namespace

struct NodeBoard::Mapping {
  Mapping(void* b, size_t n, uint32_t slot_count) noexcept
      : base(b),
        bytes(n),
        header(static_cast<BoardHeader*>(b)),
        slots(reinterpret_cast<BoardSlot*>(static_cast<char*>(b) + kHeaderBytes)),
        // The words need no construction: std::atomic<uint64_t> is an
        // implicit-lifetime type, and the zero-filled memory is their initial
        // value. Writing them here would commit up to 64 MiB of pages that a
        // small decision never touches.
        data(reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(b) + kHeaderBytes +
                                                      slot_count * sizeof(BoardSlot))) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { munmap(base, bytes); }

  void* const base;
  const size_t bytes;
  BoardHeader* const header;
  BoardSlot* const slots;
  std::atomic<uint64_t>* const data;
};

namespace {

// Maps `bytes` of `fd` and wraps the mapping; on failure nothing stays mapped.
std::shared_ptr<NodeBoard::Mapping> map_board(int fd, size_t bytes, uint32_t slots) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw os_error("mmap(node board, " + std::to_string(bytes) + " bytes)");
  try {
    return std::make_shared<NodeBoard::Mapping>(base, bytes, slots);
  } catch (...) {
    munmap(base, bytes);
    throw;
  }
}

}  // namespace

NodeBoard::NodeBoard(int fd, std::shared_ptr<Mapping> mapping) noexcept : fd_(fd), mapping_(std::move(mapping)) {
  const BoardHeader& h = *mapping_->header;
  slots_ = h.slots;
  decision_capacity_ = h.decision_capacity;
  agent_pid_ = h.agent_pid;
}

NodeBoard NodeBoard::create(int64_t slots, int64_t decision_capacity) {
  if (slots < kMinSlots || slots > kMaxSlots) {
    throw std::invalid_argument("NodeBoard: slots " + std::to_string(slots) + " out of range [" +
                                std::to_string(kMinSlots) + ", " + std::to_string(kMaxSlots) + "]");
  }
  if (decision_capacity < kMinDecisionCapacity || decision_capacity > kMaxDecisionCapacity) {
    throw std::invalid_argument("NodeBoard: decision_capacity " + std::to_string(decision_capacity) +
                                " out of range [" + std::to_string(kMinDecisionCapacity) + ", " +
                                std::to_string(kMaxDecisionCapacity) + "] bytes");
  }
  const size_t bytes = board_bytes(static_cast<uint64_t>(slots), static_cast<uint64_t>(decision_capacity));
  std::string tried;
  int fd = create_anonymous_fd("inprocess-node-board", "/inprocess-board-", tried);
  if (fd < 0) throw os_error("shm_open(" + tried + ")");
  std::shared_ptr<Mapping> m;
  try {
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw os_error("ftruncate(node board)");
    m = map_board(fd, bytes, static_cast<uint32_t>(slots));
  } catch (...) {
    ::close(fd);
    throw;
  }
  // The memory is zero-filled; placement-new gives the atomics their
  // initial values. Nobody else can map it before create() returns.
  BoardHeader* h = new (m->header) BoardHeader{};
  h->magic = kBoardMagic;
  h->version = kBoardVersion;
  h->slots = static_cast<uint32_t>(slots);
  h->decision_capacity = static_cast<uint32_t>(decision_capacity);
  h->agent_pid = static_cast<int32_t>(getpid());
  h->event.store(-1);
  h->decision_barrier.store(-1);
  for (int64_t i = 0; i < slots; ++i) new (&m->slots[i]) BoardSlot{};
  return NodeBoard(fd, std::move(m));
}

NodeBoard NodeBoard::attach(int fd) {
  const std::string which = "fd " + std::to_string(fd);
  struct stat st {};
  if (fstat(fd, &st) != 0) throw os_error("fstat(node board " + which + ")");
  if (static_cast<uint64_t>(st.st_size) < sizeof(BoardHeader)) {
    throw std::invalid_argument(which + " is not a node board (size " + std::to_string(st.st_size) +
                                ", smaller than the " + std::to_string(sizeof(BoardHeader)) + "-byte header)");
  }
  // Only the fields written once by create() are read here, from a copy: the
  // size to map must be known and trusted before anything is mapped.
  unsigned char raw[sizeof(BoardHeader)];
  if (pread(fd, raw, sizeof(raw), 0) != static_cast<ssize_t>(sizeof(raw))) {
    throw os_error("pread(node board " + which + ")");
  }
  uint64_t magic;
  uint32_t version, slots, capacity;
  std::memcpy(&magic, raw + offsetof(BoardHeader, magic), sizeof(magic));
  std::memcpy(&version, raw + offsetof(BoardHeader, version), sizeof(version));
  std::memcpy(&slots, raw + offsetof(BoardHeader, slots), sizeof(slots));
  std::memcpy(&capacity, raw + offsetof(BoardHeader, decision_capacity), sizeof(capacity));
  if (magic != kBoardMagic) {
    throw std::invalid_argument(which + " holds no inprocess node board (bad magic)");
  }
  if (version != kBoardVersion) {
    throw std::invalid_argument(which + " holds a node board of version " + std::to_string(version) +
                                ", expected " + std::to_string(kBoardVersion));
  }
  if (slots < kMinSlots || slots > kMaxSlots || capacity < kMinDecisionCapacity || capacity > kMaxDecisionCapacity) {
    throw std::invalid_argument(which + " holds a corrupt node board header (slots " + std::to_string(slots) +
                                ", decision_capacity " + std::to_string(capacity) + ")");
  }
  const size_t bytes = board_bytes(slots, capacity);
  if (static_cast<uint64_t>(st.st_size) != bytes) {
    throw std::invalid_argument(which + " holds a node board of size " + std::to_string(st.st_size) + ", expected " +
                                std::to_string(bytes) + " for " + std::to_string(slots) + " slots and " +
                                std::to_string(capacity) + " decision bytes");
  }
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) throw os_error("dup(node board " + which + ")");
  try {
    return NodeBoard(own, map_board(own, bytes, slots));
  } catch (...) {
    ::close(own);
    throw;
  }
}

NodeBoard::NodeBoard(NodeBoard&& other) noexcept {
  std::lock_guard<std::mutex> lock(other.mu_);
  fd_ = std::exchange(other.fd_, -1);
  mapping_ = std::move(other.mapping_);
  slots_ = other.slots_;
  decision_capacity_ = other.decision_capacity_;
  agent_pid_ = other.agent_pid_;
}

NodeBoard& NodeBoard::operator=(NodeBoard&& other) noexcept {
  if (this != &other) {
    unmap();
    std::scoped_lock lock(mu_, other.mu_);
    fd_ = std::exchange(other.fd_, -1);
    mapping_ = std::move(other.mapping_);
    slots_ = other.slots_;
    decision_capacity_ = other.decision_capacity_;
    agent_pid_ = other.agent_pid_;
  }
  return *this;
}

NodeBoard::~NodeBoard() { unmap(); }

int64_t NodeBoard::deadline_after(int64_t timeout_ns) noexcept {
  // add_saturated yields INT64_MAX, which is kNoDeadline, when it overflows.
  return add_saturated(monotonic_ns(), std::max<int64_t>(0, timeout_ns));
}

int NodeBoard::fd() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fd_;
}

bool NodeBoard::mapped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapping_ != nullptr;
}

std::shared_ptr<NodeBoard::Mapping> NodeBoard::mapping() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (mapping_ == nullptr) throw std::runtime_error("node board is unmapped");
  return mapping_;
}

void NodeBoard::unmap() noexcept {
  std::shared_ptr<Mapping> last;
  int fd;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = std::move(mapping_);
    fd = std::exchange(fd_, -1);
  }
  if (fd >= 0) ::close(fd);
  // `last` unmaps here, unless a wait in another thread still holds the
  // mapping: then that wait unmaps it when it returns.
}

bool NodeBoard::closed() const {
  return mapping()->header->closed.load(std::memory_order_acquire) != 0;
}

void NodeBoard::close() {
  const std::shared_ptr<Mapping> m = mapping();
  BoardHeader& h = *m->header;
  // Stored before the bumps: a waiter that sees a bumped word also sees the flag.
  h.closed.store(1, std::memory_order_release);
  bump_and_wake(h.notice);
  bump_and_wake(h.arrival);
}

void NodeBoard::post_event(int64_t iteration, bool complete) {
  check_index("iteration", iteration);
  const std::shared_ptr<Mapping> m = mapping();
  BoardHeader& h = *m->header;
  const int64_t word = 2 * iteration + (complete ? 1 : 0);
  // A maximum, not a store: a late post of an older iteration (from a slow
  // relay of the store) must not take the event back.
  int64_t current = h.event.load(std::memory_order_relaxed);
  while (current < word &&
         !h.event.compare_exchange_weak(current, word, std::memory_order_release, std::memory_order_relaxed)) {
  }
  bump_and_wake(h.notice);
}

int64_t NodeBoard::event() const { return mapping()->header->event.load(std::memory_order_acquire); }

int NodeBoard::wait_event(int64_t iteration, int64_t deadline_ns, bool return_on_signal) const {
  check_index("iteration", iteration);
  const std::shared_ptr<Mapping> m = mapping();
  BoardHeader& h = *m->header;
  const int64_t restart_word = 2 * iteration;
  return static_cast<int>(wait_for(h, h.notice, deadline_ns, return_on_signal, [&](uint32_t) -> int64_t {
    const int64_t word = h.event.load(std::memory_order_acquire);
    if (word < restart_word) return kPending;
    return word == restart_word + 1 ? kComplete : kRestart;
  }));
}

void NodeBoard::arrive(int64_t slot, int64_t barrier, int64_t expected, int64_t initial_rank, int64_t life) {
  check_slot(slot, slots_);
  if (initial_rank < -1 || initial_rank > kMaxInitialRank) {
    throw std::invalid_argument("initial_rank " + std::to_string(initial_rank) + " out of range [-1, " +
                                std::to_string(kMaxInitialRank) + "]");
  }
  if (life < 0 || life > kMaxLife) {
    throw std::invalid_argument("life " + std::to_string(life) + " out of range [0, " + std::to_string(kMaxLife) +
                                "]");
  }
  if (barrier < 0 || barrier >= (int64_t{1} << (62 - kExpectedBits))) {
    throw std::invalid_argument("barrier " + std::to_string(barrier) + " out of range [0, " +
                                std::to_string((int64_t{1} << (62 - kExpectedBits)) - 1) + "]");
  }
  if (expected < 1 || expected >= (int64_t{1} << kExpectedBits)) {
    throw std::invalid_argument("expected " + std::to_string(expected) + " out of range [1, " +
                                std::to_string((int64_t{1} << kExpectedBits) - 1) + "]");
  }
  const std::shared_ptr<Mapping> m = mapping();
  // The seat before the arrival: the agent reads the arrival (acquire), then the seat.
  m->slots[slot].seat.store(initial_rank < 0 ? 0 : (life << 32) | (initial_rank + 1), std::memory_order_relaxed);
  m->slots[slot].arrival.store(((barrier + 1) << kExpectedBits) | expected, std::memory_order_release);
  bump_and_wake(m->header->arrival);
}

std::optional<BoardSeat> NodeBoard::slot_seat(int64_t slot) const {
  check_slot(slot, slots_);
  const int64_t word = mapping()->slots[slot].seat.load(std::memory_order_acquire);
  if (word == 0) return std::nullopt;
  return BoardSeat{(word & 0xffffffff) - 1, word >> 32};
}

void NodeBoard::refuse_seat(int64_t slot, int64_t barrier) {
  check_slot(slot, slots_);
  check_index("barrier", barrier);
  const std::shared_ptr<Mapping> m = mapping();
  m->slots[slot].role.store(-(barrier + 1), std::memory_order_release);
  bump_and_wake(m->header->notice);
}

std::optional<BoardArrival> NodeBoard::slot_arrival(int64_t slot) const {
  check_slot(slot, slots_);
  const int64_t word = mapping()->slots[slot].arrival.load(std::memory_order_acquire);
  if (word == 0) return std::nullopt;
  return BoardArrival{(word >> kExpectedBits) - 1, word & ((int64_t{1} << kExpectedBits) - 1)};
}

int64_t NodeBoard::leads(int64_t slot) const {
  check_slot(slot, slots_);
  const int64_t role = mapping()->slots[slot].role.load(std::memory_order_acquire);
  return role > 0 ? role - 1 : -1;
}

void NodeBoard::mark_forwarded(int64_t slot, int64_t barrier) {
  check_slot(slot, slots_);
  check_index("barrier", barrier);
  mapping()->slots[slot].forwarded.store(barrier + 1, std::memory_order_release);
}

int64_t NodeBoard::forwarded(int64_t slot) const {
  check_slot(slot, slots_);
  return mapping()->slots[slot].forwarded.load(std::memory_order_acquire) - 1;
}

uint32_t NodeBoard::arrival_seq() const { return mapping()->header->arrival.load(std::memory_order_acquire); }

int64_t NodeBoard::wait_arrivals(int64_t seen_seq, int64_t deadline_ns, bool return_on_signal) const {
  if (seen_seq < 0 || seen_seq > int64_t{UINT32_MAX}) {
    throw std::invalid_argument("seen_seq " + std::to_string(seen_seq) + " out of range [0, " +
                                std::to_string(UINT32_MAX) + "]");
  }
  const std::shared_ptr<Mapping> m = mapping();
  BoardHeader& h = *m->header;
  const uint32_t seen = static_cast<uint32_t>(seen_seq);
  return wait_for(h, h.arrival, deadline_ns, return_on_signal,
                  [&](uint32_t now) -> int64_t { return now != seen ? int64_t{now} : kPending; });
}

void NodeBoard::set_leader(int64_t slot, int64_t barrier) {
  check_slot(slot, slots_);
  check_index("barrier", barrier);
  const std::shared_ptr<Mapping> m = mapping();
  m->slots[slot].role.store(barrier + 1, std::memory_order_release);
  bump_and_wake(m->header->notice);
}

void NodeBoard::post_decision(int64_t barrier, const void* data, size_t size) {
  check_index("barrier", barrier);
  const std::shared_ptr<Mapping> m = mapping();
  BoardHeader& h = *m->header;
  // Enter the seqlock: even -> odd by CAS, so that two writers (the agent
  // has one, but nothing forbids more) never interleave their copies.
  WriterStall stall;
  uint64_t seq = h.decision_seq.load(std::memory_order_relaxed);
  for (;;) {
    if ((seq & 1) != 0) {
      stall.wait(seq);
      seq = h.decision_seq.load(std::memory_order_relaxed);
    } else if (h.decision_seq.compare_exchange_weak(seq, seq + 1, std::memory_order_acquire,
                                                    std::memory_order_relaxed)) {
      break;
    }
  }
  // No store below may become visible before the odd sequence; the release
  // store of the even one publishes them all.
  std::atomic_thread_fence(std::memory_order_release);
  h.decision_barrier.store(barrier, std::memory_order_relaxed);
  if (size > decision_capacity_) {
    h.decision_length.store(kDecisionOverflow, std::memory_order_relaxed);
  } else {
    h.decision_length.store(static_cast<int64_t>(size), std::memory_order_relaxed);
    copy_in(m->data, data, size);
  }
  h.decision_seq.store(seq + 2, std::memory_order_release);
  bump_and_wake(h.notice);
}

std::optional<BoardDecision> NodeBoard::read_decision() const {
  const std::shared_ptr<Mapping> m = mapping();
  const BoardHeader& h = *m->header;
  WriterStall stall;
  BoardDecision d;
  for (;;) {
    const uint64_t before = h.decision_seq.load(std::memory_order_acquire);
    if ((before & 1) != 0) {
      stall.wait(before);
      continue;
    }
    const int64_t barrier = h.decision_barrier.load(std::memory_order_relaxed);
    const int64_t length = h.decision_length.load(std::memory_order_relaxed);
    // A length that cannot be right (torn reads are discarded below; this is
    // a corrupt board) sends the reader to the store rather than past the
    // end of the mapping.
    const bool overflow = length < 0 || length > static_cast<int64_t>(decision_capacity_);
    d.data.resize(overflow ? 0 : static_cast<size_t>(length));
    if (barrier >= 0 && !overflow) copy_out(m->data, d.data.data(), d.data.size());
    // The copy's loads may not move past the re-check of the sequence.
    std::atomic_thread_fence(std::memory_order_acquire);
    if (h.decision_seq.load(std::memory_order_relaxed) != before) continue;
    if (barrier < 0) return std::nullopt;
    d.barrier = barrier;
    d.overflow = overflow;
    return d;
  }
}

int NodeBoard::wait_outcome(int64_t slot, int64_t barrier, int64_t deadline_ns, bool return_on_signal) const {
  check_slot(slot, slots_);
  check_index("barrier", barrier);
  const std::shared_ptr<Mapping> m = mapping();
  BoardHeader& h = *m->header;
  const BoardSlot& s = m->slots[slot];
  // The role first: when both hold (a decision for the barrier reached the
  // board, say relayed from the store, after the agent named this slot), the
  // slot must still learn that it was asked to lead.
  return static_cast<int>(wait_for(h, h.notice, deadline_ns, return_on_signal, [&](uint32_t) -> int64_t {
    const int64_t role = s.role.load(std::memory_order_acquire);
    if (role == -(barrier + 1)) return kRefused;
    if (role == barrier + 1) return kLeader;
    if (h.decision_barrier.load(std::memory_order_acquire) >= barrier) return kDecided;
    return kPending;
  }));
}

int NodeBoard::wait_news(int64_t decision_after, int64_t event_after, int64_t deadline_ns,
                         bool return_on_signal) const {
  if (decision_after < -1 || decision_after > kMaxIndex) {
    throw std::invalid_argument("decision_after " + std::to_string(decision_after) + " out of range [-1, " +
                                std::to_string(kMaxIndex) + "]");
  }
  if (event_after < -1 || event_after > 2 * kMaxIndex + 1) {
    throw std::invalid_argument("event_after " + std::to_string(event_after) + " out of range [-1, " +
                                std::to_string(2 * kMaxIndex + 1) + "]");
  }
  const std::shared_ptr<Mapping> m = mapping();
  BoardHeader& h = *m->header;
  return static_cast<int>(wait_for(h, h.notice, deadline_ns, return_on_signal, [&](uint32_t) -> int64_t {
    if (h.decision_barrier.load(std::memory_order_acquire) > decision_after) return kNews;
    if (h.event.load(std::memory_order_acquire) > event_after) return kNews;
    return kPending;
  }));
}

}  // namespace inprocess
