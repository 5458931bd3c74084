"""Counting a rank out of the job on its behalf: by its monitor when it died,
by a peer's monitor when it was lost, or by the rank itself when it leaves
before it joined (:func:`inprocess.engine.leave.count_out_before_joining`).

Where the rank's seat (:mod:`inprocess.control.protocol`) says it stands:

* seat "b-1" (or none, b = 0): it has not arrived at barrier b. It is counted
  there as a terminated arrival, after its fault was recorded for iteration
  b-1 and that iteration's restart requested.
* seat "b" with barrier b decided: it took part in iteration b, so it is
  counted out of barrier b+1 the same way.
* seat "b" with no decision of barrier b out yet: it arrived healthy and was
  lost inside the barrier, perhaps as its leader. Its lost mark ends the
  barrier's current term, so that another rank decides barrier b without it
  (:mod:`inprocess.control.leadership`). Should the decision come out before
  the mark, with the rank in it, it is counted out of barrier b+1 instead.

Every path moves the seat with one compare_set first, to a value only this
caller writes ("t<barrier>:<who>"), so that however many declare a rank lost
at once, it is counted out once. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..exception import InternalError
from . import seats
from .leadership import RestartStore, mark_lost
from .records import Decision, FaultRecord
from .recovery_plan import leaves
from .seat_table import SeatTable
from .short_count import complete_count
from .store_ops import CountingStore

# Attempts to claim a seat that others keep moving (each move is a real arrival or claim: few).
_SEAT_ATTEMPTS = 64


class CountingOutStore(RestartStore, Protocol):
    """What counting out needs of :class:`inprocess.control.protocol.RestartProtocol`."""

    counted: CountingStore
    seat_table: SeatTable

    def read_seat(self, initial_rank: int) -> str | None: ...
    def record_fault(self, record: FaultRecord) -> None: ...
    def request_restart(self, iteration: int) -> bool: ...
    def leave(self, iteration: int, world_size: int) -> None: ...
    def barrier(self, iteration: int, initial_rank: int, expected: int, *, terminated: bool = ...,
                timeout: float, seat_taken: bool = ...) -> Any: ...
    def wait_decision(self, iteration: int, timeout: float) -> Decision: ...


def members_at(
    p: CountingOutStore, initial_rank: int, initial_world_size: int | None, timeout: float,
) -> Callable[[int], int | None]:
    """``expected_at`` for :func:`count_out`, as the rank itself and its monitor count it: barrier 0
    counts ``initial_world_size`` ranks (None: not known to the caller, an error there); barrier b
    the world of barrier b-1's decision, or None when that decision takes the rank out of the job
    (:func:`inprocess.control.recovery_plan.leaves`)."""

    def expected_at(barrier: int) -> int | None:
        if barrier == 0:
            if initial_world_size is None:
                raise RuntimeError(f"rank {initial_rank} left before the initial barrier, whose size is not known "
                                   f"here")
            return initial_world_size
        decision = p.wait_decision(barrier - 1, timeout)
        return None if leaves(decision, initial_rank) else decision.membership.world_size

    return expected_at


def count_out(
    p: CountingOutStore,
    initial_rank: int,
    fault: Callable[[int], FaultRecord],
    expected_at: Callable[[int], int | None],
    *,
    timeout: float,
    who: str,
    in_barrier: bool = True,
    life: int | None = None,
) -> int | None:
    """Count ``initial_rank`` out of the job on its behalf (module docstring: where).

    ``who`` names the caller uniquely among everybody who may count this rank
    out ("m<r>" for the monitor of rank r): the seat records it, and only the
    caller that reads its own name back won the seat. ``fault(i)`` is the
    rank's fault record for iteration i; ``expected_at(b)`` the number of
    ranks barrier b counts, or None when the rank is not a member there
    (nothing to do). Returns the barrier it was counted out at, or None when
    somebody else counted it out, or it is no member, or the iteration had
    completed (then this leaves on the rank's behalf). ``in_barrier`` False:
    the caller knows that the rank had left its last barrier (its monitor reads
    the phase on its heartbeat page), so that barrier's decision is out and
    is not looked for. ``life``: the life of the seat (:mod:`inprocess.control.seats`)
    whose process is counted out; a seat in another life is left alone (None:
    whichever process holds it, for a peer's monitor that cannot know).
    """
    for _ in range(_SEAT_ATTEMPTS):
        raw = p.read_seat(initial_rank)
        seat = None if raw is None else seats.parse(raw)
        if seat is not None and life is not None and seat.life != life:
            return None  # the seat holds another life's process: not the one counted out here
        if seat is not None and seat.counted_out:
            return None
        seat_life = 0 if seat is None else seat.life
        if seat is not None and in_barrier and not p.terms.decision_out(seat.barrier):
            lost_at = seat.barrier  # counted healthy there, lost before the decision came out
            if not _claim_seat(p, initial_rank, raw or "", lost_at, who, seat_life):
                continue
            if mark_lost(p, lost_at, fault(max(lost_at - 1, 0)), expected_at):
                # Its add may never have come (nor its ready): the barrier before this one's decision may
                # be gone already (its keys deleted), so the count is checked against the seats alone.
                complete_count(p, lost_at, timeout)
                return lost_at
            # The decision came out first: the rank is counted out of the next barrier, if a member.
            return _count_out_at(p, initial_rank, lost_at + 1, expected_at(lost_at + 1), fault, timeout)
        barrier = 0 if seat is None else seat.barrier + 1
        expected = expected_at(barrier)
        if expected is None:
            return None
        if _claim_seat(p, initial_rank, raw or "", barrier, who, seat_life):
            return _count_out_at(p, initial_rank, barrier, expected, fault, timeout)
    raise InternalError(f"rank {initial_rank}: its seat kept moving while it was counted out")


def _claim_seat(p: CountingOutStore, initial_rank: int, seat: str, barrier: int, who: str, life: int) -> bool:
    """Move the seat from ``seat`` to "t<barrier>:<who>" (in the same life); False when the
    rank (or another declarer) moved it meanwhile."""
    claim = seats.counted_out(barrier, who, life)
    return p.seat_table.compare_set(initial_rank, seat, claim) == claim


def _count_out_at(
    p: CountingOutStore, initial_rank: int, barrier: int, expected: int | None,
    fault: Callable[[int], FaultRecord], timeout: float,
) -> int | None:
    """The rank, whose seat this caller holds, arrives terminated at ``barrier``
    (which counts ``expected`` ranks; None: it is no member there)."""
    if expected is None:
        return None
    if barrier > 0:
        p.record_fault(fault(barrier - 1))
        if not p.request_restart(barrier - 1):
            p.leave(barrier - 1, expected)
            return None
    p.barrier(barrier, initial_rank, expected, terminated=True, timeout=timeout, seat_taken=True)
    return barrier
