#pragma once

// A blocking client connection to a torch.distributed TCPStore server, in C++:
// the same wire as the torch-free Python client
// (python/inprocess/control/tcpstore_client.py; the wire is described, with
// its sources in torch, in python/inprocess/control/tcpstore_wire.py). It
// exists so that a node agent's relay steps (node_relay.hpp) run without the
// GIL and without Python's per-call cost; it speaks exactly the requests the
// Python client speaks, so that either can serve the same protocol.
//
// Deadlines as in the Python client: the socket blocks with SO_RCVTIMEO /
// SO_SNDTIMEO set to `timeout`, and each operation checks its deadline between
// system calls. A wait polls until its own timeout, then cancels on the server
// and throws StoreTimeout: the connection stays usable. Any other failure in
// the middle of an exchange leaves the byte stream in an unknown state: the
// connection is closed and every later call throws StoreClosed.
//
// One operation at a time (a mutex), like torch's client: a thread that blocks
// on the store should have its own connection.

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace inprocess {

// The connection failed, was lost or was closed (Python: StoreConnectionError).
class StoreClosed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A wait ran out of time, or a reply did not come in time (Python: StoreTimeoutError).
// `usable`: the wait was cancelled cleanly on the server and the connection goes on.
class StoreTimeout : public std::runtime_error {
 public:
  StoreTimeout(const std::string& what, bool usable) : std::runtime_error(what), usable(usable) {}
  bool usable;
};

// The peer answered something a torch TCPStore server never sends (Python: StoreProtocolError).
class StoreProtocolViolation : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A request the server would drop the connection for (Python: ValueError), checked before sending.
class StoreBadRequest : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct CompareSet {
  std::string key;
  std::string expected;
  std::string desired;
};

class StoreConnection {
 public:
  // The libuv server's limits (torch's default server), as in tcpstore_wire.py.
  static constexpr size_t kMaxKeyBytes = 8 * 1024;  // with the "/" prefix
  static constexpr size_t kMaxValueBytes = 8 * 1024 * 1024;
  static constexpr size_t kMaxKeysPerRequest = 128 * 1024;
  // compare_set_many's requests per round trip: a batch of the protocol's
  // small requests fits in the kernel's socket buffers, so sending one never
  // waits for this client to read (the same figure as the Python client's PIPELINE_BATCH).
  static constexpr size_t kPipelineBatch = 256;

  // Connects and validates (VALIDATE + magic, then PING + nonce) within
  // `connect_timeout_s`. `retry_refused`: a refused connection is retried with
  // backoff until then; false: a refusal means the server is gone (fails at once).
  StoreConnection(std::string host, int port, double timeout_s, double connect_timeout_s, bool retry_refused);
  StoreConnection(const StoreConnection&) = delete;
  StoreConnection& operator=(const StoreConnection&) = delete;
  ~StoreConnection();

  const std::string& host() const noexcept { return host_; }
  int port() const noexcept { return port_; }
  std::string address() const;
  double timeout_s() const noexcept { return timeout_s_; }
  bool closed() const;

  void set(const std::string& key, const std::string& value);
  void append(const std::string& key, const std::string& value);
  int64_t add(const std::string& key, int64_t amount);
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired);
  // In order, pipelined kPipelineBatch at a time: one round trip per batch.
  std::vector<std::string> compare_set_many(const std::vector<CompareSet>& items);
  bool check(const std::vector<std::string>& keys);
  // Until every key exists; StoreTimeout (usable) after `timeout_s`.
  void wait(const std::vector<std::string>& keys, double timeout_s);
  // WAIT then GET: the value once the key exists; StoreTimeout (usable) after `timeout_s`.
  std::string wait_get(const std::string& key, double timeout_s);
  // Closes the connection; an operation blocked in another thread fails at once.
  void close();
  // Bytes of requests sent and of replies received since the handshake: a caller's measure of its traffic.
  uint64_t bytes_sent() const noexcept { return sent_.load(std::memory_order_relaxed); }
  uint64_t bytes_received() const noexcept { return received_.load(std::memory_order_relaxed); }

 private:
  int connect_once(int64_t deadline_ns, int* error);
  void handshake(int fd, int64_t deadline_ns);
  template <class Body>
  auto run(const char* op, const std::string& key, Body body) -> decltype(body());
  [[noreturn]] void fail(const std::string& what, const std::string& why, bool timeout);
  void send_key_value(uint8_t command, const char* op, const std::string& key, const std::string& value);
  void send_all(const std::string& data, int64_t deadline_ns);
  void fill(int64_t deadline_ns);
  std::string recv_exact(size_t n, int64_t deadline_ns);
  std::string recv_vector(int64_t deadline_ns);
  uint8_t recv_byte(int64_t deadline_ns);
  int64_t recv_i64(int64_t deadline_ns);
  // The wait's answer byte, or -1 when `deadline_ns` passed first.
  int recv_wait_answer(int64_t deadline_ns);
  void wait_exchange(const std::string& request, double timeout_s, const std::string& what);
  int64_t reply_deadline() const;

  std::string host_;
  int port_;
  double timeout_s_;
  std::mutex mu_;  // one operation at a time
  std::atomic<int> fd_{-1};  // atomic: close() shuts it from another thread
  std::string closed_because_;
  std::string rbuf_;  // bytes received and not consumed yet, from rpos_
  size_t rpos_ = 0;
  std::vector<char> chunk_;  // what one recv reads into
  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> received_{0};
};

// The wire encodings shared by the connection and its tests.
std::string encode_store_key(const std::string& key);

}  // namespace inprocess
