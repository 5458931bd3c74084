"""The restart control plane: every store operation of a restart, in one place.

Built for 16,384 ranks against one TCPStore: per restart each rank makes O(1)
store operations of O(1) size (plus the decision, whose size grows with the
number of faults, not with the world size), no rank reads a per-rank list,
and nothing is polled. The same code drives the training ranks, the monitor
processes and the control-plane simulator in ``benchmarks/``.

Its keys are built and tabled in :mod:`inprocess.control.keys` (all under the
call's prefix: ``<i>/event``, ``<i>/arrivals``, ``<i>/decision``, ``seat/<g>``, ...);
a rank's seat is the last barrier it was counted at (:mod:`inprocess.control.seats`).

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
assignment once, publishes the decision and deletes the keys of iteration i-1.
Only a healthy training rank can lead: a monitor process, arriving for a dead
rank, holds no rank assignment (and must not: no code crosses the store). A
leader lost before its decision is out is excluded by barrier i's own
decision, which another healthy rank takes over
(:mod:`inprocess.control.leadership`: terms, lost marks, claims).

With node agents (:mod:`inprocess.processes.node_agent`), a rank's event and barrier
outcome come from its node's board instead: the agent waits for the event
and the decision once for the node, takes the seats of the node's healthy
arrivals with the same moves in one batch (one compare_set per seat key), and forwards
those whose seat it took in one ``add``. A seat found counted out ("t...")
is refused on the board: that rank looks at its seat itself and leaves
(:class:`SeatTaken`), so counting stays exactly-once against monitors, which
always arrive directly.

This module holds the protocol's logic. What it writes is in
:mod:`inprocess.control.records` (fault records, decisions); how it talks to
the store (every call counted, waits cut into chunks) in
:mod:`inprocess.control.store_ops`; what it needs of a node agent's board in
:class:`inprocess.control.node_link.NodeBoardLink`.

This module imports no torch: monitor processes use it over a lightweight
store client. A store is anything with torch's Store methods.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from ..exception import BarrierOverflow, BarrierTimeout, InternalError, TimeoutError
from . import board_arrival, seats
from .joining import JoinKeys
from .keys import GROW_KEYS, ITERATION_KEYS, CallKeys, call_prefix
from .leadership import Terms, decide_barrier, parse_lost_mark
from .node_link import NODE_POLL_S, NodeBoardLink
from .records import HOST, MAX_FAULTS_IN_DECISION, MAX_MESSAGE, DecideFn, Decision, FaultRecord
from .seat_table import SeatTable
from .seats import SeatTaken
from .store_ops import CountingStore, Deadline, is_timeout, wait_in_chunks
from .topology_keys import TopologyKeys

__all__ = [
    "COMPLETE", "HOST", "MAX_FAULTS_IN_DECISION", "MAX_MESSAGE", "NODE_POLL_S", "RESTART", "TERMINATED_UNIT",
    "DecideFn", "Decision", "FaultRecord", "RestartProtocol", "SeatTaken", "done_key", "is_timeout",
    "monitor_heartbeat_key",
]

RESTART = "restart"
COMPLETE = "complete"
TERMINATED_UNIT = 1 << 32
COUNT_MASK = TERMINATED_UNIT - 1

log = logging.getLogger("inprocess")


def done_key(call: int, incarnation: str = "") -> str:
    """Set when the last rank left call ``call``; the store host exits on it."""
    return CallKeys.of(call, incarnation).done()


def monitor_heartbeat_key(call: int, rank: int, incarnation: str = "") -> str:
    """The counter the monitor of ``rank`` adds 1 to every heartbeat interval."""
    return CallKeys.of(call, incarnation).monitor_heartbeat(rank)


# Seats read at once while naming the ranks a barrier misses.
_SEATS_PER_DESCRIBE_READ = 1024


def _waits_for(seat: str | None, barrier: int) -> bool:
    """Whether a seat holding ``seat`` belongs to a member not arrived at ``barrier`` yet."""
    if seat is None or seat == "":
        return barrier == 0
    parsed = seats.parse(seat)
    return not parsed.counted_out and parsed.barrier == barrier - 1






class RestartProtocol:
    """Store operations of the restart engine for one wrapped call.

    ``store`` is one client connection. Blocking waits occupy a connection, so
    a thread that blocks (the restart trigger) gets its own instance over its
    own connection. Every call goes through :attr:`counted`
    (:class:`~inprocess.control.store_ops.CountingStore`): :attr:`ops` is the
    number of calls that reached the store, :attr:`requests` what they were on
    the TCPStore wire.

    ``link`` is a rank's link to its node agent, or None: with it, the event
    and the barrier's outcome come from the node's board and the rank's
    healthy arrival goes there. Without it (or once the agent is gone)
    everything goes to the store directly.

    ``incarnation`` is the launcher's incarnation of the job
    (:func:`inprocess.control.incarnation.job_incarnation`): a restarted
    incarnation meets a store its predecessor wrote to, under another prefix.

    ``seats_per_key``: what this process proposes for the call's seats per key,
    if it is the first to touch a seat (:mod:`inprocess.control.seat_table`;
    None: 1): a node's ranks where node agents take the seats.
    """

    def __init__(
        self, store: Any, call: int = 0, link: NodeBoardLink | None = None, *,
        initial_world_size: int | None = None, incarnation: str = "", seats_per_key: int | None = None,
    ):
        self.counted = CountingStore(store)
        self.call = call
        self.incarnation = incarnation
        self.prefix = call_prefix(call, incarnation)
        self.link = link
        # Where the seats are, to name the ranks a barrier misses (unknown: not named).
        self.initial_world_size = initial_world_size
        # Given the prefix, not self.key: no reference cycle, so that the connection
        # closes as soon as the protocol is dropped (tests count descriptors).
        self.keys = CallKeys(self.prefix)
        self.terms = Terms(self.counted, self.prefix)
        self.seat_table = SeatTable(self.counted, self.prefix, seats_per_key)
        self.topology = TopologyKeys(self.counted, self.keys)
        # The life of the seat this process holds (control/seats.py): 0 but for a process that joined.
        self.life = 0
        # While a decide function runs here: the term it decides (0: the barrier's first leader,
        # t > 0: the t-th to take the lead over), for a decide function that cares (fault injection).
        self.lead_term = 0
        self.finished = False  # finish_job ran here

    @property
    def store(self) -> Any:
        """The client connection itself (uncounted: the protocol's calls go through :attr:`counted`)."""
        return self.counted.raw

    @property
    def ops(self) -> int:
        """Store calls made through this instance."""
        return self.counted.calls

    @property
    def requests(self) -> int:
        """What :attr:`ops` were on the TCPStore wire (a ``get`` is WAIT + GET)."""
        return self.counted.requests

    # -- keys ---------------------------------------------------------------

    def key(self, iteration: int, name: str) -> str:
        """Iteration ``iteration``'s key ``name`` (:mod:`inprocess.control.keys`)."""
        return self.keys.iteration(iteration, name)

    def seat_key(self, initial_rank: int) -> str:
        """The key that holds the rank's seat, and the others of its key (:mod:`inprocess.control.seat_table`)."""
        return self.seat_table.key_of(initial_rank)

    # -- faults and the event -----------------------------------------------

    def record_fault(self, record: FaultRecord) -> None:
        self.counted.append(self.key(record.iteration, "faults"), record.to_json() + "\n")

    def _set_event(self, iteration: int, outcome: str) -> str:
        key = self.key(iteration, "event")
        value = self.counted.compare_set(key, "", outcome).decode()
        # torch 2.13's legacy (non-libuv) server wakes no waiter on compare_set;
        # an empty append wakes them on both backends and changes nothing.
        self.counted.append(key, "")
        return value

    def request_restart(self, iteration: int) -> bool:
        """Returns False when the iteration had completed already."""
        return self._set_event(iteration, RESTART) == RESTART

    def restart_requested(self, iteration: int) -> bool:
        return self.counted.check([self.key(iteration, "event")])

    def report_fault(self, record: FaultRecord) -> bool:
        self.record_fault(record)
        return self.request_restart(record.iteration)

    def wait_event(
        self,
        iteration: int,
        timeout: float | None,
        *,
        cancelled: Callable[[], bool] | None = None,
        only_restart: Callable[[], bool] | None = None,
    ) -> str:
        """The event of ``iteration``, once it is set.

        ``only_restart()``, asked once the key exists, says whether the event
        can only be "restart": true for an active rank that has not counted
        itself completed, since "complete" needs every active rank's count.
        Then the value is not read: one ``wait`` (one request on the wire)
        instead of a blocking ``get`` (two).
        """
        what = f"iteration {iteration} outcome"
        if self.link is not None:
            value = self._wait_event_on_board(self.link, iteration, timeout, what, cancelled)
            if value is not None:
                return value
        key = self.key(iteration, "event")
        if only_restart is not None:
            self.counted.wait_key(key, timeout, what, cancelled=cancelled)
            if only_restart():
                return RESTART
            value = self.counted.get(key).decode()
        else:
            value = self.counted.get_blocking(key, timeout, what, cancelled=cancelled).decode()
        if value not in (RESTART, COMPLETE):
            raise InternalError(f"iteration {iteration} event holds {value!r}, expected {RESTART!r} or {COMPLETE!r}")
        return value

    @staticmethod
    def _wait_event_on_board(
        link: NodeBoardLink, iteration: int, timeout: float | None, what: str,
        cancelled: Callable[[], bool] | None,
    ) -> str | None:
        """The event as the node agent posted it; None once the agent is gone."""

        def attempt(seconds: float) -> int | None:
            outcome = link.wait_event(iteration, seconds)
            return outcome if outcome >= 0 else None

        outcome = attempt(0.0)  # posted already: no chunked wait to set up
        if outcome is None:
            outcome = wait_in_chunks(attempt, Deadline(timeout), what, "node board", cancelled=cancelled,
                                     chunk_s=NODE_POLL_S, go_on=link.alive)
        if outcome is None:
            return None
        return COMPLETE if outcome == 1 else RESTART

    def arrive_completed(self, iteration: int, active_world_size: int) -> None:
        count = self.counted.add(self.key(iteration, "completed"), 1)
        if count == active_world_size:
            self._set_event(iteration, COMPLETE)

    # -- seats --------------------------------------------------------------

    def take_seat(self, iteration: int, initial_rank: int, *, terminated: bool = False) -> bool:
        """Move the rank's seat from barrier ``iteration - 1`` to ``iteration``.

        False when somebody else counted the rank out already ("t..."): the
        rank must not count itself. True also when the seat holds this
        rank's healthy arrival already (its node agent took it).
        """
        previous, desired = self._seat_move(iteration, self.life, terminated)
        value = self.seat_table.compare_set(initial_rank, previous, desired)
        return self._seat_moved(iteration, initial_rank, previous, desired, value)

    @staticmethod
    def _seat_move(iteration: int, life: int, terminated: bool = False) -> tuple[str, str]:
        """(expected, desired) of the compare_set that takes a seat of life ``life`` at barrier ``iteration``."""
        desired = seats.counted_out(iteration, "self", life) if terminated else seats.healthy(iteration, life)
        return seats.before_barrier(iteration, life), desired

    @staticmethod
    def _seat_moved(iteration: int, initial_rank: int, previous: str, desired: str, value: str) -> bool:
        """What the seat's compare_set answered ``value`` means: True taken, False counted out by someone else."""
        if value == desired:
            return True
        if value:
            seat = seats.parse(value)
            # Counted out; or counted out and a process joined into the seat since (a later life).
            if seat.counted_out or seat.life > seats.parse(desired).life:
                return False
        held = "nothing" if not value else repr(value)
        hint = ""
        if iteration == 0 and value:
            hint = (": a process of this job held the seat already; a process that joins a running job is started "
                    "with INPROCESS_JOIN=1")
        raise InternalError(
            f"barrier {iteration}: seat of rank {initial_rank} holds {held}, expected {previous!r}{hint}")

    def take_seats(self, iteration: int, claims: list[tuple[int, int]]) -> list[bool]:
        """A node agent takes the seats of its ranks' healthy arrivals at barrier ``iteration``:
        ``claims`` holds (initial rank, life) per arrival; the same moves as
        :meth:`take_seat`, one compare_set per seat key, pipelined when the store is a TCPStore
        client that can (:meth:`~inprocess.control.tcpstore_client.TCPStoreClient.compare_set_many`).

        Per claim, True when the seat is taken, False when it is not where the
        rank left it (counted out by someone else, or anything unexpected): the
        rank then looks at its seat itself, and raises what :meth:`take_seat` raises.
        """
        moves = [(rank, *self._seat_move(iteration, life)) for rank, life in claims]
        pipe = self.store if hasattr(self.store, "compare_set_many") else None
        values = self.seat_table.compare_set_many(moves, lambda items: self.counted.compare_set_many(items, pipe))
        return [value == desired for (_, _, desired), value in zip(moves, values, strict=True)]

    def read_seat(self, initial_rank: int) -> str | None:
        """The seat's value, or None if the rank never arrived anywhere."""
        return self.seat_table.read(initial_rank)

    # -- barrier ------------------------------------------------------------

    def arrive(
        self, iteration: int, initial_rank: int, expected: int, *, terminated: bool = False, seat_taken: bool = False
    ) -> tuple[int, int, bool]:
        """Count this rank in at barrier ``iteration``: its seat, then one ``add``.

        Returns (healthy, terminated, complete) as of this arrival. ``expected``
        is the number of ranks that must arrive (every rank of the previous
        membership). The arrival that completes the count sets ``ready``.
        Raises :class:`SeatTaken` when somebody counted this rank out already.
        """
        if not seat_taken and not self.take_seat(iteration, initial_rank, terminated=terminated):
            raise SeatTaken(f"initial rank {initial_rank} was counted out of barrier {iteration} by another process")
        if terminated:
            self.counted.append(self.key(iteration, "terminated"), f"{initial_rank},")
        healthy, dead, complete = self._add_arrivals(iteration, TERMINATED_UNIT if terminated else 1, expected)
        if complete and not (healthy == 1 and not terminated):
            self._set_ready(iteration)
        return healthy, dead, complete

    def _add_arrivals(self, iteration: int, amount: int, expected: int) -> tuple[int, int, bool]:
        """One ``add`` to barrier ``iteration``'s counter: (healthy, terminated, complete) after it."""
        value = self.counted.add(self.key(iteration, "arrivals"), amount)
        healthy, dead = value & COUNT_MASK, value >> 32
        if healthy + dead > expected:
            raise BarrierOverflow(f"barrier {iteration}: {healthy + dead} arrivals, expected {expected}")
        return healthy, dead, healthy + dead == expected

    def _set_ready(self, iteration: int) -> None:
        self.counted.set(self.key(iteration, "ready"), "1")

    def count(self, iteration: int) -> tuple[int, int]:
        """(healthy, terminated) arrivals at barrier ``iteration`` so far: one ``add`` of 0."""
        value = self.counted.add(self.key(iteration, "arrivals"), 0)
        return value & COUNT_MASK, value >> 32

    def wait_ready(self, iteration: int, deadline: Deadline) -> None:
        """Until the arrival that completed barrier ``iteration``'s count (unless the first leader's) set ``ready``."""
        self.counted.wait_key(self.key(iteration, "ready"), deadline.remaining(), f"barrier {iteration} (leader)")

    def read_terminated(self, iteration: int, count: int) -> set[int]:
        if count == 0:
            return set()
        # Every terminated arrival appended its rank before its add: the key exists.
        raw = (self.counted.peek(self.key(iteration, "terminated")) or b"").decode()
        ranks = {int(r) for r in raw.split(",") if r}
        if len(ranks) != count:
            raise InternalError(f"barrier {iteration}: {count} ranks arrived terminated, records name {sorted(ranks)}")
        return ranks

    def read_faults(self, iteration: int) -> list[FaultRecord]:
        if iteration < 0:
            return []
        # Reads without waiting: "" when no fault was recorded (creates the key
        # empty then, which a later append extends; never changes a value).
        raw = self.counted.compare_set(self.key(iteration, "faults"), "", "").decode()
        return FaultRecord.parse_lines(raw, iteration)

    def publish_decision(self, decision: Decision) -> bool:
        """Publish ``decision`` in its term; False when the term was marked lost first."""
        encoded = decision.to_json()
        return self.terms.write(decision.iteration, decision.term, encoded) == encoded.encode()

    def wait_decision_raw(
        self, iteration: int, timeout: float | None, *, cancelled: Callable[[], bool] | None = None,
        on_lost: Callable[[bytes], None] | None = None,
    ) -> bytes:
        """The encoded decision of barrier ``iteration``, once it is published,
        following its terms past lost leaders (``on_lost(mark)`` for each mark)."""
        deadline = Deadline(timeout)
        term = 0
        while True:
            raw = self.terms.wait(iteration, term, deadline, cancelled=cancelled)
            if parse_lost_mark(raw) is None:
                return raw
            if on_lost is not None:
                on_lost(raw)
            term += 1

    def wait_decision(self, iteration: int, timeout: float) -> Decision:
        return self._decided(Decision.from_json(self.wait_decision_raw(iteration, timeout)))

    def decision_on_board(self, iteration: int) -> Decision | None:
        """Barrier ``iteration``'s decision as the node agent posted it, if it is the board's latest
        (not too large for it, not a lost mark); None otherwise: then it is read from the store."""
        posted = self.link.read_decision() if self.link is not None and self.link.alive() else None
        return self.posted_decision(posted, iteration)

    def posted_decision(self, posted: tuple[int, bytes | None] | None, iteration: int) -> Decision | None:
        """``posted`` (the board's latest decision) if it is barrier ``iteration``'s decision itself."""
        if posted is None or posted[0] != iteration or posted[1] is None or parse_lost_mark(posted[1]) is not None:
            return None
        return self._decided(Decision.from_json(posted[1]))

    def _decided(self, decision: Decision) -> Decision:
        """A decision read here, from the store or a node board: its term's keys are known to exist."""
        self.terms.saw(decision.iteration, decision.term)
        return decision

    def barrier(
        self,
        iteration: int,
        initial_rank: int,
        expected: int,
        *,
        terminated: bool = False,
        decide: DecideFn | None = None,
        timeout: float,
        seat_taken: bool = False,
    ) -> Decision | None:
        """Arrive at barrier ``iteration`` and return its decision.

        A healthy arrival may lead: ``decide`` computes the decision then. A
        terminated arrival (``decide`` may be None) returns None at once: it
        never waits and never leads. If every rank arrived terminated, the
        arrival that completes the count ends the job's keys. ``seat_taken``:
        the caller moved the seat already (a monitor counting its rank out, a
        rank whose node agent went away after its seat).
        """
        try:
            return self._barrier(iteration, initial_rank, expected, terminated, decide, timeout, seat_taken)
        except TimeoutError as e:
            if terminated:
                raise
            described = self.describe_arrivals(iteration, expected)
            self.give_up(iteration)
            raise BarrierTimeout(f"{described} ({e})") from None

    def give_up(self, iteration: int) -> None:
        """This healthy arrival stops waiting for barrier ``iteration`` (it timed out):
        the call is over for it. The last of the arrivals to give up ends the call's
        keys and sets ``done``, so the store host exits at once instead of waiting
        out its idle timeout, and a host rank waiting for it is not held."""
        try:
            given_up = self.counted.add(self.key(iteration, "given_up"), 1)
            healthy = self.count(iteration)[0]
            if given_up >= healthy:
                self.finish_job(iteration)
        except Exception as e:  # the store is gone: nothing left to end
            log.debug("barrier %d: could not give up: %s", iteration, e)

    def _barrier(self, iteration: int, initial_rank: int, expected: int, terminated: bool,
                 decide: DecideFn | None, timeout: float, seat_taken: bool) -> Decision | None:
        link = self.link
        if (link is not None and not terminated and not seat_taken and link.alive()
                and not board_arrival.replaced(link, iteration)):
            self.post_arrival(iteration, initial_rank, expected)
            return self.await_outcome(iteration, initial_rank, expected, decide=decide, timeout=timeout)
        healthy, dead, complete = self.arrive(
            iteration, initial_rank, expected, terminated=terminated, seat_taken=seat_taken
        )
        log.debug("barrier %d: rank %d arrived (healthy=%d, terminated=%d)", iteration, initial_rank, healthy, dead)
        if terminated:
            if complete and healthy == 0:
                self.finish_job(iteration)
            return None
        deadline = Deadline(timeout)
        if healthy != 1:
            return decide_barrier(self, iteration, initial_rank, expected, decide, deadline)
        return decide_barrier(self, iteration, initial_rank, expected, decide, deadline, lead=True,
                             dead=dead if complete else None)

    def describe_arrivals(self, iteration: int, expected: int, *, limit: int = 8) -> str:
        """"barrier i: 3 of 4 ranks arrived; missing initial rank 3": who a barrier
        still waits for. Reads the seats (per 1,024 ranks) only until ``limit``
        missing ranks are named: for the error of a barrier that timed out."""
        try:
            arrived = sum(self.count(iteration))
        except Exception as e:  # the store is gone: say so instead
            return f"barrier {iteration}: the arrivals cannot be read ({type(e).__name__}: {e})"
        text = f"barrier {iteration}: {arrived} of {expected} ranks arrived"
        if arrived >= expected:
            # Not a contradiction to leave unexplained: the count is not the decision.
            return (f"{text}, yet it was not decided: the arrival that completes the count sets ready, "
                    "unless it expected another number of ranks (another WORLD_SIZE), and the leader then "
                    "decides, unless it was lost while deciding")
        if self.initial_world_size is None:
            return text
        # A member not arrived yet holds the seat of the barrier before (none before barrier 0).
        missing: list[int] = []
        wanted = min(limit, expected - arrived)
        try:
            for start in range(0, self.initial_world_size, _SEATS_PER_DESCRIBE_READ):
                held = self.seat_table.read_many(range(start, min(start + _SEATS_PER_DESCRIBE_READ,
                                                                  self.initial_world_size)))
                missing += [rank for rank, seat in held.items() if _waits_for(seat, iteration)][:wanted - len(missing)]
                if len(missing) == wanted:
                    break
        except Exception:
            pass  # name the ones found so far
        if missing:
            more = expected - arrived - len(missing)
            text += f"; missing initial rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            text += f" and {more} more" if more > 0 else ""
        return text

    # -- the node board (inprocess.processes.node_agent) ----------------------

    def arrive_batch(self, iteration: int, count: int, expected: int) -> tuple[int, int, bool]:
        """The node agent forwards ``count`` healthy arrivals (their ranks took
        their seats) with one ``add``. Returns (healthy, terminated, complete);
        the batch that completes the count sets ``ready``: the leader, named by
        the agent, always waits for it."""
        healthy, dead, complete = self._add_arrivals(iteration, count, expected)
        if complete:
            self._set_ready(iteration)
        return healthy, dead, complete

    def post_arrival(self, iteration: int, initial_rank: int, expected: int) -> None:
        """A healthy arrival through the node agent, first half (:mod:`inprocess.control.board_arrival`)."""
        board_arrival.post_arrival(self, iteration, initial_rank, expected)

    def await_outcome(
        self, iteration: int, initial_rank: int, expected: int, *, decide: DecideFn | None = None, timeout: float
    ) -> Decision:
        """Second half: the decision (:mod:`inprocess.control.board_arrival`)."""
        return board_arrival.await_outcome(self, iteration, initial_rank, expected, decide=decide, timeout=timeout)

    # -- leaving --------------------------------------------------------------

    def leave(self, iteration: int, world_size: int) -> None:
        """Called by every rank still in the job once the job completed."""
        if self.counted.add(self.key(iteration, "left"), 1) == world_size:
            self.finish_job(iteration)

    def finish_job(self, iteration: int) -> None:
        self.finished = True  # this process ended the call: its store host exits on "done", ask it nothing more
        self.delete_iteration(iteration)
        self.delete_iteration(iteration - 1)
        self._delete([self.keys.topology()])
        # Before "done", which ends the store host: the waiting joiners are told while it serves them.
        JoinKeys(self.counted, self.call, self.incarnation).end("the job ended")
        self.counted.set(self.keys.done(), "1")

    def wait_done(self, timeout: float | None) -> None:
        self.counted.wait_key(self.keys.done(), timeout, "the other ranks leaving")
        self._delete([self.keys.done()])

    # -- cleanup --------------------------------------------------------------

    def delete_iteration(self, iteration: int) -> None:
        # The grow keys too (engine/grow.py): the rank that scheduled a grow deletes them, but a rank
        # killed before its next iteration left them for good (the first long chaos run: grow keys of
        # iterations 181, 214, ... still there at iteration 430); the leader deletes them with the rest.
        if iteration >= 0:
            self._delete(self.key(iteration, name) for name in ITERATION_KEYS + GROW_KEYS)
            self.terms.delete(iteration)

    def _delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.counted.delete_key(key)
