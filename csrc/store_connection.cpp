#include "store_connection.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "clock.hpp"

namespace inprocess {
namespace {

// Query types and answers of torch's TCPStore server (c10d::detail::QueryType), as in tcpstore_wire.py.
constexpr uint8_t kValidate = 0;
constexpr uint8_t kSet = 1;
constexpr uint8_t kCompareSet = 2;
constexpr uint8_t kGet = 3;
constexpr uint8_t kAdd = 4;
constexpr uint8_t kCheck = 5;
constexpr uint8_t kWait = 6;
constexpr uint8_t kAppend = 9;
constexpr uint8_t kCancelWait = 12;
constexpr uint8_t kPing = 13;
constexpr uint32_t kValidationMagic = 0x3C85F7CE;
constexpr uint8_t kCheckReady = 0;
constexpr uint8_t kCheckNotReady = 1;
constexpr uint8_t kStopWaiting = 0;
constexpr uint8_t kWaitCanceled = 1;
constexpr size_t kRecvChunk = 64 * 1024;
constexpr int64_t kNsPerSec = 1'000'000'000;

int64_t deadline_after_s(double seconds) {
  if (!(seconds < 9.2e9)) return INT64_MAX;
  return add_saturated(monotonic_ns(), static_cast<int64_t>(std::max(seconds, 0.0) * 1e9));
}

// Integers are little-endian on every platform torch ships for; this client
// writes them in the host's order, as torch's does.
template <class T>
void put(std::string& out, T value) {
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

void put_string(std::string& out, const std::string& raw) {
  put<uint64_t>(out, raw.size());
  out += raw;
}

void check_value(const std::string& value) {
  if (value.size() > StoreConnection::kMaxValueBytes) {
    throw StoreBadRequest("store value of " + std::to_string(value.size()) + " bytes: the server takes at most " +
                          std::to_string(StoreConnection::kMaxValueBytes));
  }
}

std::string describe(const char* op, const std::string& key) {
  return key.empty() ? std::string(op) : std::string(op) + "('" + key + "')";
}

}  // namespace

std::string encode_store_key(const std::string& key) {
  std::string raw = "/" + key;  // torch's client prefixes every key (tcpstore_wire.KEY_PREFIX)
  if (raw.size() > StoreConnection::kMaxKeyBytes) {
    throw StoreBadRequest("store key of " + std::to_string(raw.size()) + " bytes (with prefix): the server takes at most " +
                          std::to_string(StoreConnection::kMaxKeyBytes));
  }
  return raw;
}

StoreConnection::StoreConnection(std::string host, int port, double timeout_s, double connect_timeout_s,
                                 bool retry_refused)
    : host_(std::move(host)), port_(port), timeout_s_(timeout_s) {
  if (port < 1 || port > 65535) throw std::invalid_argument("port must be an integer in 1..65535, got " + std::to_string(port));
  if (!(timeout_s >= 0) || !(connect_timeout_s >= 0)) {
    throw std::invalid_argument("timeout and connect_timeout must be >= 0 seconds");
  }
  const int64_t deadline = deadline_after_s(connect_timeout_s);
  int64_t backoff_ms = 10;
  int attempts = 0;
  for (;;) {
    ++attempts;
    int error = 0;
    const int fd = connect_once(deadline, &error);
    if (fd >= 0) {
      try {
        handshake(fd, deadline);
      } catch (...) {
        ::close(fd);
        throw;
      }
      fd_ = fd;
      return;
    }
    const bool gone = error == ECONNREFUSED || error == ECONNRESET || error == ECONNABORTED;
    const bool retry = error == ETIMEDOUT || error == EAGAIN || error == EINTR || (gone && retry_refused);
    const int64_t remaining_ms = (deadline - monotonic_ns()) / 1'000'000;
    if (!retry || remaining_ms <= 0) {
      throw StoreClosed("cannot connect to the store server at " + address() + " within " +
                        std::to_string(connect_timeout_s) + "s (" + std::to_string(attempts) +
                        " attempt(s)): " + std::strerror(error));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, remaining_ms)));
    backoff_ms = std::min<int64_t>(backoff_ms * 2, 1000);
  }
}

StoreConnection::~StoreConnection() {
  if (fd_ >= 0) ::close(fd_);
}

std::string StoreConnection::address() const { return host_ + ":" + std::to_string(port_); }

bool StoreConnection::closed() const { return fd_ < 0; }

int StoreConnection::connect_once(int64_t deadline_ns, int* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port_);
  const int rc = ::getaddrinfo(host_.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) {
    throw StoreClosed("cannot resolve the store host '" + host_ + "' (" + address() + "): " + ::gai_strerror(rc));
  }
  *error = ECONNREFUSED;
  int fd = -1;
  for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      *error = errno;
      continue;
    }
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        *error = errno;
        ::close(fd);
        fd = -1;
        continue;
      }
      pollfd p{fd, POLLOUT, 0};
      int ready;
      do {
        const int64_t ms = std::max<int64_t>((deadline_ns - monotonic_ns()) / 1'000'000, 0);
        ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, INT32_MAX)));
      } while (ready < 0 && errno == EINTR);
      int so_error = 0;
      socklen_t len = sizeof(so_error);
      if (ready == 0) {
        so_error = ETIMEDOUT;
      } else if (ready < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0) {
        so_error = errno;
      }
      if (so_error != 0) {
        *error = so_error;
        ::close(fd);
        fd = -1;
        continue;
      }
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) return -1;
  // Blocking from now on: the kernel's timeouts bound each call, one system call per send or receive.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A zero timeval means "no timeout" to the kernel: never send one.
  const double seconds = std::max(timeout_s_, 0.001);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(std::min(seconds, 1e9));
  tv.tv_usec = static_cast<suseconds_t>((seconds - std::floor(seconds)) * 1e6);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

void StoreConnection::handshake(int fd, int64_t deadline_ns) {
  std::random_device rd;
  const uint32_t nonce = static_cast<uint32_t>(rd()) ^ static_cast<uint32_t>(::getpid());
  std::string hello;
  put<uint8_t>(hello, kValidate);
  put<uint32_t>(hello, kValidationMagic);
  put<uint8_t>(hello, kPing);
  put<uint32_t>(hello, nonce);
  if (::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
    throw StoreClosed("the store server at " + address() + " closed the connection in the handshake: " +
                      std::strerror(errno));
  }
  char reply[4];
  size_t have = 0;
  while (have < sizeof(reply)) {
    pollfd p{fd, POLLIN, 0};
    const int64_t ms = (deadline_ns - monotonic_ns()) / 1'000'000;
    const int ready = ms > 0 ? ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, INT32_MAX))) : 0;
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      throw StoreClosed("the store server at " + address() +
                        " did not complete the handshake in time (is a torch TCPStore server listening there?)");
    }
    const ssize_t got = ::recv(fd, reply + have, sizeof(reply) - have, 0);
    if (got <= 0) {
      throw StoreClosed("the store server at " + address() +
                        " closed the connection in the handshake (it is going away, or what listens there is not a "
                        "torch TCPStore server)");
    }
    have += static_cast<size_t>(got);
  }
  uint32_t echoed;
  std::memcpy(&echoed, reply, sizeof(echoed));
  if (echoed != nonce) {
    throw StoreProtocolViolation(address() + " answered the handshake with a wrong nonce: not a torch TCPStore server?");
  }
}

int64_t StoreConnection::reply_deadline() const { return deadline_after_s(timeout_s_); }

template <class Body>
auto StoreConnection::run(const char* op, const std::string& key, Body body) -> decltype(body()) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what = describe(op, key);
  if (fd_ < 0) {
    throw StoreClosed(what + ": the connection to the store at " + address() + " is closed (" + closed_because_ + ")");
  }
  try {
    return body();
  } catch (const StoreTimeout& e) {
    if (e.usable) throw;
    fail(what, e.what(), true);
  } catch (const StoreBadRequest&) {
    throw;  // nothing was sent
  } catch (const std::exception& e) {
    fail(what, e.what(), false);
  }
}

void StoreConnection::fail(const std::string& what, const std::string& why, bool timeout) {
  if (closed_because_.empty()) closed_because_ = what + " failed: " + why;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  rbuf_.clear();
  rpos_ = 0;
  const std::string message = what + ": the connection to the store at " + address() + " failed: " + why +
                              "; the connection is closed";
  if (timeout) throw StoreTimeout(message, false);
  throw StoreClosed(message);
}

void StoreConnection::send_all(const std::string& data, int64_t deadline_ns) {
  size_t sent = 0;
  while (sent < data.size()) {
    if (monotonic_ns() > deadline_ns) throw StoreTimeout("no reply in time", false);
    const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) throw StoreTimeout("the server took no data in time", false);
      throw StoreClosed(std::strerror(errno));
    }
    sent += static_cast<size_t>(n);
    sent_.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
  }
}

void StoreConnection::fill(int64_t deadline_ns) {
  if (monotonic_ns() > deadline_ns) throw StoreTimeout("no reply in time", false);
  if (rpos_ > 0 && rpos_ == rbuf_.size()) {
    rbuf_.clear();
    rpos_ = 0;
  }
  // Into a buffer kept for the connection's life: growing rbuf_ by a chunk would zero 64 KiB per receive.
  if (chunk_.empty()) chunk_.resize(kRecvChunk);
  ssize_t n;
  do {
    n = ::recv(fd_, chunk_.data(), chunk_.size(), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) throw StoreTimeout("no reply in time", false);
    throw StoreClosed(std::strerror(errno));
  }
  if (n == 0) {
    throw StoreClosed("the store server closed the connection (it went away, or it dropped a request it cannot "
                      "serve, e.g. add() on a value that is not an integer)");
  }
  rbuf_.append(chunk_.data(), static_cast<size_t>(n));
  received_.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
}

std::string StoreConnection::recv_exact(size_t n, int64_t deadline_ns) {
  while (rbuf_.size() - rpos_ < n) fill(deadline_ns);
  std::string out = rbuf_.substr(rpos_, n);
  rpos_ += n;
  if (rpos_ == rbuf_.size()) {
    rbuf_.clear();
    rpos_ = 0;
  }
  return out;
}

uint8_t StoreConnection::recv_byte(int64_t deadline_ns) { return static_cast<uint8_t>(recv_exact(1, deadline_ns)[0]); }

int64_t StoreConnection::recv_i64(int64_t deadline_ns) {
  const std::string raw = recv_exact(8, deadline_ns);
  int64_t value;
  std::memcpy(&value, raw.data(), sizeof(value));
  return value;
}

std::string StoreConnection::recv_vector(int64_t deadline_ns) {
  const std::string raw = recv_exact(8, deadline_ns);
  uint64_t size;
  std::memcpy(&size, raw.data(), sizeof(size));
  if (size > kMaxValueBytes * 64) {
    throw StoreProtocolViolation("a reply of " + std::to_string(size) + " bytes: not a torch TCPStore server?");
  }
  return recv_exact(static_cast<size_t>(size), deadline_ns);
}

int StoreConnection::recv_wait_answer(int64_t deadline_ns) {
  if (rbuf_.size() > rpos_) return recv_byte(deadline_ns);
  for (;;) {
    const int64_t remaining = deadline_ns - monotonic_ns();
    if (remaining <= 0) return -1;
    pollfd p{fd_, POLLIN, 0};
    const int64_t ms = (remaining + 999'999) / 1'000'000;
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, INT32_MAX)));
    if (ready < 0) {
      if (errno == EINTR) continue;  // retried with the time left
      throw StoreClosed(std::strerror(errno));
    }
    if (ready > 0) break;
  }
  fill(INT64_MAX);  // readable: does not block
  return recv_byte(INT64_MAX);
}

void StoreConnection::wait_exchange(const std::string& request, double timeout_s, const std::string& what) {
  const int64_t deadline = deadline_after_s(timeout_s);
  send_all(request, reply_deadline());
  int answer = recv_wait_answer(deadline);
  if (answer == kStopWaiting) return;
  if (answer >= 0) throw StoreProtocolViolation("unexpected wait answer " + std::to_string(answer));
  // Timed out: cancel on the server. A STOP_WAITING sent before the server
  // saw the cancel arrives first; the keys exist then.
  const int64_t cancel_deadline = reply_deadline();
  send_all(std::string(1, static_cast<char>(kCancelWait)), cancel_deadline);
  answer = recv_byte(cancel_deadline);
  const bool woke = answer == kStopWaiting;
  if (woke) answer = recv_byte(cancel_deadline);
  if (answer != kWaitCanceled) throw StoreProtocolViolation("expected WAIT_CANCELED, got " + std::to_string(answer));
  if (!woke) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.3g", timeout_s);
    throw StoreTimeout(what + ": the keys did not appear within " + seconds + "s (store " + address() + ")", true);
  }
}

// SET and APPEND: the same request (key, value), no reply.
void StoreConnection::send_key_value(uint8_t command, const char* op, const std::string& key,
                                     const std::string& value) {
  std::string request(1, static_cast<char>(command));
  put_string(request, encode_store_key(key));
  check_value(value);
  put_string(request, value);
  run(op, key, [&] { send_all(request, reply_deadline()); });
}

void StoreConnection::set(const std::string& key, const std::string& value) { send_key_value(kSet, "set", key, value); }

void StoreConnection::append(const std::string& key, const std::string& value) {
  send_key_value(kAppend, "append", key, value);
}

int64_t StoreConnection::add(const std::string& key, int64_t amount) {
  std::string request(1, static_cast<char>(kAdd));
  put_string(request, encode_store_key(key));
  put<int64_t>(request, amount);
  return run("add", key, [&] {
    const int64_t deadline = reply_deadline();
    send_all(request, deadline);
    return recv_i64(deadline);
  });
}

static void put_compare_set(std::string& out, const CompareSet& item) {
  out += static_cast<char>(kCompareSet);
  put_string(out, encode_store_key(item.key));
  check_value(item.expected);
  check_value(item.desired);
  put_string(out, item.expected);
  put_string(out, item.desired);
}

std::string StoreConnection::compare_set(const std::string& key, const std::string& expected,
                                         const std::string& desired) {
  std::string request;
  put_compare_set(request, CompareSet{key, expected, desired});
  return run("compare_set", key, [&] {
    const int64_t deadline = reply_deadline();
    send_all(request, deadline);
    return recv_vector(deadline);
  });
}

std::vector<std::string> StoreConnection::compare_set_many(const std::vector<CompareSet>& items) {
  std::vector<std::string> out;
  out.reserve(items.size());
  for (size_t start = 0; start < items.size(); start += kPipelineBatch) {
    const size_t end = std::min(items.size(), start + kPipelineBatch);
    std::string request;
    for (size_t i = start; i < end; ++i) put_compare_set(request, items[i]);
    run("compare_set_many", items[start].key, [&] {
      const int64_t deadline = reply_deadline();
      send_all(request, deadline);
      for (size_t i = start; i < end; ++i) out.push_back(recv_vector(deadline));
    });
  }
  return out;
}

static std::string key_list(const std::vector<std::string>& keys, const char* what) {
  if (keys.size() > StoreConnection::kMaxKeysPerRequest) {
    throw StoreBadRequest(std::string(what) + " of " + std::to_string(keys.size()) + " keys: the server takes at most " +
                          std::to_string(StoreConnection::kMaxKeysPerRequest));
  }
  std::string out;
  put<uint64_t>(out, keys.size());
  for (const auto& key : keys) put_string(out, encode_store_key(key));
  return out;
}

bool StoreConnection::check(const std::vector<std::string>& keys) {
  const std::string request = std::string(1, static_cast<char>(kCheck)) + key_list(keys, "check");
  return run("check", keys.empty() ? std::string() : keys.front(), [&] {
    const int64_t deadline = reply_deadline();
    send_all(request, deadline);
    const uint8_t answer = recv_byte(deadline);
    if (answer != kCheckReady && answer != kCheckNotReady) {
      throw StoreProtocolViolation("unexpected check answer " + std::to_string(answer));
    }
    return answer == kCheckReady;
  });
}

void StoreConnection::wait(const std::vector<std::string>& keys, double timeout_s) {
  const std::string request = std::string(1, static_cast<char>(kWait)) + key_list(keys, "wait");
  const std::string first = keys.empty() ? std::string() : keys.front();
  run("wait", first, [&] { wait_exchange(request, timeout_s, describe("wait", first)); });
}

std::string StoreConnection::wait_get(const std::string& key, double timeout_s) {
  const std::string packed = key_list({key}, "get");
  const std::string wait_request = std::string(1, static_cast<char>(kWait)) + packed;
  std::string get_request(1, static_cast<char>(kGet));
  put_string(get_request, encode_store_key(key));
  return run("get", key, [&] {
    wait_exchange(wait_request, timeout_s, describe("get", key));
    const int64_t deadline = reply_deadline();
    send_all(get_request, deadline);
    return recv_vector(deadline);
  });
}

void StoreConnection::close() {
  const int fd = fd_;
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);  // wakes a recv or poll blocked in another thread
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_because_.empty()) closed_because_ = "it was closed";
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  rbuf_.clear();
  rpos_ = 0;
}

}  // namespace inprocess
