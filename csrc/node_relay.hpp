#pragma once

// A node agent's relay steps (python/inprocess/processes/node_agent.py,
// NodeRelay) in C++: the same store requests and the same board effects, each
// step one call that needs no Python. At 16,384 ranks a node agent's Python
// relay spends ~80 % of its CPU in the interpreter, not in the kernel.
//
// The relay does not know the protocol's key names or seat values: the
// protocol's Python code (control/protocol.py, control/leadership.py,
// control/seats.py) stays their one definition, and hands them over as
// templates (RelayLayout) that it computed by calling its own functions with
// marker numbers. python/inprocess/processes/native_relay.py builds them and
// checks, each time it builds them, that expanding them gives what the Python
// functions give.

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "node_board.hpp"
#include "store_connection.hpp"

namespace inprocess {

// A string with numbered holes: "{b}" barrier, "{p}" barrier - 1, "{r}" initial
// rank, "{l}" life, "{t}" term; anything else is kept as it is.
class KeyTemplate {
 public:
  KeyTemplate() = default;
  explicit KeyTemplate(const std::string& text);  // throws std::invalid_argument on an unknown hole
  struct Values {
    int64_t barrier = 0;
    int64_t rank = 0;
    int64_t life = 0;
    int64_t term = 0;
  };
  std::string expand(const Values& v) const;

 private:
  struct Part {
    std::string literal;
    char hole = 0;  // 0: none, else one of b p r l t
  };
  std::vector<Part> parts_;
};

// What the relay writes and reads, as the protocol defines it.
struct RelayLayout {
  KeyTemplate arrivals;          // RestartProtocol.key(b, "arrivals")
  KeyTemplate ready;             // RestartProtocol.key(b, "ready")
  std::string ready_value;       // what the batch that completes a count sets ready to
  KeyTemplate event;             // RestartProtocol.key(i, "event")
  std::string restart;           // the event's values
  std::string complete;
  // The key of seats Kg..Kg+K-1 (control/seat_table.py: SeatTable.key(g)), hole {r} = g.
  KeyTemplate seat;
  int64_t seats_per_key = 1;     // K: the call's (SeatTable.per_key)
  int64_t seat_attempts = 64;    // writes of one key before giving up (seat_table.attempts(K))
  std::string seat_separator;    // seat_table.SEPARATOR, between a key's seat values
  // A seat's move (RestartProtocol._seat_move): [first barrier][life 0].
  KeyTemplate seat_expected[2][2];
  KeyTemplate seat_desired[2][2];
  KeyTemplate outcome_first;     // Terms.outcome_key(b, 0)
  KeyTemplate outcome_later;     // Terms.outcome_key(b, t), t > 0
  std::string lost_mark;         // the prefix of a lost mark (leadership.LOST_MARK)
  int terminated_shift = 32;     // arrivals counter: healthy + (terminated << shift)
};

// More arrivals than the barrier counts (Python: inprocess.BarrierOverflow).
class RelayOverflow : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The agent was asked to stop while the relay waited (Python: inprocess.TimeoutError).
class RelayCancelled : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class NodeRelay {
 public:
  // `board` must outlive the relay (the bindings keep it alive).
  NodeRelay(NodeBoard& board, RelayLayout layout);

  // Asked between chunks of a wait; true: stop waiting (RelayCancelled).
  using Cancelled = std::function<bool()>;

  // NodeRelay.forward: returns how many arrivals were counted.
  int64_t forward(StoreConnection& store);
  // Shown each lost mark before it is posted; throws to refuse it (a corrupted mark).
  using MarkCheck = std::function<void(const std::string&)>;

  // NodeRelay.relay_decision: posts each lost mark and then the decision;
  // returns the decision as published.
  std::string relay_decision(StoreConnection& store, int64_t barrier, const Cancelled& cancelled, double chunk_s,
                             const MarkCheck& check_mark = {});
  // NodeRelay.relay_event: returns the event's value; posts it when it is restart or complete.
  std::string relay_event(StoreConnection& store, int64_t iteration, const Cancelled& cancelled, double chunk_s);

  int64_t adds() const noexcept { return adds_; }
  // Store calls made and what they were on the wire (a blocking get is WAIT + GET),
  // as CountingStore counts them.
  int64_t calls() const noexcept { return calls_; }
  int64_t requests() const noexcept { return requests_; }
  const std::vector<int64_t>& forwarded() const noexcept { return forwarded_; }
  void set_forwarded(std::vector<int64_t> forwarded);
  const RelayLayout& layout() const noexcept { return layout_; }

 private:
  std::string wait_get(StoreConnection& store, const std::string& key, const std::string& what,
                       const Cancelled& cancelled, double chunk_s);
  // What seat_table.SeatTable.compare_set_many does: each move (key index, slot, expected,
  // desired) answered with what its seat holds afterwards; one compare_set per key, pipelined.
  struct SeatMove {
    int64_t index;
    size_t slot;
    std::string expected;
    std::string desired;
  };
  std::vector<std::string> move_seats(StoreConnection& store, const std::vector<SeatMove>& moves);
  std::vector<std::string> decode_seats(int64_t index, const std::string& value) const;
  std::string encode_seats(const std::vector<std::string>& seats) const;

  NodeBoard& board_;
  RelayLayout layout_;
  std::vector<int64_t> forwarded_;  // the last barrier forwarded (or refused) per slot
  std::map<int64_t, std::string> seat_keys_;  // each seat key's value as last written or answered
  int64_t adds_ = 0;
  int64_t calls_ = 0;
  int64_t requests_ = 0;
};

}  // namespace inprocess
