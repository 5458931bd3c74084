"""Who decides a restart barrier, and who takes the lead over when that rank is lost first.

The first healthy arrival at barrier i leads it (:mod:`inprocess.control.protocol`).
If it dies after its arrival and before its decision is out, its seat already
says "counted healthy at i", so it cannot be counted out there in the usual
way; this module lets another healthy rank decide barrier i instead, with the
lost rank excluded from that very decision.

**Terms.** Barrier i's outcome is kept in a chain of keys, one per *term*:
``<i>/decision`` (term 0, led by the first healthy arrival), then
``<i>/decision.1``, ``<i>/decision.2``, ... Each is written once, with
compare_set on an empty key (the first writer wins), and holds either the
term's decision or a *lost mark*: ``lost:`` and the fault record of a rank
that was counted healthy at i and was lost before the term's decision was out.
A term's leader publishes only in its own term, and term t+1 opens only once
term t holds a mark, so the chain holds exactly one decision, in its last
term, however many leaders were lost and whoever raced.

**Marks.** Whoever counts a rank out on its behalf (its monitor, or a peer's
monitor that found it silent: :mod:`inprocess.control.counting_out`) and
finds its seat at "i" with no decision of barrier i out yet moves the seat
from "i" to "ti:<who>" (compare_set: exactly once per rank, whoever races),
then marks the first term without an outcome. (A rank's own monitor looks
only when the rank's heartbeat page says it was in a barrier.) It cannot tell
whether the rank led that term (nothing in the store says who the first
healthy arrival was), so it ends the term in doubt: if the rank did not lead,
the live leader's publish finds the mark and that leader follows the next
term like any other rank. The price, one more decision, is paid only when a
rank dies inside a barrier; the gain is that the lost rank is excluded by
barrier i's own decision instead of restarting iteration i for it. Should the
decision come out before the mark, the rank is counted out of barrier i+1 as
any rank lost after a decision. A monitor only marks: it never decides.

**Takeover.** A mark wakes every rank waiting for the term (it waits with a
blocking get on the term's key, which the mark creates: nobody polls). The
first training rank that then claims ``<i>/lead.<t+1>`` (compare_set, first
writer wins) and is not named by a mark it read leads term t+1: it waits for
the barrier's count, excludes the terminated arrivals and every rank the marks
of terms 0..t name, adds their records to the faults, decides and publishes.
A monitor or a node agent never claims (it has no decide function): it only
follows the chain. A node agent posts each mark on its board, which sends the
node's ranks to the store to follow the chain themselves.

**Cost.** Without a fault, the leader writes its decision with compare_set and
an empty append (the wake-up torch's legacy server needs) where it wrote one
``set``: one request more for the leader, none for anyone else. With a lost
leader: the mark (compare_set and append, after the seat), one claim per
waiting rank and term, and the new leader's reads of the marks.

The chain's keys (terms 1 and up, with their claims) are deleted with the
barrier's other keys: every decision says in which term it came out.

**Not covered.** A rank that dies between taking its seat and its ``add``
(two consecutive store calls) is taken for counted, as before: the barrier
then waits for it until ``barrier_timeout``. When every healthy arrival is
lost and the count is completed last by a rank arriving terminated (not by a
mark), nobody ends the job's keys: the store host ends at its idle timeout.
This module imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from ..exception import InternalError
from .keys import CallKeys
from .records import DecideFn, Decision, FaultRecord, loads_strict
from .store_ops import CountingStore, Deadline

log = logging.getLogger("inprocess")

LOST_MARK = b"lost:"
# Barriers whose last term a connection remembers, counting back from the newest it saw:
# a leader deletes the keys of the barrier before its own, the end of a job the two last.
_REMEMBERED_BARRIERS = 3


def lost_mark(record: FaultRecord) -> str:
    """The mark that ends a term: the lost rank's fault record."""
    return LOST_MARK.decode() + record.to_json()


def parse_lost_mark(raw: bytes) -> FaultRecord | None:
    """The fault record of a lost mark, or None when ``raw`` is no mark (then it is a decision)."""
    if not raw.startswith(LOST_MARK):
        return None
    try:
        return FaultRecord.from_dict(loads_strict(raw[len(LOST_MARK):]))
    except (ValueError, KeyError, TypeError) as e:
        raise InternalError(f"corrupted lost mark {raw[:200]!r}: {e}") from None


class Terms:
    """The terms of the barriers of one wrapped call, over one store connection.

    ``prefix`` is the call's key prefix (a barrier's keys are
    ``<prefix><barrier>/<name>``). The instance remembers the last term it saw
    per barrier, so that :meth:`delete` knows which keys exist without asking
    the store.
    """

    def __init__(self, counted: CountingStore, prefix: str):
        self.counted = counted
        self.keys = CallKeys(prefix)
        self._last_term: dict[int, int] = {}

    def outcome_key(self, barrier: int, term: int) -> str:
        return self.keys.term_outcome(barrier, term)

    def claim_key(self, barrier: int, term: int) -> str:
        return self.keys.term_claim(barrier, term)

    def saw(self, barrier: int, term: int) -> None:
        """Term ``term`` of ``barrier`` exists (its outcome was read or written here)."""
        known = self._last_term.get(barrier)
        if known is not None:
            if term > known:
                self._last_term[barrier] = term
            return
        self._last_term[barrier] = term
        newest = max(self._last_term)  # only where a barrier is new: the others were pruned against it already
        for old in [b for b in self._last_term if b <= newest - _REMEMBERED_BARRIERS]:
            del self._last_term[old]

    # -- writing ----------------------------------------------------------------

    def write(self, barrier: int, term: int, value: str) -> bytes:
        """``value`` as the outcome of the term, unless it has one: returns what the term holds."""
        key = self.outcome_key(barrier, term)
        held = self.counted.compare_set(key, "", value)
        # torch 2.13's legacy server wakes no waiter on compare_set; an empty append
        # wakes them on both backends. Also when another writer won: it may have died
        # between its compare_set and its own append.
        self.counted.append(key, "")
        self.saw(barrier, term)
        return held

    def claim(self, barrier: int, term: int, who: str) -> bool:
        """Claim the lead of term ``term`` (``who`` names the claimant uniquely): True if won."""
        return self.counted.compare_set(self.claim_key(barrier, term), "", who).decode() == who

    def mark_lost(self, barrier: int, record: FaultRecord) -> int | None:
        """End the first term of ``barrier`` without an outcome with the mark of
        ``record`` (the lost rank's fault). Returns the term it marked, or None
        when the decision came out first (then nothing was marked)."""
        mark = lost_mark(record)
        term = 0
        while True:
            held = self.write(barrier, term, mark)
            if held == mark.encode():
                return term
            if parse_lost_mark(held) is None:
                return None
            term += 1

    # -- reading ----------------------------------------------------------------

    def wait(
        self, barrier: int, term: int, deadline: Deadline, *, cancelled: Callable[[], bool] | None = None
    ) -> bytes:
        """The outcome of the term, once written (a decision or a lost mark)."""
        while True:
            raw = self.counted.get_blocking(self.outcome_key(barrier, term), deadline.remaining(),
                                            f"barrier {barrier}", cancelled=cancelled)
            # An outcome is never empty: b"" is a get that torch's libuv server woke early, on another
            # client's compare_set of the missing key (store_ops.peek). Wait again, within the deadline.
            if raw:
                break
        self.saw(barrier, term)
        return raw

    def decision_out(self, barrier: int) -> bool:
        """Whether barrier ``barrier`` has its decision (reads the chain without waiting)."""
        term = 0
        while True:
            raw = self.counted.peek_awaited(self.outcome_key(barrier, term))  # the ranks may wait for it
            if raw is None:
                return False
            if parse_lost_mark(raw) is None:
                self.saw(barrier, term)
                return True
            term += 1

    def marks_before(self, barrier: int, term: int) -> list[FaultRecord]:
        """The records of the marks of terms 0 .. ``term`` - 1: what term ``term``'s leader excludes."""
        records = []
        for t in range(term):
            raw = self.counted.peek(self.outcome_key(barrier, t))
            record = None if raw is None else parse_lost_mark(raw)
            if record is None:
                raise InternalError(f"barrier {barrier}: term {term} is led, but term {t} holds {raw!r:.200}, "
                                    f"expected a lost mark")
            records.append(record)
        return records

    # -- cleanup ------------------------------------------------------------------

    def delete(self, barrier: int) -> None:
        """Delete the keys of the terms after the first (the takeovers) of ``barrier``.

        Where this connection never saw the barrier's last term it deletes
        terms until one had no outcome: a barrier's terms are consecutive.
        """
        last = self._last_term.get(barrier)
        if last is not None:
            for term in range(1, last + 1):
                self.counted.delete_key(self.outcome_key(barrier, term))
                self.counted.delete_key(self.claim_key(barrier, term))
            return
        term = 1
        while True:
            existed = self.counted.delete_key(self.outcome_key(barrier, term))
            self.counted.delete_key(self.claim_key(barrier, term))  # a claimant may have died before its outcome
            if not existed:
                return
            term += 1


# -- deciding a barrier --------------------------------------------------------------


class RestartStore(Protocol):
    """What deciding a barrier needs of :class:`inprocess.control.protocol.RestartProtocol`
    (which imports this module: it is named here by what it offers)."""

    terms: Terms
    lead_term: int

    def count(self, iteration: int) -> tuple[int, int]: ...
    def wait_ready(self, iteration: int, deadline: Deadline) -> None: ...
    def read_terminated(self, iteration: int, count: int) -> set[int]: ...
    def read_faults(self, iteration: int) -> list[FaultRecord]: ...
    def publish_decision(self, decision: Decision) -> bool: ...
    def delete_iteration(self, iteration: int) -> None: ...
    def finish_job(self, iteration: int) -> None: ...


def decide_barrier(
    p: RestartStore, barrier: int, initial_rank: int, expected: int, decide: DecideFn | None,
    deadline: Deadline, *, lead: bool = False, dead: int | None = None,
) -> Decision:
    """Barrier ``barrier``'s decision, which counts ``expected`` ranks: this rank
    leads the first term if ``lead`` (``dead``: the terminated count when its own
    arrival completed the count), else waits for it. A term that ends with a lost
    mark is followed by the next, which this rank claims if it can decide
    (``decide``) and no mark it read names it."""
    term = 0
    named: set[int] = set()
    while True:
        if lead:
            decision = _lead(p, barrier, initial_rank, expected, term, dead, decide, deadline)
            if decision is not None:
                return decision
        raw = p.terms.wait(barrier, term, deadline)
        mark = parse_lost_mark(raw)
        if mark is None:
            decision = Decision.from_json(raw)
            p.terms.saw(barrier, decision.term)
            return decision
        log.warning("barrier %d: rank %d was lost before term %d's decision (%s): another rank takes the lead",
                    barrier, mark.rank, term, mark.message)
        named.add(mark.rank)
        term, dead = term + 1, None
        lead = decide is not None and initial_rank not in named and p.terms.claim(barrier, term, str(initial_rank))


def _lead(
    p: RestartStore, barrier: int, initial_rank: int, expected: int, term: int, dead: int | None,
    decide: DecideFn | None, deadline: Deadline,
) -> Decision | None:
    """The leader's part in term ``term``: the decision, or None when the term
    was marked lost before it came out (the leader then follows the next)."""
    if decide is None:
        raise InternalError(f"barrier {barrier}: rank {initial_rank} leads but was given no decide function")
    if dead is None:
        dead = _wait_count(p, barrier, expected, term, deadline)
    lost = p.terms.marks_before(barrier, term)
    excluded = p.read_terminated(barrier, dead) | {record.rank for record in lost}
    p.lead_term = term
    try:
        decision = decide(excluded, p.read_faults(barrier - 1) + lost, initial_rank)
    finally:
        p.lead_term = 0
    decision.term = term
    if not p.publish_decision(decision):
        return None
    p.delete_iteration(barrier - 1)
    if decision.membership.world_size == 0:
        p.finish_job(barrier)
    return decision


def _wait_count(p: RestartStore, barrier: int, expected: int, term: int, deadline: Deadline) -> int:
    """Until every rank arrived at ``barrier``: the terminated count."""
    if term > 0:
        # The first leader's own arrival may have completed the count: it set no ``ready``.
        healthy, dead = p.count(barrier)
        if healthy + dead >= expected:
            return dead
    p.wait_ready(barrier, deadline)
    return p.count(barrier)[1]


def mark_lost(
    p: RestartStore, barrier: int, record: FaultRecord, expected_at: Callable[[int], int | None]
) -> bool:
    """End the current term of ``barrier`` with the lost mark of ``record``,
    for a rank whose seat the caller moved from "``barrier``" to
    "t``barrier``:<who>". False when the decision came out first. The mark that
    leaves no healthy arrival alive once everyone arrived ends the job's keys:
    nobody is left to decide (``expected_at(barrier)``: the ranks it counts)."""
    marked = p.terms.mark_lost(barrier, record)
    if marked is None:
        return False
    healthy, dead = p.count(barrier)
    if healthy == marked + 1 and healthy + dead == expected_at(barrier):
        p.finish_job(barrier)
    return True
