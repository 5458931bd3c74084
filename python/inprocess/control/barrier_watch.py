"""A rank waiting at a barrier says so, at INFO, every :data:`EVERY_S` while it waits.

A barrier that waits for a rank that never started, or that died where no monitor sees it, waits
``barrier_timeout`` (default minutes) before it fails, and until then nothing was logged: the job
looked hung. Installed on a rank's protocol connection (``CountingStore.watch``), a
:class:`BarrierWatch` is told when each wait begins and ends; a barrier's wait that lasts is
reported every :data:`EVERY_S` by a thread of its own (the wait itself is one blocking call on the
connection: cutting it into shorter chunks would make torch's client print a warning at every
chunk's end). The barrier's leader names the ranks it misses::

    barrier 0: 1 of 2 ranks arrived; missing initial rank 1; initial rank 0 waits (as leader), 75 s left

reading the count and the seats (1,024 per call, until 8 are named) over a connection of its own,
opened at its first report. The other ranks say that they wait, without a store call: a barrier
waited for by thousands of ranks costs the store nothing more.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("inprocess")

EVERY_S = 15.0
_BARRIER = re.compile(r"barrier (\d+)( \(leader\))?$")


@dataclasses.dataclass
class _Wait:
    barrier: int
    leads: bool
    deadline: float | None  # time.monotonic()
    due: float  # the next report


class BarrierWatch:
    """Reports a barrier wait that lasts; ``expected(barrier)`` is how many ranks the barrier counts.

    ``reader`` opens the connection the leader's reports read through (a
    :class:`~inprocess.control.protocol.RestartProtocol` of its own; None: no reads).
    """

    def __init__(self, initial_rank: int, expected: Callable[[int], int],
                 reader: Callable[[], Any] | None = None, every_s: float = EVERY_S):
        self.initial_rank = initial_rank
        self.expected = expected
        self.every_s = every_s
        self._reader = reader
        self._read: Any | None = None  # the leader's protocol over its own connection, once opened
        self._cond = threading.Condition()
        self._wait: _Wait | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._installed_on: Any | None = None  # the CountingStore it watches (on())
        self.reports = 0

    @classmethod
    def on(cls, protocol: Any, initial_rank: int, expected: Callable[[int], int]) -> BarrierWatch:
        """A watch of ``protocol``'s waits, installed on its connection (``CountingStore.watch``)."""

        def reader() -> Any:
            from .protocol import RestartProtocol  # not at import: the protocol module imports the store's

            pipe = protocol.counted.open_pipe()
            if pipe is None:
                raise RuntimeError("the store is not a TCPStore's client: its seats are not read")
            return RestartProtocol(pipe, protocol.call, initial_world_size=protocol.initial_world_size,
                                   incarnation=protocol.incarnation)

        watch = cls(initial_rank, expected, reader)
        protocol.counted.watch = watch
        watch._installed_on = protocol.counted
        return watch

    def begin(self, what: str, timeout: float | None) -> None:
        match = _BARRIER.match(what)
        if match is None:
            return
        now = time.monotonic()
        with self._cond:
            if self._closed:
                return
            self._wait = _Wait(int(match.group(1)), match.group(2) is not None,
                               None if timeout is None else now + timeout, now + self.every_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="inprocess-barrier-watch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def end(self) -> None:
        with self._cond:
            self._wait = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)
        # The protocol holds the watch and the watch's reader the protocol: the cycle would keep the
        # rank's connection open until a garbage collection (tests count descriptors).
        if self._installed_on is not None:
            self._installed_on.watch = None
        self._installed_on = self._reader = None
        read, self._read = self._read, None
        if read is not None:
            _close(read)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                wait = self._wait
                if wait is None:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                if now < wait.due:
                    self._cond.wait(wait.due - now)
                    continue
                wait.due = now + self.every_s
                self._cond.release()
                try:
                    self.report(wait)
                finally:
                    self._cond.acquire()

    def report(self, wait: _Wait) -> None:
        left = "" if wait.deadline is None else f", {max(wait.deadline - time.monotonic(), 0):.0f} s left"
        try:
            text = self.describe(wait.barrier, wait.leads)
        except Exception as e:  # the store is gone: the wait itself will say so
            text = f"barrier {wait.barrier}: the arrivals cannot be read ({type(e).__name__}: {e})"
        self.reports += 1
        log.info("%s; initial rank %d waits%s%s", text, self.initial_rank, " (as leader)" if wait.leads else "",
                 left)

    def describe(self, barrier: int, leads: bool) -> str:
        if not leads or self._reader is None:
            return f"barrier {barrier}: waiting for its decision"
        if self._read is None:
            self._read = self._reader()
        return str(self._read.describe_arrivals(barrier, self.expected(barrier)))


def _close(protocol: Any) -> None:
    close = getattr(protocol.store, "close", None)
    if close is not None:
        try:
            close()
        except Exception as e:
            log.debug("barrier watch: closing its connection: %s", e)
