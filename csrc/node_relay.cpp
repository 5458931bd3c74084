#include "node_relay.hpp"

#include <map>
#include <set>
#include <utility>

namespace inprocess {

KeyTemplate::KeyTemplate(const std::string& text) {
  Part part;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '{' && i + 2 < text.size() && text[i + 2] == '}') {
      const char hole = text[i + 1];
      if (hole != 'b' && hole != 'p' && hole != 'r' && hole != 'l' && hole != 't') {
        throw std::invalid_argument("key template '" + text + "': unknown hole {" + std::string(1, hole) + "}");
      }
      part.hole = hole;
      parts_.push_back(std::move(part));
      part = Part{};
      i += 2;
      continue;
    }
    part.literal += text[i];
  }
  parts_.push_back(std::move(part));
}

std::string KeyTemplate::expand(const Values& v) const {
  std::string out;
  for (const Part& part : parts_) {
    out += part.literal;
    switch (part.hole) {
      case 'b': out += std::to_string(v.barrier); break;
      case 'p': out += std::to_string(v.barrier - 1); break;
      case 'r': out += std::to_string(v.rank); break;
      case 'l': out += std::to_string(v.life); break;
      case 't': out += std::to_string(v.term); break;
      default: break;
    }
  }
  return out;
}

NodeRelay::NodeRelay(NodeBoard& board, RelayLayout layout)
    : board_(board), layout_(std::move(layout)), forwarded_(board.slots(), -1) {}

void NodeRelay::set_forwarded(std::vector<int64_t> forwarded) {
  if (forwarded.size() != forwarded_.size()) {
    throw std::invalid_argument("forwarded holds " + std::to_string(forwarded.size()) + " slots, the board has " +
                                std::to_string(forwarded_.size()));
  }
  forwarded_ = std::move(forwarded);
}

int64_t NodeRelay::forward(StoreConnection& store) {
  struct Batch {
    int64_t expected = 0;
    std::vector<int64_t> slots;
  };
  std::map<int64_t, Batch> batches;  // ordered: the oldest barrier first, as the Python relay
  const int64_t slots = board_.slots();
  for (int64_t slot = 0; slot < slots; ++slot) {
    const auto arrival = board_.slot_arrival(slot);
    if (!arrival || arrival->barrier <= forwarded_[slot]) continue;
    auto [it, fresh] = batches.try_emplace(arrival->barrier);
    if (fresh) it->second.expected = arrival->expected;
    it->second.slots.push_back(slot);
  }
  int64_t n = 0;
  for (auto& [barrier, batch] : batches) {
    std::vector<int64_t> wanted;
    std::vector<SeatMove> moves;
    for (int64_t slot : batch.slots) {
      const auto seat = board_.slot_seat(slot);
      if (!seat) continue;
      const bool first = barrier == 0;
      const bool life0 = seat->life == 0;
      const KeyTemplate::Values v{barrier, seat->initial_rank, seat->life, 0};
      wanted.push_back(slot);
      moves.push_back(SeatMove{seat->initial_rank / layout_.seats_per_key,
                               static_cast<size_t>(seat->initial_rank % layout_.seats_per_key),
                               layout_.seat_expected[first][life0].expand(v),
                               layout_.seat_desired[first][life0].expand(v)});
    }
    std::vector<bool> refused(static_cast<size_t>(slots), false);
    if (!moves.empty()) {
      const std::vector<std::string> values = move_seats(store, moves);
      for (size_t i = 0; i < wanted.size(); ++i) {
        if (values[i] != moves[i].desired) refused[static_cast<size_t>(wanted[i])] = true;
      }
    }
    std::vector<int64_t> counted;
    for (int64_t slot : batch.slots) {
      if (refused[static_cast<size_t>(slot)]) {
        forwarded_[slot] = barrier;
        board_.refuse_seat(slot, barrier);
      } else {
        counted.push_back(slot);
      }
    }
    if (counted.empty()) continue;
    const int64_t amount = static_cast<int64_t>(counted.size());
    const KeyTemplate::Values v{barrier, 0, 0, 0};
    ++calls_;
    ++requests_;
    const int64_t value = store.add(layout_.arrivals.expand(v), amount);
    const int64_t healthy = value & ((int64_t{1} << layout_.terminated_shift) - 1);
    const int64_t dead = value >> layout_.terminated_shift;
    if (healthy + dead > batch.expected) {
      throw RelayOverflow("barrier " + std::to_string(barrier) + ": " + std::to_string(healthy + dead) +
                          " arrivals, expected " + std::to_string(batch.expected));
    }
    if (healthy + dead == batch.expected) {
      ++calls_;
      ++requests_;
      store.set(layout_.ready.expand(v), layout_.ready_value);
    }
    ++adds_;
    if (healthy == amount) board_.set_leader(counted.front(), barrier);  // the barrier's first healthy arrivals
    for (int64_t slot : counted) {
      forwarded_[slot] = barrier;
      board_.mark_forwarded(slot, barrier);
    }
    n += amount;
  }
  return n;
}

std::vector<std::string> NodeRelay::decode_seats(int64_t index, const std::string& value) const {
  const auto n = static_cast<size_t>(layout_.seats_per_key);
  if (value.empty()) return std::vector<std::string>(n);
  std::vector<std::string> seats;
  size_t start = 0;
  for (;;) {
    const size_t end = value.find(layout_.seat_separator, start);
    seats.push_back(value.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + layout_.seat_separator.size();
  }
  if (seats.size() != n) {
    throw StoreProtocolViolation("seat key " + layout_.seat.expand(KeyTemplate::Values{0, index, 0, 0}) + " holds '" +
                                 value + "': expected " + std::to_string(n) + " seat values");
  }
  return seats;
}

std::string NodeRelay::encode_seats(const std::vector<std::string>& seats) const {
  std::string out;
  bool any = false;
  for (const std::string& seat : seats) any = any || !seat.empty();
  if (!any) return out;  // no seat written: as a missing key
  for (size_t i = 0; i < seats.size(); ++i) {
    if (i > 0) out += layout_.seat_separator;
    out += seats[i];
  }
  return out;
}

std::vector<std::string> NodeRelay::move_seats(StoreConnection& store, const std::vector<SeatMove>& moves) {
  const int64_t attempts = layout_.seat_attempts;
  std::vector<std::string> answers(moves.size());
  std::map<int64_t, std::vector<size_t>> pending;  // key index -> its moves not answered yet
  for (size_t n = 0; n < moves.size(); ++n) pending[moves[n].index].push_back(n);
  std::set<int64_t> answered;  // keys whose value the store answered in this call
  for (int64_t attempt = 0; attempt < attempts; ++attempt) {
    struct Write {
      int64_t index;
      std::string base;
      std::vector<size_t> made;
    };
    std::vector<Write> writes;
    std::vector<CompareSet> items;
    for (const auto& [index, which] : pending) {
      const auto known = seat_keys_.find(index);
      std::vector<std::string> seats = decode_seats(index, known == seat_keys_.end() ? std::string() : known->second);
      if (answered.count(index) == 0) {
        // Only the store's answer refuses a move: the first write expects every seat moved
        // where its move expects it, the key's other seats as last seen here.
        for (size_t n : which) seats[moves[n].slot] = moves[n].expected;
      }
      std::string base = encode_seats(seats);
      std::vector<size_t> made;
      for (size_t n : which) {
        const SeatMove& m = moves[n];
        std::string& held = seats[m.slot];
        if (held == m.expected && held != m.desired) {
          held = m.desired;
          made.push_back(n);
        } else {
          answers[n] = held;  // moved already, or refused: what the seat holds
        }
      }
      if (made.empty()) continue;
      items.push_back(CompareSet{layout_.seat.expand(KeyTemplate::Values{0, index, 0, 0}), base, encode_seats(seats)});
      writes.push_back(Write{index, std::move(base), std::move(made)});
    }
    if (items.empty()) return answers;
    calls_ += static_cast<int64_t>(items.size());
    requests_ += static_cast<int64_t>(items.size());
    const std::vector<std::string> values = store.compare_set_many(items);
    pending.clear();
    for (size_t w = 0; w < writes.size(); ++w) {
      const Write& write = writes[w];
      if (values[w] == items[w].desired) {
        seat_keys_[write.index] = items[w].desired;
        for (size_t n : write.made) answers[n] = moves[n].desired;
        continue;
      }
      // compare_set answers a missing key with the expected value itself.
      seat_keys_[write.index] = values[w] == write.base ? std::string() : values[w];
      answered.insert(write.index);
      pending[write.index] = write.made;
    }
  }
  throw StoreProtocolViolation("seat keys kept changing while the node's seats were moved (" +
                               std::to_string(attempts) + " writes)");
}

std::string NodeRelay::wait_get(StoreConnection& store, const std::string& key, const std::string& what,
                                const Cancelled& cancelled, double chunk_s) {
  for (;;) {
    calls_ += 1;
    requests_ += 2;  // WAIT + GET
    try {
      return store.wait_get(key, chunk_s);
    } catch (const StoreTimeout& e) {
      if (!e.usable) throw;
    }
    if (cancelled && cancelled()) throw RelayCancelled(what + ": cancelled (key " + key + ")");
  }
}

std::string NodeRelay::relay_decision(StoreConnection& store, int64_t barrier, const Cancelled& cancelled,
                                      double chunk_s, const MarkCheck& check_mark) {
  const std::string what = "barrier " + std::to_string(barrier);
  for (int64_t term = 0;; ++term) {
    const KeyTemplate::Values v{barrier, 0, 0, term};
    const std::string key = term == 0 ? layout_.outcome_first.expand(v) : layout_.outcome_later.expand(v);
    std::string raw = wait_get(store, key, what, cancelled, chunk_s);
    const bool mark = raw.compare(0, layout_.lost_mark.size(), layout_.lost_mark) == 0;
    if (mark && check_mark) check_mark(raw);
    // A lost mark is posted as it comes: the node's ranks that read it follow the terms at the store.
    board_.post_decision(barrier, raw.data(), raw.size());
    if (!mark) return raw;
  }
}

std::string NodeRelay::relay_event(StoreConnection& store, int64_t iteration, const Cancelled& cancelled,
                                   double chunk_s) {
  const KeyTemplate::Values v{iteration, 0, 0, 0};
  const std::string key = layout_.event.expand(v);
  std::string raw = wait_get(store, key, "iteration " + std::to_string(iteration) + " outcome", cancelled, chunk_s);
  if (raw == layout_.complete || raw == layout_.restart) board_.post_event(iteration, raw == layout_.complete);
  return raw;
}

}  // namespace inprocess
