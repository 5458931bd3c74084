"""Joining a running job: a new process asks for a seat, a restart's leader admits it.

A process started with the job's environment and ``INPROCESS_JOIN=1`` while
the job runs (a rank respawned on its node, a replacement node's process, one
an operator adds) does not arrive at barrier 0. It *announces* itself and
waits, monitored, on a key of its own until a leader resolves it:

Its keys are tabled in :mod:`inprocess.control.keys` (``running``, ``joiners``,
``joiners.resolved``, ``joiner/<token>`` and its ``told`` and ``watched``). What
they hold:

* ``running``: the incarnation of the job that runs the call, written by
  barrier 0's leader so that a joiner of another incarnation is told so at
  once; ``ended:<incarnation>`` once that job ended;
* ``joiners``: the announcements, JSON lines; ``joiners.resolved``:
  ``settled:looked:barrier`` (:class:`ResolvedMark`), which leading lines need
  no look any more;
* ``joiner/<token>``: ``pending`` from before the announcement on, then the
  outcome, written once (compare_set on ``pending``; ``/w`` tags the writer,
  :class:`Outcome`): ``admitted/w:<b>:<seat>:<life>``, ``refused/w:<why>``,
  ``gone/w:<why>`` (withdrawn by the joiner, its monitor or a peer's monitor)
  or ``closed/w:<why>`` (the job ended); ``told``: the outcome again, for the
  waiting joiner, written by whoever resolved it on its behalf (one
  ``multi_set`` for all of them); ``watched``: the value of its seat's
  heartbeat counter at its monitor's first beat.

**Admission.** The leader of every restart barrier b > 0 reads the
announcements it has not seen resolved before it runs the rank assignment. A
joiner whose configuration differs from the leader's is refused with the
difference named. A joiner asks for one seat (its ``RANK``); the seat is free
when its process was terminated in the previous membership. The leader
writes the admission (the first writer wins against the joiner's monitor
withdrawing it), then moves the seat to ``b@<life+1>`` (:mod:`.seats`), and the
decision lists the admitted ``(seat, life)`` pairs. Every rank applies them
to the previous membership as spares (inactive rows, each ranked where its
seat stands among the ranks still in the job: :meth:`Membership.with_joined`)
before the decision's table: the rank assignment placed them like any spare,
as active ranks or spares, by their topology keys, which the leader published
for their seats. A joiner whose seat is held by a running process waits until
it is free.

A waiting joiner is a spare in all but name: it costs the running ranks
nothing, and the next restart's decision places it before the rank
assignment runs. It is watched like one: once its seat is free, its monitor
adds to the seat's heartbeat counter, which the monitors of the seats before
it watch already (:class:`inprocess.processes.monitor.PeerWatch`). A counter
that stands still for ``heartbeat_timeout`` after the joiner's monitor beat on
it means the joiner's node is lost: the peer's monitor withdraws it
(:meth:`JoinKeys.withdraw_silent`), so that no leader admits a dead process.

A leader lost after admitting a joiner and before its decision is out is
replaced by one that reads the same admission (its barrier is written in it)
and lists it too.

**The end.** When the job ends, every pending joiner is closed
(``closed:...``), and it returns from the wrapped call like a spare. A store
that goes away ends its wait too.

**Watching.** A joiner whose seat is free waits for its monitor's first beat
before it announces itself (one blocking wait); its monitor writes ``watched``
once, and while the seat is held reads the seat and the record every heartbeat
interval. A peer's monitor that sees a seat's counter stand still reads the
lines and one key per joiner of that seat.

**Cost.** A joiner makes nine store calls (the call's seats per key and its
seat's read, its record, its announcement and counter, ``running`` twice, one
blocking wait, the read of its decision). Linked to its node's agent, instead of the wait and the
decision's read: one read of its record per decision or event its node's
board shows while it waits, one every 10 s besides (``engine/join.py``).
The leader of a barrier with K joiners to look at makes a
constant number of round trips, not K: the lines and the mark (2 calls), one
``check`` and one ``multi_get`` of every record and the key of every seat asked for,
the K outcomes' compare_sets pipelined (one round trip, over a connection of
its own to the store server opened for them: 1 call), the ``told`` values
(one ``multi_set``) and the resolved counter, the admitted seats'
compare_sets pipelined, the mark: 2K + 8 calls in about 8 round trips (K <
3: one after another, no extra connection). Requests carry at most 256 keys
or compare_sets (:data:`KEYS_PER_REQUEST`): beyond 128 joiners, one more
round trip per 256 (256 joiners: 2K + 10 calls). The next barrier's leader reads
the lines and the mark only (2 calls): the mark tells it which lines were
admitted at the barrier before. No other rank does anything. The extra
connection is opened inside the restart: a server that looks up the name of
every client it accepts (torch's, in a process that did not call
:func:`~inprocess.control.host_names.numeric_host_names`, e.g. torchrun's
agent store) makes that lookup then. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..exception import InternalError, TimeoutError
from . import seats
from .join_records import (
    ADMITTED,
    CLOSED,
    ENDED,
    GONE,
    PENDING,
    REFUSED,
    Announcement,
    Outcome,
    ResolvedMark,
    config_difference,
)
from .keys import CallKeys, running
from .membership import TERMINATED, Membership
from .records import HOST
from .seat_table import SeatTable
from .store_ops import CountingStore

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("inprocess")

# Keys per check, multi_get and multi_set. torch 2.13's libuv server takes time that grows faster
# than the size of one request (measured here, one client, load 9: a multi_set of 4,096 keys and
# an add ~0.5 s, the same keys in requests of 256 ~50 ms; a multi_get of 4,096 keys ~0.5 s, in
# requests of 256 ~20-110 ms): requests stay at this size, as the compare_set batches do.
KEYS_PER_REQUEST = 256

JOIN_ENV = "INPROCESS_JOIN"



def join_requested(env: dict[str, str] | None = None) -> bool:
    """Whether this process was started to join a running job (``INPROCESS_JOIN=1``)."""
    value = (os.environ if env is None else env).get(JOIN_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{JOIN_ENV}={value!r}: expected 1 (join a running job) or 0")
    return value == "1"


def running_key(call: int) -> str:
    """Where the job of call ``call`` names its incarnation (not under any incarnation's prefix)."""
    return running(call)


def new_token() -> str:
    return f"{HOST}-{os.getpid()}-{secrets.token_hex(4)}"


class JoinKeys:
    """The join keys of one call (see the module docstring)."""

    def __init__(self, store: Any, call: int, incarnation: str):
        self.counted = store  # a CountingStore: every call counted, as the protocol's
        self.call = call
        self.incarnation = incarnation
        self.keys = CallKeys.of(call, incarnation)

    def joiner_key(self, token: str) -> str:
        return self.keys.joiner(token)

    def told_key(self, token: str) -> str:
        return self.keys.joiner_told(token)

    @property
    def lines_key(self) -> str:
        return self.keys.joiners()

    @property
    def resolved_key(self) -> str:
        return self.keys.joiners_resolved()

    @property
    def resolved_count_key(self) -> str:
        return self.keys.joiners_resolved_count()

    # -- the job ------------------------------------------------------------------

    def name_running_incarnation(self) -> None:
        self.counted.set(running_key(self.call), self.incarnation)

    def running_incarnation(self) -> str | None:
        """The incarnation of the job that runs (or ran: "ended:<incarnation>") this call, if any."""
        raw = self.counted.peek(running_key(self.call))
        return None if raw is None else raw.decode()

    def end(self, why: str) -> None:
        """The job ended: say so where a joiner looks, then close every pending joiner. A joiner
        announced after the closing read sees the end when it reads ``running`` after announcing."""
        try:
            if self.running_incarnation() is not None:
                self.counted.set(running_key(self.call), f"{ENDED}{self.incarnation}")
        except Exception as e:  # the job ends either way; a joiner's wait then ends with the store
            log.warning("could not mark the job ended for joiners: %s: %s", type(e).__name__, e)
        self.close_pending(why)

    # -- a joiner -----------------------------------------------------------------

    def announce(self, announcement: Announcement) -> None:
        """The joiner's record first (pending), then its line: a leader that reads the line finds the record."""
        key = self.joiner_key(announcement.token)
        held = self.counted.compare_set(key, "", PENDING).decode()
        if held != PENDING:
            raise InternalError(f"joiner {announcement.token}: its record holds {held[:120]!r} before it announced")
        self.counted.append(self.lines_key, announcement.to_json() + "\n")
        self.counted.add(self.keys.joiners_announced(), 1)

    def watched_key(self, token: str) -> str:
        return self.keys.joiner_watched(token)

    def mark_watched(self, token: str, counter: int) -> None:
        """The joiner's monitor beats on its seat's counter from ``counter`` on (its first beat's value)."""
        self.counted.set(self.watched_key(token), str(counter))

    def withdraw_silent(self, seat: int, counter: int, why: str) -> list[str]:
        """The heartbeat counter of ``seat`` stood still at ``counter``: withdraw (and tell) the
        waiting joiners of that seat whose monitor beat on it by then, lost with it. Returns their
        tokens. A line read, a read per waiting joiner of the seat (few), their compare_sets."""
        _, pending, _, _ = self.pending()
        candidates = [a for _, a in pending if a.seat == seat]
        watched = [self.counted.peek(self.watched_key(a.token)) for a in candidates]
        lost = [a for a, raw in zip(candidates, watched, strict=True) if raw is not None and int(raw) <= counter]
        if not lost:
            return []
        gone = Outcome(GONE, why=why)
        with Pipe(self.counted) as pipe:
            held = self.resolve_many([(a.token, gone) for a in lost], pipe)
        return [a.token for a, outcome in zip(lost, held, strict=True) if outcome.encode() == gone.encode()]

    def waiting(self) -> int:
        """Joiners announced and not resolved yet: two counter reads (a grow's look, engine/grow.py)."""
        announced = self.counted.add(self.keys.joiners_announced(), 0)
        # Never below 0: a joiner that died between its record and its counter was resolved, not counted.
        return max(0, int(announced) - int(self.counted.add(self.resolved_count_key, 0)))

    def resolve(self, token: str, outcome: Outcome) -> Outcome:
        """Write ``outcome`` unless the joiner was resolved already; returns the outcome that holds.

        For a joiner withdrawn by itself or by its monitor (its process is
        gone): nobody is told. A joiner with no record yet (it died before it
        announced) gets ``outcome`` as its record, so that an announcement
        still on its way is resolved already when a leader reads it.
        """
        key, desired = self.joiner_key(token), outcome.encode()
        value = self.counted.compare_set(key, PENDING, desired).decode()
        if value == desired:
            self.counted.add(self.resolved_count_key, 1)
        elif value == PENDING:  # no record: a compare_set on a missing key returns what it expected
            value = self.counted.compare_set(key, "", desired).decode()
            if value == PENDING:  # its record was created meanwhile: the joiner's own announcement
                return self.resolve(token, outcome)
        held = Outcome.parse(value)
        if held is None:
            raise InternalError(f"joiner {token}: its record is still pending after a compare_set")
        return held

    def read_outcome(self, token: str) -> Outcome | None:
        """The joiner's outcome, None while it is pending (or not announced)."""
        raw = self.counted.peek(self.joiner_key(token))
        return None if raw is None else Outcome.parse(raw.decode())

    @contextlib.contextmanager
    def quiet_waits(self) -> Iterator[JoinKeys]:
        """These keys on a connection of their own that is torch-free where the store is a
        TCPStore server's client: torch's client logs two warning lines for every wait of its
        that times out, and a waiting joiner's waits time out every second (it stamps its
        progress in between). Elsewhere these keys as they are. One call: the handshake."""
        pipe = self.counted.open_pipe()
        if pipe is None:
            yield self
            return
        try:
            yield JoinKeys(CountingStore(pipe), self.call, self.incarnation)
        finally:
            pipe.close()

    def wait_outcome(self, token: str, seconds: float) -> Outcome | None:
        """The joiner's outcome once somebody told it; None when ``seconds`` passed first.

        One blocking ``get`` of the joiner's ``told`` key. When it runs out,
        one read of its record: an outcome written by a resolver lost before
        it told the joiner still ends the wait (within one wait).
        """
        try:
            raw = self.counted.get_blocking(self.told_key(token), seconds, f"joiner {token}'s admission")
        except TimeoutError:
            return self.read_outcome(token)
        outcome = Outcome.parse(raw.decode())
        if outcome is None:
            raise InternalError(f"joiner {token}: told that it is still pending")
        return outcome

    # -- the leader ---------------------------------------------------------------

    def read_mark(self) -> tuple[str, ResolvedMark]:
        raw = self.counted.peek(self.resolved_key)
        if raw is None:
            return "", ResolvedMark()
        return raw.decode(), ResolvedMark.parse(raw.decode())

    def pending(self, barrier: int | None = None) -> tuple[int, list[tuple[int, Announcement]], str, ResolvedMark]:
        """(the number of lines, [(line index, announcement)] a leader of ``barrier`` looks at,
        the mark's value as read, the mark). ``barrier`` None: every line not resolved for good."""
        raw = (self.counted.peek(self.lines_key) or b"").decode()
        if not raw:
            return 0, [], "", ResolvedMark()
        text, mark = self.read_mark()
        first = mark.settled if barrier is None else mark.start(barrier)
        lines = raw.splitlines()
        out = []
        for index in range(first, len(lines)):
            line = lines[index]
            if not line:
                continue
            try:
                out.append((index, Announcement.from_json(line)))
            except (ValueError, KeyError, TypeError) as e:
                log.warning("joiners: line %d cannot be read (%s): %.200s", index, e, line)
        return len(lines), out, text, mark

    def mark_resolved(self, read: str, mark: ResolvedMark) -> None:
        """Move the mark from ``read`` (the value this leader read) to ``mark``; a mark moved
        meanwhile (by another leader of this barrier) is left as it is."""
        if mark.encode() != read:
            self.counted.compare_set(self.resolved_key, read, mark.encode())

    def read_records(self, keys: list[str]) -> list[str | None]:
        """The values of ``keys`` (None: missing): per :data:`KEYS_PER_REQUEST` keys, one ``check``
        and one ``multi_get`` when every one exists (the protocol's case); else one read each (a
        ``multi_get`` would wait for the missing ones)."""
        out: list[str | None] = []
        for start in range(0, len(keys), KEYS_PER_REQUEST):
            chunk = keys[start:start + KEYS_PER_REQUEST]
            if self.counted.check(chunk):
                out.extend(v.decode() for v in self.counted.multi_get(chunk))
            else:
                out.extend(None if v is None else v.decode() for v in (self.counted.peek(k) for k in chunk))
        return out

    def resolve_many(self, resolutions: list[tuple[str, Outcome]], pipe: Pipe) -> list[Outcome]:
        """Write each (token, outcome) where the joiner is still pending, all at once (first
        writer wins against a withdrawal, per joiner); tell each joiner resolved here, and count
        them, in one call each. Returns the outcomes that hold."""
        if not resolutions:
            return []
        items = [(self.joiner_key(token), PENDING, outcome.encode()) for token, outcome in resolutions]
        values = [v.decode() for v in pipe.compare_set_many(items)]
        held: list[Outcome] = []
        told: list[tuple[str, Outcome]] = []
        for (token, outcome), (_, _, desired), value in zip(resolutions, items, values, strict=True):
            parsed = Outcome.parse(value)
            if parsed is None:  # the compare_set found no record: every line's joiner has one
                raise InternalError(f"joiner {token}: no record under {self.joiner_key(token)}")
            if value == desired:
                told.append((token, outcome))
            held.append(parsed)
        if told:
            self.tell(told)
            self.counted.add(self.resolved_count_key, len(told))
        return held

    def tell(self, told: list[tuple[str, Outcome]]) -> None:
        """Wake the joiners that wait for these outcomes: one ``multi_set`` per
        :data:`KEYS_PER_REQUEST` (it wakes waiters on both of torch 2.13's servers, which a
        ``compare_set`` does not on the legacy one)."""
        for start in range(0, len(told), KEYS_PER_REQUEST):
            chunk = told[start:start + KEYS_PER_REQUEST]
            self.counted.multi_set([self.told_key(token) for token, _ in chunk], [o.encode() for _, o in chunk])

    def close_pending(self, why: str) -> int:
        """Close every pending joiner (the job ended); returns how many were."""
        try:
            _, pending, _, _ = self.pending()
            closing = Outcome(CLOSED, why=why)
            with Pipe(self.counted) as pipe:
                held = self.resolve_many([(a.token, closing) for _, a in pending], pipe)
            return sum(1 for o in held if o.encode() == closing.encode())
        except Exception as e:  # the job ends either way; a joiner's wait then ends with the store
            log.warning("could not close the waiting joiners: %s: %s", type(e).__name__, e)
            return 0


# compare_sets at least for a connection of their own to pay: opening one is about two round trips.
PIPELINE_FROM = 3


class Pipe:
    """The compare_sets of one admission: pipelined over a connection of their own to the
    store's server once there are :data:`PIPELINE_FROM` at once (one round trip per batch
    instead of one per call), else one after another on the leader's connection (also for
    a store that is not a TCPStore, or when that connection cannot be opened)."""

    def __init__(self, counted: Any):
        self.counted = counted
        self.client: Any = None
        self._tried = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def compare_set_many(self, items: list[tuple[str, str, str]]) -> list[bytes]:
        if len(items) >= PIPELINE_FROM and not self._tried:
            self._tried = True
            try:
                self.client = self.counted.open_pipe()
            except Exception as e:  # a connection the admission does without: its writes go one by one
                log.warning("joiners: no connection of its own for the admission's writes (%s: %s): "
                            "one after another", type(e).__name__, e)
        return list(self.counted.compare_set_many(items, self.client))


def admit(
    keys: JoinKeys, barrier: int, previous: Membership, job_config: dict[str, str], *,
    seat_table: SeatTable, publish_keys: Any,
) -> list[tuple[int, int]]:
    """The leader of ``barrier``: admit the pending joiners whose seats are free.

    ``seat_table`` holds the job's seats; ``publish_keys([(r, keys), ...])``
    publishes the admitted joiners' topology keys for their seats, all at once. Returns the admitted
    ``(seat, life)`` pairs in seat order, for the decision.

    Two live leaders of one barrier (the first marked lost by a false "lost", the second leading the
    next term) both run this, and cannot admit two joiners into one seat (issue 31, point 2): a
    joiner's outcome is one compare_set from "pending" (the first writer wins, and the other leader
    reads that outcome back and takes it as its own); both leaders read the announcements in line order
    and admit the first pending one of a free seat, so both pick the same one, unless it was resolved
    meanwhile, and then both read its outcome; the outcomes are written before any seat moves; and a
    seat moves only by compare_set from its previous life's counted-out value to this life's, so a
    second life for one seat fails there (InternalError, never two holders). Only one of the two
    decisions is published (the first leader's term is marked lost): the joiners read that one.
    """
    lines, pending, mark_read, _ = keys.pending(barrier)
    if not pending:
        return []
    n = previous.initial_world_size
    free = {r for r in range(n) if previous.mode[r] == TERMINATED}
    asked = sorted({a.seat for _, a in pending if a.seat in free})
    # One read of every record and of the keys of every free seat asked for.
    values = keys.read_records([keys.joiner_key(a.token) for _, a in pending] + seat_table.keys_of(asked))
    seat_values = seat_table.learn(asked, values[len(pending):])
    outcomes: list[Outcome | None] = []
    for (index, a), value in zip(pending, values[:len(pending)], strict=True):
        if value is None:  # every joiner writes its record before its line
            log.warning("joiners: line %d (joiner %s) has no record: skipped", index, a.token)
            outcomes.append(Outcome(GONE, why="no record"))
        else:
            outcomes.append(Outcome.parse(value))

    admitted: dict[int, tuple[int, int, Announcement]] = {}  # seat -> (life, line, joiner)
    earlier: list[tuple[str, Outcome]] = []  # (token, its record) admitted by a leader of this barrier lost since
    for (index, a), outcome in zip(pending, outcomes, strict=True):
        if outcome is not None and outcome.kind == ADMITTED and outcome.barrier == barrier:
            admitted[outcome.seat] = (outcome.life, index, a)
            earlier.append((a.token, outcome))
    taken = set(admitted)
    writes: list[tuple[int, Announcement, Outcome]] = []
    still_open: list[int] = []  # lines a later barrier must look at again
    for (index, a), outcome in zip(pending, outcomes, strict=True):
        if outcome is not None:
            continue  # resolved for good, or admitted here already
        why = config_difference(job_config, a.config)
        if why is None and not 0 <= a.seat < n:
            why = f"seat {a.seat} (its RANK) is not a seat of this job: expected 0..{n - 1}"
        if why is not None:
            log.warning("joiner %s (%s, pid %d) refused: %s", a.token, a.host, a.pid, why)
            writes.append((index, a, Outcome(REFUSED, why=why)))
        elif a.seat not in free or a.seat in taken:
            still_open.append(index)  # its seat is held: it waits
        else:
            raw = seat_values[a.seat]
            life = seats.parse(raw).life + 1 if raw else 1
            writes.append((index, a, Outcome(ADMITTED, barrier, a.seat, life)))
            taken.add(a.seat)

    with Pipe(keys.counted) as pipe:
        held = keys.resolve_many([(a.token, outcome) for _, a, outcome in writes], pipe)
        for (index, a, _), outcome in zip(writes, held, strict=True):
            if outcome.kind == ADMITTED and outcome.barrier == barrier:
                admitted[outcome.seat] = (outcome.life, index, a)
            # else resolved for good: refused here, or withdrawn before this leader's write
        # Admitted by a leader lost before its decision, perhaps before it told them.
        keys.tell(earlier)
        _move_seats(pipe, barrier, {seat: life for seat, (life, _, _) in admitted.items()}, seat_table,
                    seat_values)
    publish_keys([(seat, a.keys) for seat, (_, _, a) in sorted(admitted.items()) if a.keys is not None])
    # Until this barrier's decision is out, a leader that takes the lead over must see the admitted lines.
    looked = min(still_open, default=lines)
    settled = min(still_open + [index for _, index, _ in admitted.values()], default=lines)
    keys.mark_resolved(mark_read, ResolvedMark(settled, looked, barrier))
    return sorted((seat, life) for seat, (life, _, _) in admitted.items())


def _move_seats(
    pipe: Pipe, barrier: int, lives: dict[int, int], seat_table: SeatTable, seat_values: dict[int, str | None],
) -> None:
    """The seats of the admitted joiners: each from its predecessor's "counted out" to ``b@life``.

    compare_sets, not one ``multi_set``: only a leader of this barrier ever
    writes a counted-out seat (counting out leaves one alone, a rank's own
    arrival expects its own life's value), but a leader of this barrier
    that lost the lead and runs late must not move back a seat whose
    joiner took it at the next barrier; its compare_set fails instead.
    """
    moves: list[tuple[int, str, str]] = []
    unread = [seat for seat in lives if seat not in seat_values]
    if unread:
        seat_values = {**seat_values, **seat_table.read_many(unread)}
    for seat, life in sorted(lives.items()):
        desired = seats.healthy(barrier, life)
        current = seat_values[seat]
        if current == desired:
            continue  # moved by a leader of this barrier lost before its decision
        parsed = seats.parse(current) if current else None
        if parsed is not None and (not parsed.counted_out or parsed.life != life - 1):
            raise InternalError(f"seat of rank {seat} holds {current!r}: not the counted-out seat of life "
                                f"{life - 1} that a joiner of life {life} replaces")
        moves.append((seat, current or "", desired))
    for (seat, _, desired), value in zip(moves, seat_table.compare_set_many(moves, pipe.compare_set_many),
                                         strict=True):
        if value != desired:
            raise InternalError(f"seat of rank {seat} moved to {value!r} while a joiner was admitted into it")
