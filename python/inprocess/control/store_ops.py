"""The store as the restart protocol uses it: counted calls, and waits cut into chunks.

:class:`CountingStore` wraps one client connection (torch's TCPStore or
FileStore, :class:`inprocess.control.tcpstore_client.TCPStoreClient`, or
anything with their methods) and counts every call that reaches the store,
so that the protocol's logic carries no bookkeeping and the tests and the
simulator can check what a restart costs. :func:`wait_in_chunks` is the one
loop behind every wait with a deadline, on the store and on a node board.

This module imports no torch.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, overload

from ..exception import TimeoutError
from .tcpstore_client import TCPStoreClient

# Long waits are cut into chunks so that a cancelled waiter notices within one
# chunk; the fault itself wakes the waiter at once, whatever the chunk. Read at
# call time (tests shorten it).
WAIT_CHUNK_S = 300.0
# What compare_set returns for a key that does not exist, when it is both the
# expected and the desired value: it never matches a value the protocol writes.
ABSENT = "\x01"

T = TypeVar("T")
Value = str | bytes


def is_timeout(e: BaseException) -> bool:
    """A wait or blocking get that ran out of time.

    torch's TCPStore raises DistStoreError("wait timeout after ..."), its
    FileStore a plain RuntimeError ("Wait timeout", "Timeout waiting for key:
    ..."), the torch-free client a builtins.TimeoutError.
    """
    if isinstance(e, builtins.TimeoutError):
        return True
    name = type(e).__name__
    if name == "DistStoreError":
        return "timeout" in str(e).lower()
    if name == "RuntimeError":
        text = str(e)
        return text.startswith("Wait timeout") or text.startswith("Timeout waiting for key")
    return False


class Deadline:
    """When a wait of ``timeout`` seconds, started now, must end (None: never)."""

    __slots__ = ("timeout", "_at")

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self._at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        """Seconds left (negative once past), or None without a deadline."""
        return None if self._at is None else self._at - time.monotonic()


@overload
def wait_in_chunks(
    attempt: Callable[[float], T | None], deadline: Deadline, what: str, where: str, *,
    cancelled: Callable[[], bool] | None = ..., chunk_s: float | None = ..., go_on: None = ...,
) -> T: ...


@overload
def wait_in_chunks(
    attempt: Callable[[float], T | None], deadline: Deadline, what: str, where: str, *,
    cancelled: Callable[[], bool] | None = ..., chunk_s: float | None = ..., go_on: Callable[[], bool],
) -> T | None: ...


def wait_in_chunks(
    attempt: Callable[[float], T | None],
    deadline: Deadline,
    what: str,
    where: str,
    *,
    cancelled: Callable[[], bool] | None = None,
    chunk_s: float | None = None,
    go_on: Callable[[], bool] | None = None,
) -> T | None:
    """``attempt(seconds)`` (one wait of at most ``seconds`` that returns None
    when it ran out) until it returns a value, which is returned.

    Chunks last ``chunk_s`` (default :data:`WAIT_CHUNK_S`), the last one up to
    the deadline. Between chunks ``cancelled()`` is asked; before each chunk
    ``go_on()``, and once it says no the wait returns None (a node board whose
    agent went away). Raises :class:`inprocess.TimeoutError` naming ``what``
    and ``where`` past the deadline or when cancelled.
    """
    chunk = WAIT_CHUNK_S if chunk_s is None else chunk_s
    while go_on is None or go_on():
        remaining = deadline.remaining()
        seconds = chunk if remaining is None else min(chunk, remaining)
        if seconds <= 0:
            raise TimeoutError(f"{what}: no answer within {deadline.timeout:g}s ({where})")
        result = attempt(seconds)
        if result is not None:
            return result
        if cancelled is not None and cancelled():
            raise TimeoutError(f"{what}: cancelled ({where})")
    return None


class WaitWatch(Protocol):
    """What :attr:`CountingStore.watch` holds: told when a wait begins and when it ends."""

    def begin(self, what: str, timeout: float | None) -> None: ...

    def end(self) -> None: ...


@contextlib.contextmanager
def _watching(watch: WaitWatch | None, what: str, timeout: float | None) -> Iterator[None]:
    if watch is None:
        yield
        return
    watch.begin(what, timeout)
    try:
        yield
    finally:
        watch.end()


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class CountingStore:
    """One store connection, every call counted.

    ``calls`` counts the calls made through this adapter: each one reaches the
    store, also one that times out. ``requests`` counts what they are on the
    TCPStore wire, where a ``get`` is two requests (WAIT, then GET: torch's
    client and the torch-free one alike) and every other call one.

    Where a value must be waited for, :meth:`get_blocking` sends one blocking
    ``get`` (one call, WAIT + GET on the wire) instead of ``wait`` then ``get``
    (two calls, WAIT + WAIT + GET): the store's timeout, which bounds a
    ``get``, is set to the wait's chunk for that call and restored after it,
    so a cancelled waiter still notices within one chunk. This changes the
    timeout of the connection for the duration of the call: a connection given
    to this class is not shared with threads that rely on its timeout
    meanwhile. Values that exist already are read with one ``compare_set``
    that cannot change them (:meth:`peek`), not a ``get``.
    """

    def __init__(self, store: Any):
        self.raw = store
        self.calls = 0
        self.requests = 0
        # Told when each wait begins and ends (inprocess.control.barrier_watch logs the long ones).
        self.watch: WaitWatch | None = None

    def _count(self, requests: int = 1) -> None:
        self.calls += 1
        self.requests += requests

    # -- torch's Store methods, counted --------------------------------------

    def set(self, key: str, value: Value) -> None:
        self._count()
        self.raw.set(key, value)

    def get(self, key: str) -> bytes:
        self._count(2)
        return bytes(self.raw.get(key))

    def add(self, key: str, amount: int) -> int:
        self._count()
        return int(self.raw.add(key, amount))

    def append(self, key: str, value: Value) -> None:
        self._count()
        self.raw.append(key, value)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        self._count()
        return bytes(self.raw.compare_set(key, expected, desired))

    def check(self, keys: Sequence[str]) -> bool:
        self._count()
        return bool(self.raw.check(list(keys)))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None:
        self._count()
        self.raw.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        self._count()
        return bool(self.raw.delete_key(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, in one call. Only for keys that exist: like ``get``, torch's
        client waits for a missing one up to the store's timeout (WAIT, then MULTI_GET)."""
        self._count(2)
        return [bytes(v) for v in self.raw.multi_get(list(keys))]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._count()
        self.raw.multi_set(list(keys), list(values))

    def open_pipe(self) -> Any:
        """A connection of its own to this store's server, for :meth:`compare_set_many`; None
        unless the store is a client of a TCPStore server (torch's ``TCPStore`` or a
        :class:`~inprocess.control.tcpstore_client.TCPStoreClient`: a ``host`` and a ``port``,
        keys as they are; a ``PrefixStore`` has neither). One call: its handshake's round trip.
        The caller closes it."""
        host, port = getattr(self.raw, "host", None), getattr(self.raw, "port", None)
        if not isinstance(host, str) or type(port) is not int:
            return None
        timeout = getattr(self.raw, "timeout", None) or _td(300.0)
        self._count()
        return TCPStoreClient(host, port, timeout=timeout, connect_timeout=timeout, retry_refused=False)

    def compare_set_many(self, items: Sequence[tuple[str, Value, Value]], pipe: Any = None) -> list[bytes]:
        """``compare_set`` of each (key, expected, desired), in order; one call each.

        ``pipe``: a :class:`~inprocess.control.tcpstore_client.TCPStoreClient`
        of the same server, which sends them pipelined (one round trip); None:
        one after another on this connection.
        """
        if pipe is None:
            return [self.compare_set(key, expected, desired) for key, expected, desired in items]
        self.calls += len(items)
        self.requests += len(items)
        return [bytes(v) for v in pipe.compare_set_many(items)]

    # -- reads and waits built on them ----------------------------------------

    def peek(self, key: str) -> bytes | None:
        """The value of ``key`` without waiting, or None when it does not exist.

        One ``compare_set`` whose expected and desired values are the same
        absent-marker: it never changes an existing value and creates no key
        (a ``get`` would be two requests on the TCPStore wire). Not for a key
        that may be missing while somebody waits for it: on a missing key,
        torch 2.13's libuv server wakes the key's waiters, whose ``get`` then
        answers b"" (``check`` wakes nobody).
        """
        value = self.compare_set(key, ABSENT, ABSENT)
        return None if value == ABSENT.encode() else value

    def peek_awaited(self, key: str) -> bytes | None:
        """:meth:`peek` of a key that others may wait for: a ``check`` first, so that a missing key
        wakes nobody (one request more)."""
        return self.peek(key) if self.check([key]) else None

    def wait_key(
        self, key: str, timeout: float | None, what: str, *, cancelled: Callable[[], bool] | None = None
    ) -> None:
        """Block until ``key`` exists (the store wakes us: no polling)."""
        with _watching(self.watch, what, timeout):
            self._wait_key(key, timeout, what, cancelled=cancelled)

    def get_blocking(
        self, key: str, timeout: float | None, what: str, *, cancelled: Callable[[], bool] | None = None
    ) -> bytes:
        """The value of ``key`` once it exists: :meth:`_get_blocking`."""
        with _watching(self.watch, what, timeout):
            return self._get_blocking(key, timeout, what, cancelled=cancelled)

    def _wait_key(
        self, key: str, timeout: float | None, what: str, *, cancelled: Callable[[], bool] | None = None
    ) -> None:

        def attempt(seconds: float) -> bool | None:
            try:
                self.wait([key], _td(seconds))
                return True
            except Exception as e:
                if not is_timeout(e):
                    raise
                return None

        wait_in_chunks(attempt, Deadline(timeout), what, f"key {key}", cancelled=cancelled)

    def _get_blocking(
        self, key: str, timeout: float | None, what: str, *, cancelled: Callable[[], bool] | None = None
    ) -> bytes:
        """The value of ``key`` once it exists: one blocking ``get`` per chunk.

        Same contract as :meth:`wait_key` followed by a ``get``, one request
        fewer. A store without ``set_timeout`` gets ``wait`` then ``get``. A
        :class:`~inprocess.control.tcpstore_client.TCPStoreClient` waits each
        chunk with ``wait_get`` and keeps its timeout.
        """
        wait_get = getattr(self.raw, "wait_get", None)
        if wait_get is not None:

            def attempt_within(seconds: float) -> bytes | None:
                self._count(2)
                try:
                    return bytes(wait_get(key, seconds))
                except Exception as e:
                    if not is_timeout(e):
                        raise
                    return None

            return wait_in_chunks(attempt_within, Deadline(timeout), what, f"key {key}", cancelled=cancelled)
        set_timeout = getattr(self.raw, "set_timeout", None)
        if set_timeout is None:
            self._wait_key(key, timeout, what, cancelled=cancelled)
            return self.get(key)
        previous = self.raw.timeout

        def attempt(seconds: float) -> bytes | None:
            set_timeout(_td(seconds))
            try:
                return self.get(key)
            except Exception as e:
                if not is_timeout(e):
                    raise
                return None

        try:
            return wait_in_chunks(attempt, Deadline(timeout), what, f"key {key}", cancelled=cancelled)
        finally:
            set_timeout(previous)
