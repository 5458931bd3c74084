"""A client of torch.distributed's TCPStore server in pure Python: no torch.

A monitor process needs the job's coordination store, which is the server of
``torch.distributed.TCPStore``; importing torch to reach it would cost a
monitor ~200 MB. :class:`TCPStoreClient` speaks the server's wire protocol
(:mod:`inprocess.control.tcpstore_wire`) over a plain socket and offers the
Store methods the restart engine uses (:mod:`inprocess.control.protocol`).
Torch's client and this one read each other's values: they address the same keys.

Deadlines (design principle 7): every blocking socket call is bounded. The
socket blocks with ``SO_RCVTIMEO``/``SO_SNDTIMEO`` set to ``timeout`` (one
system call per send or receive, as in torch's client; Python's own socket
timeouts cost a ``poll`` before each call), and an operation checks its
deadline, ``timeout`` after it started, between calls; so a reply comes
within ``timeout`` or the operation fails, within twice ``timeout`` at worst.
The connection's lock is waited for at most ``timeout`` too. ``wait`` polls
the socket until its own timeout, then cancels the wait on the server
(answer bounded by ``timeout``) and raises :class:`StoreTimeoutError`, a
``builtins.TimeoutError``; the connection stays usable. Any other failure in
the middle of an exchange (a reply that does not come in time, a connection
reset, an interrupt) leaves the byte stream in an unknown state, so the
connection is closed and every later call raises :class:`StoreConnectionError`
naming ``host:port``; open a new client (or :meth:`TCPStoreClient.clone`) to
go on.

Thread safety: one operation at a time per connection, like torch's client. A
``wait`` holds the connection for its whole duration: a thread that blocks on
the store should have its own client.

Differences from torch's client, on purpose: a ``wait`` whose keys appear
just as it times out returns instead of raising (the keys do exist); ``get``
of a missing key raises :class:`StoreTimeoutError` (torch raises
``DistStoreError``); a connection refused is retried with backoff until
``connect_timeout`` (torch retries until its ``timeout``), unless
``retry_refused=False``: a client of a server known to have been serving (a
helper process started after its rank connected) takes a refusal as the
server being gone, and fails at once.
"""

from __future__ import annotations

import builtins
import datetime
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from . import tcpstore_wire as wire
from .store_errors import (
    StoreConnectionError,
    StoreError,
    StoreHandshakeClosedError,
    StoreProtocolError,
    StoreTimeoutError,
)
from .tcpstore_connect import open_connection, set_socket_timeouts
from .tcpstore_wire import KEY_PREFIX, MAX_KEY_BYTES, MAX_KEYS_PER_REQUEST, MAX_VALUE_BYTES, Value

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["KEY_PREFIX", "MAX_KEY_BYTES", "MAX_KEYS_PER_REQUEST", "MAX_VALUE_BYTES", "PIPELINE_BATCH",
           "StoreConnectionError", "StoreError", "StoreHandshakeClosedError", "StoreProtocolError",
           "StoreTimeoutError", "TCPStoreClient"]

_RECV_CHUNK = 64 * 1024
#: compare_set_many's requests per round trip. A batch of this package's requests (keys and
#: values of at most a few hundred bytes: ~40-100 KiB) fits in the kernel's socket buffers even
#: while the server has stopped reading, so sending one never waits for this client to read.
PIPELINE_BATCH = 256
_POLL_MAX_MS = 2**31 - 1

Timeout = datetime.timedelta | float | int
_T = TypeVar("_T")


def _seconds(value: Timeout | None, name: str) -> float:
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a datetime.timedelta or a number of seconds, got {value!r}")
    if seconds < 0 or seconds != seconds:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return seconds


class _WaitTimedOut(Exception):
    """Internal: the wait was cancelled cleanly; the connection is still good."""


def _describe(op: str, key: object) -> str:
    if key is None:
        return op
    if isinstance(key, list):
        return f"{op}({key!r})" if len(key) <= 4 else f"{op}({len(key)} keys, first {key[0]!r})"
    return f"{op}({key!r})"


class TCPStoreClient:
    """One connection to a torch ``TCPStore`` server, without torch.

    ``timeout`` bounds every operation (and is the default timeout of
    ``wait`` and ``get``, like torch's store timeout); ``connect_timeout``
    bounds opening the connection, refused attempts being retried with
    backoff until then (``retry_refused=False``: a refusal fails at once, the
    server is gone). Timeouts are ``timedelta`` or seconds.
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: Timeout = datetime.timedelta(seconds=300),
        connect_timeout: Timeout = datetime.timedelta(seconds=60),
        retry_refused: bool = True,
    ):
        given: object = port  # checked at run time: callers are not all type-checked
        if not isinstance(given, int) or isinstance(given, bool) or not 0 < given < 65536:
            raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
        self.host = host
        self.port = port
        self._timeout = _seconds(timeout, "timeout")
        self._connect_timeout = _seconds(connect_timeout, "connect_timeout")
        self._retry_refused = retry_refused
        self._lock = threading.Lock()
        self._rbuf = bytearray()
        self._closed_because: str | None = None
        self._sock: socket.socket | None = self._connect()

    # -- public API ---------------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: Timeout) -> None:
        self._timeout = _seconds(timeout, "timeout")
        sock = self._sock
        if sock is not None:
            try:
                set_socket_timeouts(sock, self._timeout)
            except OSError:
                pass  # closed meanwhile: the next call says so

    def clone(self) -> TCPStoreClient:
        """A new connection to the same server, with the same timeouts."""
        return TCPStoreClient(self.host, self.port, self._timeout, self._connect_timeout, self._retry_refused)

    def set(self, key: str, value: Value) -> None:
        request = wire.encode_key_value(wire.SET, key, value)
        self._run("set", key, self._timeout, self._send, request)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it to exist up to the store timeout (like torch)."""
        return self.wait_get(key, self._timeout)

    def wait_get(self, key: str, timeout: Timeout) -> bytes:
        """The value of ``key``, waiting at most ``timeout`` for it to exist
        (:class:`StoreTimeoutError` after that); the store timeout still bounds each reply.

        ``get`` with a timeout of its own: a waiter that wakes every few seconds
        to look around needs no ``set_timeout`` (two system calls) per wait.
        """
        seconds = _seconds(timeout, "timeout")
        key_bytes = wire.encode_string(wire.encode_key(key))
        wait = bytes((wire.WAIT,)) + wire.U64.pack(1) + key_bytes
        request = bytes((wire.GET,)) + key_bytes

        def body(deadline: float) -> bytes:
            self._wait_exchange(wait, deadline, "get", key)
            reply_deadline = time.monotonic() + self._timeout
            self._send(request, reply_deadline)
            return self._recv_vector(reply_deadline)

        return self._run("get", key, seconds, body)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer stored at ``key`` (0 when missing); returns the sum."""
        given: object = amount  # checked at run time: callers are not all type-checked
        if not isinstance(given, int) or isinstance(given, bool) or not wire.I64_MIN <= given <= wire.I64_MAX:
            raise ValueError(f"add() takes a 64-bit signed integer, got {amount!r}")
        request = bytes((wire.ADD,)) + wire.encode_string(wire.encode_key(key)) + wire.I64.pack(amount)
        return self._run("add", key, self._timeout, self._request_i64, request)

    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the value of ``key`` (creating it when missing)."""
        request = wire.encode_key_value(wire.APPEND, key, value)
        self._run("append", key, self._timeout, self._send, request)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (see :mod:`.tcpstore_wire` for a missing key)."""
        request = wire.encode_compare_set(key, expected, desired)
        return self._run("compare_set", key, self._timeout, self._request_vector, request)

    def compare_set_many(self, items: Sequence[tuple[str, Value, Value]]) -> list[bytes]:
        """``compare_set(key, expected, desired)`` for each item, in order, pipelined.

        The requests go out together and their replies are read together:
        one round trip per :data:`PIPELINE_BATCH` items instead of one per
        item. The server runs a connection's requests in order, so the
        results are those of the same calls made one after another (each
        item's first-writer-wins against other clients included). Batches
        keep what is in flight small: a server that writes its replies with
        blocking sends (torch's legacy backend) and stops reading while this
        client's receive buffer is full cannot leave a batch half sent.
        """
        requests = [wire.encode_compare_set(key, expected, desired) for key, expected, desired in items]

        def body(deadline: float) -> list[bytes]:
            out: list[bytes] = []
            for start in range(0, len(requests), PIPELINE_BATCH):
                batch = requests[start:start + PIPELINE_BATCH]
                self._send(b"".join(batch), deadline)
                out.extend(self._recv_vectors(len(batch), deadline))
            return out

        return self._run("compare_set_many", [key for key, _, _ in items[:3]], self._timeout, body)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key exists, without waiting."""
        _, packed = wire.encode_key_list(keys, "check")
        request = bytes((wire.CHECK,)) + packed

        def body(deadline: float) -> bool:
            self._send(request, deadline)
            answer = self._recv_exact(1, deadline)[0]
            if answer == wire.CHECK_READY:
                return True
            if answer == wire.CHECK_NOT_READY:
                return False
            raise StoreProtocolError(f"check: unexpected answer {answer} from {self.address}")

        return self._run("check", None, self._timeout, body)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Block until every key exists; :class:`StoreTimeoutError` after ``timeout``.

        ``timeout`` defaults to the store timeout. The server wakes the wait
        when the keys are set: nothing is polled over the network.
        """
        seconds = self._timeout if timeout is None else _seconds(timeout, "timeout")
        keys, packed = wire.encode_key_list(keys, "wait")
        request = bytes((wire.WAIT,)) + packed
        self._run("wait", keys, seconds, lambda deadline: self._wait_exchange(request, deadline, "wait", keys))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        request = bytes((wire.DELETE_KEY,)) + wire.encode_string(wire.encode_key(key))
        return self._run("delete_key", key, self._timeout, self._request_i64, request) == 1

    def num_keys(self) -> int:
        """The number of keys on the server (all of them, whoever wrote them)."""
        return self._run("num_keys", None, self._timeout, self._request_i64, bytes((wire.GETNUMKEYS,)))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting for all of them up to the store timeout (like torch)."""
        keys, packed = wire.encode_key_list(keys, "multi_get")
        wait = bytes((wire.WAIT,)) + packed
        request = bytes((wire.MULTI_GET,)) + packed

        def body(deadline: float) -> list[bytes]:
            self._wait_exchange(wait, deadline, "multi_get", keys)
            reply_deadline = time.monotonic() + self._timeout
            self._send(request, reply_deadline)
            return [self._recv_vector(reply_deadline) for _ in keys]

        return self._run("multi_get", keys, self._timeout, body)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        keys, _ = wire.encode_key_list(keys, "multi_set")
        values = list(values)
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        parts = [bytes((wire.MULTI_SET,)), wire.U64.pack(len(keys))]
        for key, value in zip(keys, values, strict=True):
            parts.append(wire.encode_string(wire.encode_key(key)))
            parts.append(wire.encode_string(wire.encode_value(value)))
        self._run("multi_set", keys, self._timeout, self._send, b"".join(parts))

    def ping(self) -> float:
        """One round trip to the server; returns its duration in seconds."""
        nonce = int.from_bytes(os.urandom(4), "little")

        def body(deadline: float) -> float:
            start = time.monotonic()
            self._send(bytes((wire.PING,)) + wire.U32.pack(nonce), deadline)
            echoed = wire.U32.unpack(self._recv_exact(4, deadline))[0]
            if echoed != nonce:
                raise StoreProtocolError(f"ping: {self.address} echoed {echoed:#x} for nonce {nonce:#x}")
            return time.monotonic() - start

        return self._run("ping", None, self._timeout, body)

    def close(self) -> None:
        """Close the connection; an operation blocked in another thread fails at once."""
        sock = self._sock
        if self._closed_because is None:
            self._closed_because = "it was closed"
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes a recv or poll blocked in another thread
        except OSError:
            pass
        if self._lock.acquire(timeout=1.0):
            try:
                self._drop_socket()
            finally:
                self._lock.release()
        # else: the thread holding the lock fails on the shut socket and drops it.

    @property
    def closed(self) -> bool:
        return self._sock is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._sock is not None else f"closed ({self._closed_because})"
        return f"TCPStoreClient({self.address}, {state})"

    # -- connection -----------------------------------------------------------------

    def _connect(self) -> socket.socket:
        return open_connection(self.host, self.port, self._connect_timeout, self._timeout, self._retry_refused)

    def _drop_socket(self) -> None:
        """Close the socket; the caller holds the lock."""
        sock, self._sock = self._sock, None
        self._rbuf.clear()
        if sock is not None:
            sock.close()

    # -- one exchange -----------------------------------------------------------------

    def _run(self, op: str, key: object, seconds: float, body: Callable[..., _T], *args: Any) -> _T:
        """Run ``body(*args, deadline)`` alone on the connection.

        Any failure inside leaves the stream in an unknown state: the
        connection is closed and the failure reported with the address.
        """
        deadline = time.monotonic() + seconds
        if not self._lock.acquire(timeout=seconds):
            raise StoreTimeoutError(
                f"{_describe(op, key)}: the connection to {self.address} was busy with another "
                f"operation for {seconds:g}s"
            )
        try:
            if self._sock is None:
                raise StoreConnectionError(
                    f"{_describe(op, key)}: the connection to the store at {self.address} is closed "
                    f"({self._closed_because})"
                )
            try:
                return body(*args, deadline)
            except _WaitTimedOut as e:
                raise StoreTimeoutError(str(e)) from None
            except StoreError as e:
                self._fail(op, key, str(e))
                raise
            except (builtins.TimeoutError, BlockingIOError) as e:  # EAGAIN: SO_RCVTIMEO / SO_SNDTIMEO
                self._fail(op, key, "no reply in time")
                raise StoreTimeoutError(
                    f"{_describe(op, key)}: no reply from the store at {self.address} within "
                    f"{self._timeout:g}s; the connection is closed"
                ) from e
            except OSError as e:
                self._fail(op, key, str(e))
                if self._closed_because == "it was closed":
                    raise StoreConnectionError(
                        f"{_describe(op, key)}: the connection to {self.address} was closed") from e
                raise StoreConnectionError(
                    f"{_describe(op, key)}: the connection to the store at {self.address} failed: {e}"
                ) from e
            except BaseException as e:
                self._fail(op, key, f"interrupted by {type(e).__name__}")
                raise
        finally:
            self._lock.release()

    def _fail(self, op: str, key: object, why: str) -> None:
        if self._closed_because is None:
            self._closed_because = f"{_describe(op, key)} failed: {why}"
        self._drop_socket()

    def _send(self, data: bytes, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError("deadline passed")
        self._sock.sendall(data)  # type: ignore[union-attr]

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        buf = self._rbuf
        if len(buf) >= n:
            out = bytes(buf[:n])
            del buf[:n]
            return out
        sock = self._sock
        assert sock is not None
        if n > _RECV_CHUNK:
            # A large value: read straight into its own buffer.
            out_buf = bytearray(n)
            have = len(buf)
            out_buf[:have] = buf
            buf.clear()
            view = memoryview(out_buf)
            while have < n:
                if time.monotonic() > deadline:
                    raise TimeoutError("deadline passed")
                got = sock.recv_into(view[have:], n - have)
                if got == 0:
                    raise self._eof()
                have += got
            return bytes(out_buf)
        while len(buf) < n:
            self._fill(deadline)
        out = bytes(buf[:n])
        del buf[:n]
        return out

    def _eof(self) -> StoreConnectionError:
        if self._closed_because == "it was closed":
            return StoreConnectionError(f"the connection to {self.address} was closed")
        return StoreConnectionError(
            f"the store server at {self.address} closed the connection (it went away, or it dropped a "
            "request it cannot serve, e.g. add() on a value that is not an integer)"
        )

    def _recv_vector(self, deadline: float) -> bytes:
        size = wire.U64.unpack(self._recv_exact(8, deadline))[0]
        if size > MAX_VALUE_BYTES * 64:
            raise StoreProtocolError(f"a reply of {size} bytes from {self.address}: not a torch TCPStore server?")
        return self._recv_exact(size, deadline) if size else b""

    def _recv_vectors(self, count: int, deadline: float) -> list[bytes]:
        """``count`` replies of one pipelined batch, parsed where they lie in the buffer."""
        buf = self._rbuf
        out: list[bytes] = []
        pos = 0
        while len(out) < count:
            have = len(buf) - pos
            if have >= 8:
                size = wire.U64.unpack_from(buf, pos)[0]
                if size > _RECV_CHUNK:  # a large value: read the general way (which checks its size)
                    del buf[:pos]
                    pos = 0
                    out.append(self._recv_vector(deadline))
                    continue
                if have >= 8 + size:
                    out.append(bytes(buf[pos + 8:pos + 8 + size]))
                    pos += 8 + size
                    continue
            self._fill(deadline)
        del buf[:pos]
        return out

    def _fill(self, deadline: float) -> None:
        """Append what the socket has to the buffer (at least one byte)."""
        if time.monotonic() > deadline:
            raise TimeoutError("deadline passed")
        chunk = self._sock.recv(_RECV_CHUNK)  # type: ignore[union-attr]
        if not chunk:
            raise self._eof()
        self._rbuf += chunk

    def _request_vector(self, request: bytes, deadline: float) -> bytes:
        self._send(request, deadline)
        return self._recv_vector(deadline)

    def _request_i64(self, request: bytes, deadline: float) -> int:
        self._send(request, deadline)
        return int(wire.I64.unpack(self._recv_exact(8, deadline))[0])

    def _wait_exchange(self, request: bytes, deadline: float, op: str, key: object) -> None:
        """Send WAIT and read STOP_WAITING; past the deadline, cancel and raise _WaitTimedOut."""
        timeout = max(deadline - time.monotonic(), 0.0)
        self._send(request, time.monotonic() + self._timeout)
        answer = self._recv_wait_answer(deadline)
        if answer == wire.STOP_WAITING:
            return
        if answer is not None:
            raise StoreProtocolError(f"{_describe(op, key)}: unexpected wait answer {answer} from {self.address}")
        # Timed out: cancel on the server. A wire.STOP_WAITING sent before the
        # server saw the cancel arrives first; the keys exist then.
        cancel_deadline = time.monotonic() + self._timeout
        self._send(bytes((wire.CANCEL_WAIT,)), cancel_deadline)
        answer = self._recv_exact(1, cancel_deadline)[0]
        woke = answer == wire.STOP_WAITING
        if woke:
            answer = self._recv_exact(1, cancel_deadline)[0]
        if answer != wire.WAIT_CANCELED:
            raise StoreProtocolError(f"{_describe(op, key)}: expected WAIT_CANCELED from {self.address}, got {answer}")
        if not woke:
            raise _WaitTimedOut(
                f"{_describe(op, key)}: the keys did not appear within {timeout:.3g}s (store {self.address})"
            )

    def _recv_wait_answer(self, deadline: float) -> int | None:
        """The wait's answer byte, or None when the deadline passed first."""
        if self._rbuf:
            return self._recv_exact(1, deadline)[0]
        sock = self._sock
        assert sock is not None
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        while True:  # bounded: each round ends at the deadline or at most 24 days later
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # A signal interrupting poll() is retried with the time left (PEP 475).
            if poller.poll(min(math.ceil(remaining * 1000), _POLL_MAX_MS)):
                break
        chunk = sock.recv(_RECV_CHUNK)  # readable: does not block
        if not chunk:
            raise self._eof()
        self._rbuf += chunk
        return self._recv_exact(1, deadline)[0]
