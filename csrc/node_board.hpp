#pragma once

// The node board: one region of shared memory per node, through which the
// node agent and the training ranks of that node (and their monitor
// processes) exchange the restart control plane without a round trip to the
// central TCPStore. The agent posts the restart event, the leader of each
// barrier and the barrier's decision; each rank posts its arrival at a
// barrier. Every word is a lock-free atomic in the mapping, and waiters sleep
// on shared futexes, so a post wakes a waiter in another process directly.
//
// The board is a cache of the store, never the authority: a waiter that
// times out, or finds the board closed, falls back to the store.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

namespace inprocess {

constexpr uint64_t kBoardMagic = 0x696e626f61726403ULL;  // "inboard" + layout version 3
// Version 2 dropped the agent's heartbeat counter (nothing read it). Version 3
// gave each slot its seat (the agent takes the node's seats in one batch) and
// a refusal (a negative role).
constexpr uint32_t kBoardVersion = 3;

// Fixed binary layout of the board's first bytes (design principle 5: no
// pickle). The creator writes the plain fields before anyone can map the
// board; they never change afterwards. Futex words are 32-bit because the
// kernel compares and sleeps on 32 bits only.
struct BoardHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
  uint32_t decision_capacity;
  int32_t agent_pid;                      // the creator (the node agent)
  std::atomic<uint32_t> closed;           // 1 once the agent closed the board: waits return kClosed
  std::atomic<uint32_t> notice;           // futex: bumped by every post of the agent (event, role, decision, close)
  std::atomic<uint32_t> arrival;          // futex: bumped by every arrival (and by close)
  uint32_t reserved;
  std::atomic<int64_t> event;             // -1, else max over posts of 2 * iteration + complete
  std::atomic<uint64_t> decision_seq;     // seqlock over the decision: odd while a writer is inside
  std::atomic<int64_t> decision_barrier;  // -1 until a decision is posted
  std::atomic<int64_t> decision_length;   // bytes, or kDecisionOverflow
};

// One per training rank of the node (its local slot).
// Only healthy arrivals come through the board (a rank counted out arrives
// at the store directly), so an arrival carries the count its barrier waits
// for instead of a terminated bit: the agent forwards it without needing the
// previous decision.
// A rank that posts its seat with its arrival leaves the seat's compare_set
// to the agent, which sends the node's in one pipelined batch; a seat found
// counted out by someone else is answered with a refusal in `role`.
struct BoardSlot {
  std::atomic<int64_t> arrival;    // 0: never arrived; else (barrier + 1) << kExpectedBits | expected
  std::atomic<int64_t> role;       // 0: none; barrier + 1: this slot leads `barrier`;
                                   // -(barrier + 1): the agent could not take its seat at `barrier`
  std::atomic<int64_t> forwarded;  // 0: none; else barrier + 1: the agent counted this slot at `barrier`
  std::atomic<int64_t> seat;       // 0: the rank took its seat itself; else life << 32 | (initial rank + 1)
};

static_assert(std::is_standard_layout_v<BoardHeader> && std::is_standard_layout_v<BoardSlot>,
              "the board layout is a binary format");
static_assert(sizeof(BoardHeader) == 72 && sizeof(BoardSlot) == 32, "the board layout must not drift");
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == sizeof(uint32_t),
              "a futex word must be a plain 32-bit word");
static_assert(std::atomic<int64_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

// The seat a rank left to the agent with its arrival.
struct BoardSeat {
  int64_t initial_rank = 0;
  int64_t life = 0;
};

// A rank's arrival as read back from its slot.
struct BoardArrival {
  int64_t barrier = 0;
  int64_t expected = 0;  // ranks the barrier counts
};

constexpr int kExpectedBits = 24;  // up to 16,777,215 ranks per job

// The latest decision on the board. `overflow`: it did not fit in the board
// (data is empty); the reader takes it from the store.
struct BoardDecision {
  int64_t barrier = 0;
  bool overflow = false;
  std::string data;
};

// The board of one node: memfd, mode 0600, no name in /dev/shm. The agent
// creates it and hands the descriptor to the ranks it starts; a rank hands it
// on to its monitor process. Every process maps the same memory.
class NodeBoard {
 public:
  static constexpr int64_t kMinSlots = 1;
  static constexpr int64_t kMaxSlots = 65536;
  static constexpr int64_t kMinDecisionCapacity = 1024;
  static constexpr int64_t kMaxDecisionCapacity = int64_t{64} << 20;
  // The largest iteration or barrier whose encoded word (2 * (barrier + 1) + 1
  // at most) still fits in an int64.
  static constexpr int64_t kMaxIndex = (int64_t{1} << 62) - 2;
  static constexpr int64_t kDecisionOverflow = -2;
  // A deadline that never passes.
  static constexpr int64_t kNoDeadline = std::numeric_limits<int64_t>::max();

  // Results of the waits. Closure wins: on a closed board every wait returns
  // kClosed, even where its condition holds (the agent is gone, and what it
  // left on the board is no longer kept in step with the store).
  static constexpr int kRestart = 0;   // wait_event
  static constexpr int kComplete = 1;  // wait_event
  static constexpr int kLeader = 1;    // wait_outcome: the slot leads the barrier
  static constexpr int kDecided = 2;   // wait_outcome: a decision for the barrier (or a later one) is posted
  static constexpr int kRefused = 3;   // wait_outcome: the agent could not take the slot's seat
  static constexpr int kNews = 1;      // wait_news: a later decision or event is posted
  static constexpr int64_t kMaxInitialRank = (int64_t{1} << 31) - 2;
  static constexpr int64_t kMaxLife = (int64_t{1} << 30) - 1;
  static constexpr int kTimeout = -1;
  static constexpr int kClosed = -2;
  static constexpr int kInterrupted = -3;  // only with return_on_signal: a signal arrived (EINTR)

  // A fresh board; the caller's pid is recorded as the agent's. Throws
  // std::invalid_argument when an argument is out of range.
  static NodeBoard create(int64_t slots, int64_t decision_capacity);
  // Maps the board behind `fd` through a duplicate of it: the caller keeps
  // (and closes) its own descriptor. Throws std::invalid_argument when `fd`
  // holds no board of this version.
  static NodeBoard attach(int fd);

  NodeBoard(NodeBoard&& other) noexcept;
  NodeBoard& operator=(NodeBoard&& other) noexcept;
  NodeBoard(const NodeBoard&) = delete;
  NodeBoard& operator=(const NodeBoard&) = delete;
  ~NodeBoard();

  // A CLOCK_MONOTONIC deadline `timeout_ns` from now (negative: now); a
  // deadline beyond the int64 range is kNoDeadline.
  static int64_t deadline_after(int64_t timeout_ns) noexcept;

  int fd() const;  // -1 once unmapped
  bool mapped() const;
  uint32_t slots() const noexcept { return slots_; }
  uint32_t decision_capacity() const noexcept { return decision_capacity_; }
  int32_t agent_pid() const noexcept { return agent_pid_; }

  // Everything below throws std::runtime_error once unmapped,
  // std::out_of_range for a slot outside [0, slots) and std::invalid_argument
  // for an iteration or barrier outside [0, kMaxIndex].

  // Closed by the agent: every wait, in every process, returns kClosed.
  bool closed() const;
  void close();
  // Unmaps this process's view and closes its descriptor. A wait still
  // running in another thread keeps the memory mapped until it returns.
  void unmap() noexcept;

  // The event word never goes back: a post older than the word is ignored.
  void post_event(int64_t iteration, bool complete);
  int64_t event() const;
  // Until the event word reaches iteration `iteration`: kComplete if it says
  // this iteration completed, else kRestart (a later iteration exists only if
  // this one restarted); kTimeout at `deadline_ns`; kClosed.
  int wait_event(int64_t iteration, int64_t deadline_ns, bool return_on_signal = false) const;

  // `expected` in [1, 2^24): the number of ranks barrier `barrier` counts.
  // `initial_rank` >= 0 leaves the seat of that rank (in its life `life`) to
  // the agent; -1: the rank took its seat in the store itself.
  void arrive(int64_t slot, int64_t barrier, int64_t expected, int64_t initial_rank = -1, int64_t life = 0);
  std::optional<BoardArrival> slot_arrival(int64_t slot) const;
  // The seat posted with the slot's latest arrival; nullopt if the rank took it itself.
  std::optional<BoardSeat> slot_seat(int64_t slot) const;
  uint32_t arrival_seq() const;
  // Until the arrival sequence differs from `seen_seq` (in [0, 2^32)):
  // returns the new sequence; kTimeout; kClosed (even if the sequence moved).
  int64_t wait_arrivals(int64_t seen_seq, int64_t deadline_ns, bool return_on_signal = false) const;

  void set_leader(int64_t slot, int64_t barrier);
  // The barrier `slot` was named to lead, -1 if none.
  int64_t leads(int64_t slot) const;
  // The agent found the slot's seat taken (or not where it expected it) at
  // `barrier`: it did not count the slot; the rank looks at its seat itself.
  void refuse_seat(int64_t slot, int64_t barrier);
  // The agent records that its store count includes the slot's arrival at
  // `barrier`; a rank that finds the agent gone counts itself only if not.
  void mark_forwarded(int64_t slot, int64_t barrier);
  int64_t forwarded(int64_t slot) const;  // -1 if never
  // Posts the decision of `barrier`. Data larger than the capacity is not an
  // error: the board then records an overflow and readers go to the store.
  void post_decision(int64_t barrier, const void* data, size_t size);
  // A consistent snapshot of the latest decision; nullopt before the first.
  std::optional<BoardDecision> read_decision() const;
  // Until the agent refused `slot`'s seat at `barrier` (kRefused, checked
  // first), `slot` leads `barrier` (kLeader) or the posted decision is for
  // `barrier` or later (kDecided); kTimeout; kClosed.
  int wait_outcome(int64_t slot, int64_t barrier, int64_t deadline_ns, bool return_on_signal = false) const;
  // Until the posted decision's barrier exceeds `decision_after` or the event
  // word exceeds `event_after` (each >= -1: -1 is "nothing posted yet"):
  // kNews; kTimeout; kClosed. What a process waiting to join the job looks at
  // its record for: it is resolved only by a restart's leader, whose decision
  // follows, or by the job's end.
  int wait_news(int64_t decision_after, int64_t event_after, int64_t deadline_ns,
                bool return_on_signal = false) const;

  // The mapping and the views into it; shared with every wait in flight.
  struct Mapping;

 private:
  NodeBoard(int fd, std::shared_ptr<Mapping> mapping) noexcept;
  std::shared_ptr<Mapping> mapping() const;  // throws once unmapped

  mutable std::mutex mu_;  // guards fd_ and mapping_ against unmap() from another thread
  int fd_ = -1;
  std::shared_ptr<Mapping> mapping_;
  uint32_t slots_ = 0;
  uint32_t decision_capacity_ = 0;
  int32_t agent_pid_ = 0;
};

}  // namespace inprocess
