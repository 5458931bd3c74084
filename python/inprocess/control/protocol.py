"""The restart control plane: every store operation of a restart, in one place.

Built for 16,384 ranks against one TCPStore: per restart each rank makes O(1)
store operations of O(1) size (plus the decision, whose size grows with the
number of faults, not with the world size), no rank reads a per-rank list,
and nothing is polled. The same code drives the training ranks, the monitor
processes and the control-plane simulator in ``benchmarks/``.

Keys (all under ``inprocess/<call>/``, ``<call>`` counting the wrapped calls):

=====================  =====================================================
``<i>/event``          "restart" or "complete": the first writer wins
                       (compare_set); every rank blocks on it (wait)
``<i>/faults``         fault records of iteration i (JSON lines, append)
``<i>/completed``      counter of active ranks whose function returned
``<i>/arrivals``       barrier i counter: +1 per healthy rank, +2**32 per rank
                       arriving terminated (itself, or its monitor for it)
``<i>/ready``          set by whoever completes the count of barrier i
``<i>/terminated``     "r," per terminated initial rank (append)
``<i>/decision``       the membership of iteration i (JSON, written once)
``<i>/left``           counter of ranks that left after completion
``seat/<r>``           the last barrier initial rank r was counted at: "b"
                       (counted itself, healthy) or "tb:<who>" (counted out at
                       b, for good, by <who>); moved by compare_set only
``monitors/<r>``       heartbeat counter of rank r's monitor process
``topology``           per-rank keys for topology-aware assignments
``done``               set when the last rank left; the store host waits for it
=====================  =====================================================

Seats make every rank count exactly once per barrier, whoever counts it: the
rank itself, its monitor when it died, or a peer's monitor when it was lost.
Each moves the seat from "b-1" to "b" or "tb:<who>" with one compare_set, and
only the winner adds to the barrier's counter. compare_set answers with the
value the key holds afterwards, so every claimant writes a value only it can
write ("<who>": "self" for the rank, "m<r>" for the monitor of rank r): two
monitors that declare the same rank lost at once cannot both read their own
value back. A rank that finds its seat taken ("t...") was counted out by
someone else and leaves the job.

Barrier i (i = 0 is the initial barrier) decides the membership of iteration
i. Every arrival is one ``add`` that returns (healthy, terminated) so far. The
first healthy arriver is the leader; the arrival that completes the count
(healthy or not) sets ``ready``. The leader waits for ``ready``, reads the
terminated ranks (only if any) and the faults of iteration i-1, runs the rank
assignment once, writes the decision and deletes the keys of iteration i-1.
Only a healthy training rank can lead: a monitor process, arriving for a dead
rank, holds no rank assignment (and must not: no code crosses the store).

With node agents (:mod:`inprocess.processes.node_agent`), a rank's event and barrier
outcome come from its node's board instead: the agent waits for the event
and the decision once for the node and forwards the node's healthy arrivals
in one ``add`` per batch. The rank still takes its seat here, so counting
stays exactly-once against monitors, which always arrive directly.

This module imports no torch: monitor processes use it over a lightweight
store client. A store is anything with torch's Store methods.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import json
import logging
import socket
import time
from typing import Any, Callable, Iterable, Optional

from ..exception import InternalError, TimeoutError
from .membership import Membership

RESTART = "restart"
COMPLETE = "complete"
TERMINATED_UNIT = 1 << 32
COUNT_MASK = TERMINATED_UNIT - 1
MAX_FAULTS_IN_DECISION = 32
_NO_SEAT = "\x01"  # what compare_set returns for a seat key that does not exist yet
MAX_MESSAGE = 300
# Long waits are cut into chunks so that a cancelled waiter notices within one
# chunk; the fault itself wakes the waiter at once, whatever the chunk.
WAIT_CHUNK_S = 300.0
# How often a wait on a node board looks whether the node agent is still there.
NODE_POLL_S = 0.5

HOST = socket.gethostname()  # where a fault's CLOCK_MONOTONIC stamp is meaningful
log = logging.getLogger("inprocess")


def done_key(call: int) -> str:
    """Set when the last rank left call ``call``; the store host exits on it."""
    return f"inprocess/{call}/done"


def monitor_heartbeat_key(call: int, rank: int) -> str:
    """The counter the monitor of ``rank`` adds 1 to every heartbeat interval."""
    return f"inprocess/{call}/monitors/{rank}"


class SeatTaken(Exception):
    """This rank was counted out of the job by another process (its monitor, or
    a peer's monitor that declared it lost): it must leave without counting."""


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """What one rank reports about a fault it saw (plain data, no pickle)."""

    rank: int  # initial rank
    iteration: int
    kind: str  # "exception", "terminated", "health_check", "killed", ...
    type: str
    message: str
    host: str = HOST
    t_ns: int = 0  # CLOCK_MONOTONIC of the host above

    @classmethod
    def from_exception(cls, rank: int, iteration: int, kind: str, exc: BaseException) -> "FaultRecord":
        return cls(rank, iteration, kind, type(exc).__name__, str(exc)[:MAX_MESSAGE], HOST, time.monotonic_ns())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FaultRecord":
        return cls(
            int(d["rank"]), int(d["iteration"]), str(d["kind"]), str(d["type"]),
            str(d["message"]), str(d.get("host", "")), int(d.get("t_ns", 0)),
        )


@dataclasses.dataclass
class Decision:
    """The outcome of barrier i, identical on every rank."""

    iteration: int
    membership: Membership
    terminated: list[int]  # initial ranks terminated at this barrier
    faults: list[FaultRecord]  # up to MAX_FAULTS_IN_DECISION of iteration i-1
    n_faults: int
    leader: int
    abort: Optional[str] = None  # set when the job cannot go on
    t_ns: int = 0
    host: str = HOST
    assignment_ns: int = 0  # how long the rank assignment took on the leader

    def to_json(self) -> str:
        return json.dumps(
            {
                "i": self.iteration,
                "n": self.membership.initial_world_size,
                "ws": self.membership.world_size,  # lets a node agent see the job's end without decoding runs
                "runs": self.membership.encode(),
                "terminated": self.terminated,
                "faults": [dataclasses.asdict(f) for f in self.faults[:MAX_FAULTS_IN_DECISION]],
                "n_faults": self.n_faults,
                "leader": self.leader,
                "abort": self.abort,
                "t_ns": self.t_ns,
                "host": self.host,
                "assignment_ns": self.assignment_ns,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: bytes) -> "Decision":
        try:
            d = json.loads(raw)
            return cls(
                iteration=int(d["i"]),
                membership=Membership.decode(d["runs"], int(d["n"])),
                terminated=[int(r) for r in d["terminated"]],
                faults=[FaultRecord.from_dict(f) for f in d["faults"]],
                n_faults=int(d["n_faults"]),
                leader=int(d["leader"]),
                abort=d["abort"],
                t_ns=int(d["t_ns"]),
                host=str(d["host"]),
                assignment_ns=int(d.get("assignment_ns", 0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InternalError(f"corrupted decision record {raw[:200]!r}: {e}") from e


# The leader's computation: (terminated initial ranks, faults of i-1, leader) -> decision.
DecideFn = Callable[[set[int], list[FaultRecord], int], Decision]


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


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class RestartProtocol:
    """Store operations of the restart engine for one wrapped call.

    ``store`` is one client connection. Blocking waits occupy a connection, so
    a thread that blocks (the restart trigger) gets its own instance over its
    own connection.

    Requests: ``ops`` counts every store call made through this instance, i.e.
    every request that reaches the store as the client library sees it. On
    torch's TCPStore wire a ``get`` is two requests (WAIT, then GET), every
    other call one. Where a value must be waited for (the event, the
    decision) the protocol sends one blocking ``get`` (one op, WAIT + GET on
    the wire) instead of ``wait`` then ``get`` (two ops, WAIT + WAIT + GET):
    the store's timeout, which bounds a ``get``, is set to the wait's chunk
    for that call and restored after it, so a cancelled waiter still notices
    within one chunk. This changes the timeout of the store object for the
    duration of the call: a store given to this class is not shared with
    threads that rely on its timeout meanwhile. Values that exist already are
    read with one ``compare_set`` that cannot change them (``_peek``), not a
    ``get``.
    """

    def __init__(self, store: Any, call: int = 0, node: Any = None):
        self.store = store
        self.prefix = f"inprocess/{call}/"
        self.ops = 0  # store operations made through this instance
        # A rank's link to its node agent (inprocess.processes.node_agent.NodeLink), or None:
        # then the event and the barrier's outcome come from the board, and the
        # rank's healthy arrival goes there. Without it (or once the agent is
        # gone) everything goes to the store directly.
        self.node = node

    # -- keys ---------------------------------------------------------------

    def key(self, iteration: int, name: str) -> str:
        return f"{self.prefix}{iteration}/{name}"

    def job_key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    # -- primitive waits ----------------------------------------------------

    def wait_key(
        self,
        key: str,
        timeout: Optional[float],
        what: str,
        cancelled: Optional[Callable[[], bool]] = None,
    ) -> None:
        """Block until ``key`` exists (the store wakes us: no polling)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            chunk = WAIT_CHUNK_S if deadline is None else min(WAIT_CHUNK_S, deadline - time.monotonic())
            if chunk <= 0:
                raise TimeoutError(f"{what}: no answer within {timeout:g}s (key {key})")
            try:
                self.ops += 1
                self.store.wait([key], _td(chunk))
                return
            except Exception as e:
                if not is_timeout(e):
                    raise
                if cancelled is not None and cancelled():
                    raise TimeoutError(f"{what}: cancelled (key {key})") from None

    def get_blocking(
        self,
        key: str,
        timeout: Optional[float],
        what: str,
        cancelled: Optional[Callable[[], bool]] = None,
    ) -> bytes:
        """The value of ``key`` once it exists: one blocking ``get`` per chunk.

        Same contract as :meth:`wait_key` followed by a ``get`` (the store
        wakes the caller, long waits are cut into chunks of at most
        ``WAIT_CHUNK_S`` and ``cancelled`` is asked between them), one request
        fewer. A store without ``set_timeout`` gets ``wait`` then ``get``.
        """
        store = self.store
        set_timeout = getattr(store, "set_timeout", None)
        if set_timeout is None:
            self.wait_key(key, timeout, what, cancelled)
            self.ops += 1
            return store.get(key)
        previous = store.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                chunk = WAIT_CHUNK_S if deadline is None else min(WAIT_CHUNK_S, deadline - time.monotonic())
                if chunk <= 0:
                    raise TimeoutError(f"{what}: no answer within {timeout:g}s (key {key})")
                set_timeout(_td(chunk))
                try:
                    self.ops += 1
                    return store.get(key)
                except Exception as e:
                    if not is_timeout(e):
                        raise
                    if cancelled is not None and cancelled():
                        raise TimeoutError(f"{what}: cancelled (key {key})") from None
        finally:
            set_timeout(previous)

    def _peek(self, key: str) -> Optional[bytes]:
        """The value of ``key`` without waiting, or None when it does not exist.

        One ``compare_set`` whose expected and desired values are the same
        absent-marker: it never changes an existing value and creates no key
        (a ``get`` would be two requests on the TCPStore wire).
        """
        self.ops += 1
        value = self.store.compare_set(key, _NO_SEAT, _NO_SEAT)
        return None if value == _NO_SEAT.encode() else bytes(value)

    # -- faults and the event -----------------------------------------------

    def record_fault(self, record: FaultRecord) -> None:
        self.ops += 1
        self.store.append(self.key(record.iteration, "faults"), record.to_json() + "\n")

    def _set_event(self, iteration: int, outcome: str) -> str:
        key = self.key(iteration, "event")
        self.ops += 2
        value = self.store.compare_set(key, "", outcome).decode()
        # torch 2.13's legacy (non-libuv) server wakes no waiter on compare_set;
        # an empty append wakes them on both backends and changes nothing.
        self.store.append(key, "")
        return value

    def request_restart(self, iteration: int) -> bool:
        """Returns False when the iteration had completed already."""
        return self._set_event(iteration, RESTART) == RESTART

    def restart_requested(self, iteration: int) -> bool:
        self.ops += 1
        return bool(self.store.check([self.key(iteration, "event")]))

    def report_fault(self, record: FaultRecord) -> bool:
        self.record_fault(record)
        return self.request_restart(record.iteration)

    def wait_event(
        self,
        iteration: int,
        timeout: Optional[float],
        cancelled: Optional[Callable[[], bool]] = None,
        only_restart: Optional[Callable[[], bool]] = None,
    ) -> str:
        """The event of ``iteration``, once it is set.

        ``only_restart()``, asked once the key exists, says whether the event
        can only be "restart": true for an active rank that has not counted
        itself completed, since "complete" needs every active rank's count.
        Then the value is not read: one ``wait`` (one request on the wire)
        instead of a blocking ``get`` (two).
        """
        key = self.key(iteration, "event")
        what = f"iteration {iteration} outcome"
        if self.node is not None:
            value = self._wait_event_on_board(iteration, timeout, what, cancelled)
            if value is not None:
                return value
        if only_restart is not None:
            self.wait_key(key, timeout, what, cancelled)
            if only_restart():
                return RESTART
            self.ops += 1
            value = self.store.get(key).decode()
        else:
            value = self.get_blocking(key, timeout, what, cancelled).decode()
        if value not in (RESTART, COMPLETE):
            raise InternalError(f"iteration {iteration} event holds {value!r}, expected {RESTART!r} or {COMPLETE!r}")
        return value

    def _wait_event_on_board(
        self, iteration: int, timeout: Optional[float], what: str, cancelled: Optional[Callable[[], bool]]
    ) -> Optional[str]:
        """The event as the node agent posted it; None once the agent is gone."""
        node = self.node
        deadline = None if timeout is None else time.monotonic() + timeout
        while node.alive():
            chunk = NODE_POLL_S if deadline is None else min(NODE_POLL_S, deadline - time.monotonic())
            if chunk <= 0:
                raise TimeoutError(f"{what}: no answer within {timeout:g}s (node board)")
            outcome = node.board.wait_event(iteration, chunk)
            if outcome >= 0:
                return COMPLETE if outcome == 1 else RESTART
            if cancelled is not None and cancelled():
                raise TimeoutError(f"{what}: cancelled (node board)")
        return None

    def arrive_completed(self, iteration: int, active_world_size: int) -> None:
        self.ops += 1
        count = self.store.add(self.key(iteration, "completed"), 1)
        if count == active_world_size:
            self._set_event(iteration, COMPLETE)

    # -- barrier ------------------------------------------------------------

    def seat_key(self, initial_rank: int) -> str:
        return f"{self.prefix}seat/{initial_rank}"

    def take_seat(self, iteration: int, initial_rank: int, terminated: bool) -> bool:
        """Move the rank's seat from barrier ``iteration - 1`` to ``iteration``.

        False when somebody else counted the rank out already ("t..."): the
        rank must not count itself.
        """
        desired = f"t{iteration}:self" if terminated else str(iteration)
        previous = "" if iteration == 0 else str(iteration - 1)
        self.ops += 1
        value = self.store.compare_set(self.seat_key(initial_rank), previous, desired).decode()
        if value == desired:
            return True
        if value.startswith("t"):
            return False
        # compare_set answers a missing key with the expected value itself.
        held = "nothing" if value == previous else repr(value)
        raise InternalError(f"barrier {iteration}: seat of rank {initial_rank} holds {held}, expected {previous!r}")

    def read_seat(self, initial_rank: int) -> Optional[str]:
        """The seat's value, or None if the rank never arrived anywhere."""
        self.ops += 1
        value = self.store.compare_set(self.seat_key(initial_rank), _NO_SEAT, _NO_SEAT).decode()
        return None if value == _NO_SEAT else value

    def count_out(
        self,
        initial_rank: int,
        fault: Callable[[int], FaultRecord],
        expected_at: Callable[[int], Optional[int]],
        timeout: float,
        who: str,
    ) -> Optional[int]:
        """Count ``initial_rank`` out of the job on its behalf (it died, or was lost).

        ``who`` names the caller uniquely among everybody who may count this
        rank out ("m<r>" for the monitor of rank r): the seat records it, and
        only the caller that reads its own name back won the seat.

        At the first barrier it has not been counted at: ``fault(i)`` is
        recorded for iteration i = barrier - 1 and its restart requested;
        ``expected_at(b)`` is the number of ranks barrier b counts, or None when
        the rank is not a member there (nothing to do). Returns the barrier, or
        None when somebody else counted the rank out, or it is no member, or the
        iteration had completed (then this leaves on the rank's behalf).
        """
        for _ in range(64):
            seat = self.read_seat(initial_rank)
            if seat is not None and seat.startswith("t"):
                return None
            barrier = 0 if seat is None else int(seat) + 1
            expected = expected_at(barrier)
            if expected is None:
                return None
            self.ops += 1
            claim = f"t{barrier}:{who}"
            if self.store.compare_set(self.seat_key(initial_rank), seat or "", claim).decode() != claim:
                continue  # the rank (or another declarer) moved the seat meanwhile: look again
            if barrier > 0:
                self.record_fault(fault(barrier - 1))
                if not self.request_restart(barrier - 1):
                    self.leave(barrier - 1, expected)
                    return None
            self.barrier(barrier, initial_rank, expected, True, None, timeout, seat_taken=True)
            return barrier
        raise InternalError(f"rank {initial_rank}: its seat kept moving while it was counted out")

    def arrive(
        self, iteration: int, initial_rank: int, expected: int, terminated: bool, seat_taken: bool = False
    ) -> tuple[int, int, bool]:
        """Count this rank in at barrier ``iteration``: its seat, then one ``add``.

        Returns (healthy, terminated, complete) as of this arrival. ``expected``
        is the number of ranks that must arrive (every rank of the previous
        membership). The arrival that completes the count sets ``ready``.
        Raises :class:`SeatTaken` when somebody counted this rank out already.
        """
        if not seat_taken and not self.take_seat(iteration, initial_rank, terminated):
            raise SeatTaken(f"initial rank {initial_rank} was counted out of barrier {iteration} by another process")
        if terminated:
            self.ops += 1
            self.store.append(self.key(iteration, "terminated"), f"{initial_rank},")
        healthy, dead, complete = self._add_arrivals(iteration, TERMINATED_UNIT if terminated else 1, expected)
        if complete and not (healthy == 1 and not terminated):
            self._set_ready(iteration)
        return healthy, dead, complete

    def _add_arrivals(self, iteration: int, amount: int, expected: int) -> tuple[int, int, bool]:
        """One ``add`` to barrier ``iteration``'s counter: (healthy, terminated, complete) after it."""
        self.ops += 1
        value = self.store.add(self.key(iteration, "arrivals"), amount)
        healthy, dead = value & COUNT_MASK, value >> 32
        if healthy + dead > expected:
            raise InternalError(f"barrier {iteration}: {healthy + dead} arrivals, expected {expected}")
        return healthy, dead, healthy + dead == expected

    def _set_ready(self, iteration: int) -> None:
        self.ops += 1
        self.store.set(self.key(iteration, "ready"), "1")

    def read_terminated(self, iteration: int, count: int) -> set[int]:
        if count == 0:
            return set()
        # Every terminated arrival appended its rank before its add: the key exists.
        raw = (self._peek(self.key(iteration, "terminated")) or b"").decode()
        ranks = {int(r) for r in raw.split(",") if r}
        if len(ranks) != count:
            raise InternalError(f"barrier {iteration}: {count} ranks arrived terminated, records name {sorted(ranks)}")
        return ranks

    def read_faults(self, iteration: int) -> list[FaultRecord]:
        if iteration < 0:
            return []
        key = self.key(iteration, "faults")
        # Reads without waiting: "" when no fault was recorded (creates the key
        # empty then, which a later append extends; never changes a value).
        self.ops += 1
        raw = bytes(self.store.compare_set(key, "", "")).decode()
        out = []
        for line in raw.splitlines():
            if line:
                try:
                    out.append(FaultRecord.from_dict(json.loads(line)))
                except (ValueError, KeyError, TypeError):
                    out.append(FaultRecord(-1, iteration, "unreadable", "InternalError", line[:MAX_MESSAGE]))
        return out

    def publish_decision(self, decision: Decision) -> None:
        self.ops += 1
        self.store.set(self.key(decision.iteration, "decision"), decision.to_json())

    def wait_decision(self, iteration: int, timeout: float) -> Decision:
        key = self.key(iteration, "decision")
        return Decision.from_json(self.get_blocking(key, timeout, f"barrier {iteration}"))

    def barrier(
        self,
        iteration: int,
        initial_rank: int,
        expected: int,
        terminated: bool,
        decide: Optional[DecideFn],
        timeout: float,
        seat_taken: bool = False,
    ) -> Optional[Decision]:
        """Arrive at barrier ``iteration`` and return its decision.

        A terminated arrival (``decide`` may be None) returns None at once: it
        never waits and never leads. If every rank arrived terminated, the
        arrival that completes the count ends the job's keys.
        """
        if self.node is not None and not terminated and not seat_taken and self.node.alive():
            return self._barrier_on_board(iteration, initial_rank, expected, decide, timeout)
        healthy, dead, complete = self.arrive(iteration, initial_rank, expected, terminated, seat_taken)
        log.debug("barrier %d: rank %d arrived (healthy=%d, terminated=%d)", iteration, initial_rank, healthy, dead)
        if terminated:
            if complete and healthy == 0:
                self.finish_job(iteration)
            return None
        if healthy != 1:
            return self.wait_decision(iteration, timeout)
        return self._lead(iteration, initial_rank, dead if complete else None, decide, timeout)

    def _lead(
        self, iteration: int, initial_rank: int, dead: Optional[int], decide: Optional[DecideFn], timeout: float
    ) -> Decision:
        """The leader's part: ``dead`` is the terminated count when the leader's
        own arrival completed the barrier, else None (wait for ``ready``)."""
        assert decide is not None
        if dead is None:
            self.wait_key(self.key(iteration, "ready"), timeout, f"barrier {iteration} (leader)")
            self.ops += 1
            dead = self.store.add(self.key(iteration, "arrivals"), 0) >> 32
        decision = decide(self.read_terminated(iteration, dead), self.read_faults(iteration - 1), initial_rank)
        self.publish_decision(decision)
        self.delete_iteration(iteration - 1)
        if decision.membership.world_size == 0:
            self.finish_job(iteration)
        return decision

    # -- the node board (inprocess.processes.node_agent) ----------------------------------

    def arrive_batch(self, iteration: int, count: int, expected: int) -> tuple[int, int, bool]:
        """The node agent forwards ``count`` healthy arrivals (their ranks took
        their seats) with one ``add``. Returns (healthy, terminated, complete);
        the batch that completes the count sets ``ready``: the leader, named by
        the agent, always waits for it."""
        healthy, dead, complete = self._add_arrivals(iteration, count, expected)
        if complete:
            self._set_ready(iteration)
        return healthy, dead, complete

    def _barrier_on_board(
        self, iteration: int, initial_rank: int, expected: int, decide: Optional[DecideFn], timeout: float
    ) -> Decision:
        self.post_arrival(iteration, initial_rank, expected)
        return self.await_outcome(iteration, initial_rank, expected, decide, timeout)

    def post_arrival(self, iteration: int, initial_rank: int, expected: int) -> None:
        """A healthy arrival through the node agent, first half: the seat in
        the store, then the arrival on the board (the agent forwards it)."""
        if not self.take_seat(iteration, initial_rank, False):
            raise SeatTaken(f"initial rank {initial_rank} was counted out of barrier {iteration} by another process")
        self.node.board.arrive(self.node.slot, iteration, expected)

    def await_outcome(
        self, iteration: int, initial_rank: int, expected: int, decide: Optional[DecideFn], timeout: float
    ) -> Decision:
        """Second half: the board names this rank the leader, or holds the
        decision. If the agent goes away meanwhile, the rank counts itself
        directly unless the agent had forwarded its arrival."""
        node = self.node
        board, slot = node.board, node.slot
        deadline = time.monotonic() + timeout
        remaining = timeout
        while node.alive():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"barrier {iteration}: no decision within {timeout:g}s (node board)")
            outcome = board.wait_outcome(slot, iteration, min(NODE_POLL_S, remaining))
            if outcome == 1:
                return self._lead(iteration, initial_rank, None, decide, remaining)
            if outcome == 2:
                posted = board.read_decision()
                if posted is not None and posted[0] == iteration and posted[1] is not None:
                    return Decision.from_json(posted[1])
                return self.wait_decision(iteration, remaining)  # too large for the board
        # The agent is gone.
        if board.forwarded(slot) < iteration:
            decision = self.barrier(iteration, initial_rank, expected, False, decide, remaining, seat_taken=True)
            assert decision is not None
            return decision
        if board.leads(slot) == iteration:
            return self._lead(iteration, initial_rank, None, decide, remaining)
        return self.wait_decision(iteration, remaining)

    # -- leaving --------------------------------------------------------------

    def leave(self, iteration: int, world_size: int) -> None:
        """Called by every rank still in the job once the job completed."""
        self.ops += 1
        if self.store.add(self.key(iteration, "left"), 1) == world_size:
            self.finish_job(iteration)

    def finish_job(self, iteration: int) -> None:
        self.delete_iteration(iteration)
        self.delete_iteration(iteration - 1)
        self._delete([self.job_key("topology")])
        self.ops += 1
        self.store.set(self.job_key("done"), "1")

    def wait_done(self, timeout: Optional[float]) -> None:
        self.wait_key(self.job_key("done"), timeout, "the other ranks leaving")
        self._delete([self.job_key("done")])

    # -- topology -----------------------------------------------------------

    def publish_local_keys(self, initial_rank: int, keys: list[list[str]]) -> None:
        self.ops += 1
        self.store.append(self.job_key("topology"), json.dumps([initial_rank, keys], separators=(",", ":")) + "\n")

    def read_topology(self, initial_world_size: int) -> list[list[list[str]]]:
        """Per initial rank, the key lists it published (leader only, once per restart)."""
        raw = (self._peek(self.job_key("topology")) or b"").decode()
        table: list[Optional[list[list[str]]]] = [None] * initial_world_size
        for line in raw.splitlines():
            if line:
                rank, keys = json.loads(line)
                table[int(rank)] = keys
        missing = [r for r, k in enumerate(table) if k is None]
        if missing:
            raise InternalError(f"topology keys missing for initial ranks {missing[:16]}")
        return table  # type: ignore[return-value]

    # -- cleanup --------------------------------------------------------------

    _ITERATION_KEYS = ("event", "faults", "completed", "arrivals", "ready", "terminated", "decision", "left")

    def delete_iteration(self, iteration: int) -> None:
        if iteration >= 0:
            self._delete(self.key(iteration, name) for name in self._ITERATION_KEYS)

    def _delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.ops += 1
            self.store.delete_key(key)
