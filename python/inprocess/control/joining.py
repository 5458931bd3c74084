"""Joining a running job: a new process asks for a seat, a restart's leader admits it.

A process started with the job's environment and ``INPROCESS_JOIN=1`` while
the job runs (a rank respawned on its node, a replacement node's process, one
an operator adds) does not arrive at barrier 0. It *announces* itself and
waits, monitored, on a key of its own until a leader resolves it:

=======================  ====================================================
``running``              (under ``inprocess/running/<call>``, without the
                         incarnation) the incarnation of the job that runs
                         this call; written by barrier 0's leader, so that a
                         joiner of another incarnation is told so at once;
                         ``ended:<incarnation>`` once that job ended
``joiners``              announcements, JSON lines, appended by joiners
``joiners.resolved``     how many leading lines need no look any more
``joiner/<token>``       the joiner's outcome, written once (compare_set on
                         ""): ``admitted:<b>:<seat>:<life>``,
                         ``refused:<why>``, ``gone:<why>`` (the joiner or its
                         monitor withdrew it) or ``closed:<why>`` (the job
                         ended)
=======================  ====================================================

**Admission.** The leader of every restart barrier b > 0 reads the
announcements it has not seen resolved (one ``get`` of the lines, one
``compare_set`` per pending joiner) before it runs the rank assignment. A
joiner whose configuration differs from the leader's is refused with the
difference named. A joiner asks for one seat (its ``RANK``); the seat is free
when its process was terminated in the previous membership. The leader
writes the admission (the first writer wins against the joiner's monitor
withdrawing it), then moves the seat to ``b@<life+1>`` (:mod:`.seats`), and the
decision lists the admitted ``(seat, life)`` pairs. Every rank applies them
to the previous membership as spares (inactive rows, ranked after every rank
still in the job) before the decision's table: the rank assignment placed
them like any spare, as active ranks or spares, by their topology keys,
which the leader published for their seats. A joiner whose seat is held by a
running process waits until it is free.

A waiting joiner is a spare in all but name: it costs the running ranks
nothing, and the next restart's decision places it before the rank
assignment runs. A leader lost after admitting a joiner and before its
decision is out is replaced by one that reads the same admission (its barrier
is written in it) and lists it too.

**The end.** When the job ends, every pending joiner is closed
(``closed:...``), and it returns from the wrapped call like a spare. A store
that goes away ends its wait too.

Cost: a joiner makes about seven store calls (its seat's read, its
announcement and counter, ``running`` twice, one blocking wait, the read of
its decision). The leader reads the lines and the resolved mark per barrier,
then makes about seven sequential calls per admitted joiner (its outcome's
check and compare_set with the wake-up append and the resolved counter, the
seat's reads and compare_set) and two per admitted line at the next barrier:
72 ms for 256 joiners on an idle store
(``benchmarks/README.md``, "Joins"). No other rank does anything. This module
imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from typing import Any, Optional

from ..exception import InternalError, TimeoutError
from . import seats
from .incarnation import call_prefix
from .membership import TERMINATED, Membership
from .records import HOST, MAX_MESSAGE, loads_strict

log = logging.getLogger("inprocess")

JOIN_ENV = "INPROCESS_JOIN"

ADMITTED = "admitted"
REFUSED = "refused"
GONE = "gone"
CLOSED = "closed"
_OUTCOMES = (ADMITTED, REFUSED, GONE, CLOSED)
ENDED = "ended:"  # the value of ``running`` once the job ended: "ended:<incarnation>"


def join_requested(env: Optional[dict[str, str]] = None) -> bool:
    """Whether this process was started to join a running job (``INPROCESS_JOIN=1``)."""
    value = (os.environ if env is None else env).get(JOIN_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{JOIN_ENV}={value!r}: expected 1 (join a running job) or 0")
    return value == "1"


def running_key(call: int) -> str:
    """Where the job of call ``call`` names its incarnation (not under any incarnation's prefix)."""
    return f"inprocess/running/{call}"


def new_token() -> str:
    return f"{HOST}-{os.getpid()}-{secrets.token_hex(4)}"


@dataclasses.dataclass(frozen=True)
class Announcement:
    """What a joiner says about itself (plain data)."""

    token: str
    seat: int  # the initial rank it asks for
    host: str
    pid: int
    config: dict[str, str]  # what must equal the job's: see :func:`config_difference`
    keys: Optional[list[list[str]]] = None  # its topology keys, for assignments that group ranks

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "Announcement":
        d = loads_strict(line)
        if not isinstance(d, dict):
            raise ValueError("expected a JSON object")
        token, seat, host, pid, config = d["token"], d["seat"], d["host"], d["pid"], d["config"]
        keys = d.get("keys")
        if not isinstance(token, str) or not token or "/" in token:
            raise ValueError(f"token={token!r:.80}")
        if type(seat) is not int or type(pid) is not int or not isinstance(host, str):
            raise ValueError("seat, pid: expected integers; host: a string")
        if not isinstance(config, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in config.items()):
            raise ValueError("config: expected an object of strings")
        if keys is not None and not (isinstance(keys, list) and all(
                isinstance(row, list) and all(isinstance(k, str) for k in row) for row in keys)):
            raise ValueError("keys: expected lists of strings")
        return cls(token, seat, host, pid, config, keys)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A joiner's outcome, parsed."""

    kind: str  # one of ADMITTED, REFUSED, GONE, CLOSED
    barrier: int = -1  # ADMITTED: the barrier whose decision admits it
    seat: int = -1
    life: int = 0
    why: str = ""

    def encode(self) -> str:
        if self.kind == ADMITTED:
            return f"{ADMITTED}:{self.barrier}:{self.seat}:{self.life}"
        return f"{self.kind}:{self.why[:MAX_MESSAGE]}"

    @classmethod
    def parse(cls, value: str) -> Optional["Outcome"]:
        """None for a pending joiner (empty value)."""
        if not value:
            return None
        kind, _, rest = value.partition(":")
        if kind not in _OUTCOMES:
            raise InternalError(f"joiner outcome {value[:120]!r}: expected one of {', '.join(_OUTCOMES)}")
        if kind != ADMITTED:
            return cls(kind, why=rest)
        try:
            barrier, seat, life = (int(v) for v in rest.split(":"))
        except ValueError:
            raise InternalError(f"joiner outcome {value[:120]!r}: expected admitted:<barrier>:<seat>:<life>") from None
        return cls(kind, barrier, seat, life)


def config_difference(job: dict[str, str], joiner: dict[str, str]) -> Optional[str]:
    """What makes a joiner unfit for the job, named; None when their configurations agree."""
    for name in sorted(set(job) | set(joiner)):
        mine, theirs = job.get(name), joiner.get(name)
        if mine != theirs:
            return f"{name} differs: the job has {mine!r}, this process has {theirs!r}"
    return None


class JoinKeys:
    """The join keys of one call (see the module docstring)."""

    def __init__(self, store: Any, call: int, incarnation: str):
        self.counted = store  # a CountingStore: every call counted, as the protocol's
        self.call = call
        self.incarnation = incarnation
        self.prefix = call_prefix(call, incarnation)

    def joiner_key(self, token: str) -> str:
        return f"{self.prefix}joiner/{token}"

    @property
    def lines_key(self) -> str:
        return f"{self.prefix}joiners"

    @property
    def resolved_key(self) -> str:
        return f"{self.prefix}joiners.resolved"

    # -- the job ------------------------------------------------------------------

    def name_running_incarnation(self) -> None:
        self.counted.set(running_key(self.call), self.incarnation)

    def running_incarnation(self) -> Optional[str]:
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
        self.counted.append(self.lines_key, announcement.to_json() + "\n")
        self.counted.add(f"{self.prefix}joiners.announced", 1)

    def waiting(self) -> int:
        """Joiners announced and not resolved yet: two counter reads (a grow's look, engine/grow.py)."""
        announced = self.counted.add(f"{self.prefix}joiners.announced", 0)
        return announced - self.counted.add(f"{self.prefix}joiners.resolved_count", 0)

    def resolve(self, token: str, outcome: Outcome) -> Outcome:
        """Write ``outcome`` unless the joiner was resolved already; returns the outcome that holds."""
        key = self.joiner_key(token)
        value = self.counted.compare_set(key, "", outcome.encode()).decode()
        if value == outcome.encode():
            # torch 2.13's legacy server wakes no waiter on compare_set; an empty append wakes them.
            self.counted.append(key, "")
            self.counted.add(f"{self.prefix}joiners.resolved_count", 1)
        held = Outcome.parse(value)
        if held is None:
            raise InternalError(f"joiner {token}: its outcome is still empty after a compare_set")
        return held

    def read_outcome(self, token: str) -> Optional[Outcome]:
        """The joiner's outcome, None while it is pending. A ``check`` first: the joiner
        waits on its key, and a read of a missing key would wake it with nothing."""
        key = self.joiner_key(token)
        if not self.counted.check([key]):
            return None
        raw = self.counted.peek(key)
        return None if raw is None else Outcome.parse(raw.decode())

    def wait_outcome(self, token: str, seconds: float) -> Optional[Outcome]:
        """The joiner's outcome once written; None when ``seconds`` passed first."""
        try:
            raw = self.counted.get_blocking(self.joiner_key(token), seconds, f"joiner {token}'s admission")
        except TimeoutError:
            return None
        outcome = Outcome.parse(raw.decode())
        if outcome is None:
            raise InternalError(f"joiner {token}: its key exists and is empty")
        return outcome

    # -- the leader ---------------------------------------------------------------

    def pending(self) -> tuple[int, list[tuple[int, Announcement]]]:
        """(lines resolved before, [(line index, announcement)] after them)."""
        raw = (self.counted.peek(self.lines_key) or b"").decode()
        if not raw:
            return 0, []
        done_raw = self.counted.peek(self.resolved_key)
        done = int(done_raw) if done_raw else 0
        out = []
        for index, line in enumerate(raw.splitlines()):
            if index < done or not line:
                continue
            try:
                out.append((index, Announcement.from_json(line)))
            except (ValueError, KeyError, TypeError) as e:
                log.warning("joiners: line %d cannot be read (%s): %.200s", index, e, line)
        return done, out

    def mark_resolved(self, lines: int) -> None:
        self.counted.set(self.resolved_key, str(lines))

    def close_pending(self, why: str) -> int:
        """Close every pending joiner (the job ended); returns how many were."""
        closed = 0
        try:
            _, pending = self.pending()
            for _, a in pending:
                if self.resolve(a.token, Outcome(CLOSED, why=why)).kind == CLOSED:
                    closed += 1
        except Exception as e:  # the job ends either way; a joiner's wait then ends with the store
            log.warning("could not close the waiting joiners: %s: %s", type(e).__name__, e)
        return closed


def admit(
    keys: JoinKeys, barrier: int, previous: Membership, job_config: dict[str, str], *,
    seat_key: Any, publish_keys: Any,
) -> list[tuple[int, int]]:
    """The leader of ``barrier``: admit the pending joiners whose seats are free.

    ``seat_key(r)`` names the seat of initial rank r; ``publish_keys(r, keys)``
    publishes a joiner's topology keys for its seat. Returns the admitted
    ``(seat, life)`` pairs in seat order, for the decision.
    """
    done, pending = keys.pending()
    if not pending:
        return []
    n = previous.initial_world_size
    free = {r for r in range(n) if previous.mode[r] == TERMINATED}
    admitted: dict[int, int] = {}
    still_open: list[int] = []  # lines a later barrier must look at again
    for index, a in pending:
        outcome = keys.read_outcome(a.token)
        if outcome is not None and not (outcome.kind == ADMITTED and outcome.barrier == barrier):
            continue  # resolved for good
        if outcome is None:
            outcome = _try_admit(keys, barrier, a, n, free, admitted, job_config, seat_key)
        if outcome is None:
            still_open.append(index)
            continue
        if outcome.kind == ADMITTED and outcome.barrier == barrier:
            # Admitted here (or by a leader of this barrier lost before its decision was out).
            _move_seat(keys, seat_key(outcome.seat), barrier, outcome.life)
            admitted[outcome.seat] = outcome.life
            free.discard(outcome.seat)
            still_open.append(index)  # until this barrier's decision is out, a takeover must see it
            if a.keys is not None:
                publish_keys(outcome.seat, a.keys)
    first_open = min(still_open) if still_open else (pending[-1][0] + 1)
    if first_open > done:
        keys.mark_resolved(first_open)
    return sorted(admitted.items())


def _try_admit(
    keys: JoinKeys, barrier: int, a: Announcement, n: int, free: set[int], admitted: dict[int, int],
    job_config: dict[str, str], seat_key: Any,
) -> Optional[Outcome]:
    """The outcome this leader writes for a pending joiner; None: it waits (its seat is held)."""
    why = config_difference(job_config, a.config)
    if why is None and not 0 <= a.seat < n:
        why = f"seat {a.seat} (its RANK) is not a seat of this job: expected 0..{n - 1}"
    if why is not None:
        log.warning("joiner %s (%s, pid %d) refused: %s", a.token, a.host, a.pid, why)
        return keys.resolve(a.token, Outcome(REFUSED, why=why))
    if a.seat not in free or a.seat in admitted:
        return None
    raw = keys.counted.peek(seat_key(a.seat))
    life = seats.parse(raw.decode()).life + 1 if raw else 1
    return keys.resolve(a.token, Outcome(ADMITTED, barrier, a.seat, life))


def _move_seat(keys: JoinKeys, key: str, barrier: int, life: int) -> None:
    """The seat of an admitted joiner: from its predecessor's "counted out" to ``b@life``."""
    desired = seats.healthy(barrier, life)
    raw = keys.counted.peek(key)
    current = raw.decode() if raw is not None else ""
    if current == desired:
        return  # moved by a leader of this barrier lost before its decision
    parsed = seats.parse(current) if current else None
    if parsed is not None and (not parsed.counted_out or parsed.life != life - 1):
        raise InternalError(f"seat {key} holds {current!r}: not the counted-out seat of life {life - 1} "
                            f"that a joiner of life {life} replaces")
    value = keys.counted.compare_set(key, current, desired).decode()
    if value != desired:
        raise InternalError(f"seat {key} moved to {value!r} while a joiner was admitted into it")
