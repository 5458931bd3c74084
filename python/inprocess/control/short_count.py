"""A barrier whose count a dead rank left short: completed from the seats, by the monitor that lost it.

A rank arrives at a barrier with two store calls: its seat's compare_set, then its ``add`` to the
barrier's count (and, if that ``add`` completed the count, a third: ``ready``). A rank that dies
between the two (or whose connection is lost with the ``add`` in flight) leaves its seat saying
"arrived" and the count maybe one short; one that dies after an ``add`` that completed the count
leaves ``ready`` unset. Its monitor then finds the
seat at the barrier with no decision out, takes the seat, and ends the barrier's term with a lost
mark (:mod:`inprocess.control.counting_out`); the next term's leader waits for the count to
complete (``ready``), which, one ``add`` short, it never does: every rank waited ``barrier_timeout``
(the chaos simulator found it: ``python -m inprocess.chaos simulate``, seed 1 of its 4-rank schedules).

Whether the ``add`` landed cannot be read from the store: the count does not say whose it holds. The
seats do: once every member's seat has moved to the barrier (arrived healthy, or counted out there),
the only arrivals the count can still miss are those of the ranks lost with their seat at the
barrier. So the monitor that marked its rank lost waits until the seats say so, checks that the count
agrees with them but for those lost ranks' ``add``, and sets ``ready``. It waits on
``ready`` itself in between (set by the last arrival when the count did complete), reading the seats
every :data:`RECHECK_S` (1,024 per call): only on this failure path, and only in the monitor.

This module imports no torch.
"""

from __future__ import annotations

import logging
from typing import Any

from . import seats
from .leadership import parse_lost_mark
from .store_ops import Deadline, is_timeout

log = logging.getLogger("inprocess")

RECHECK_S = 0.25
_SEATS_PER_READ = 1024


def census(p: Any, barrier: int, world_size: int) -> tuple[int, int, set[int]]:
    """From the seats, at ``barrier``: (members not arrived yet, surely arrived healthy, taken there).

    A seat that moved past the barrier arrived healthy first. A seat taken at the barrier ("t<b>:...")
    is a terminated arrival there, or a rank lost there (its ``add`` maybe made, maybe not), or one that
    arrived healthy and was counted out of the next barrier by a monitor that found the decision out once
    it held the seat: the barrier's terminated arrivals tell the first kind from the two others."""
    waiting = healthy = 0
    taken: set[int] = set()
    for start in range(0, world_size, _SEATS_PER_READ):
        held = p.seat_table.read_many(range(start, min(start + _SEATS_PER_READ, world_size)))
        for rank, raw in held.items():
            if raw is None:
                waiting += barrier == 0
                continue
            seat = seats.parse(raw)
            if seat.barrier > barrier or (seat.barrier == barrier and not seat.counted_out):
                healthy += 1
            elif seat.barrier == barrier:
                taken.add(rank)
            elif seat.barrier == barrier - 1 and not seat.counted_out:
                waiting += 1
    return waiting, healthy, taken


def lost_ranks(p: Any, barrier: int) -> tuple[set[int], bool]:
    """The ranks the lost marks of ``barrier`` name, and whether its decision is out (after them)."""
    lost: set[int] = set()
    term = 0
    while True:
        # The ranks wait for this term's outcome: a plain peek of it while missing would wake them with
        # b"" (store_ops.peek; seen as "corrupted decision record b''" when a monitor counted a frozen
        # rank out of a barrier).
        raw = p.counted.peek_awaited(p.terms.outcome_key(barrier, term))
        if raw is None:
            return lost, False
        mark = parse_lost_mark(raw)
        if mark is None:
            return lost, True
        lost.add(mark.rank)
        term += 1


def complete_count(p: Any, barrier: int, timeout: float | None) -> bool:
    """After this caller marked a rank lost at ``barrier``: sets
    ``ready`` when the seats show every member arrived and the count agrees with them but for lost
    ranks' ``add``. True when it set it; False when ``ready`` or the decision came out first, the seats
    cannot be read (no world size known), or ``timeout`` passed."""
    world_size = p.initial_world_size
    if world_size is None:
        return False
    ready = p.key(barrier, "ready")
    deadline = Deadline(timeout)
    while True:
        # A decision that came out through a later term does not wake a first leader that waits for
        # ready (the simulator's seed 66): the count's ready is set all the same, unless the barrier after
        # it decided already (its leader deleted this barrier's keys: a late ready would stay behind).
        if p.counted.check([ready]) or p.terms.decision_out(barrier + 1):
            return False
        waiting, healthy_seats, taken = census(p, barrier, world_size)
        healthy, dead = p.count(barrier)
        raw = p.counted.peek(p.key(barrier, "terminated")) or b""
        recorded = {int(r) for r in raw.decode().split(",") if r}
        lost, decided = lost_ranks(p, barrier)
        # Lost there, or (once decided) counted out of the next barrier: their add maybe made. A seat taken
        # there by anyone else is a terminated arrival on its way (it appends, then adds): wait for it.
        unsure = (taken - recorded) if decided else (taken & lost)
        if not decided and taken - recorded - lost:
            waiting += 1
        # Nobody in flight: every member arrived; every terminated arrival recorded is counted (it
        # appends before it adds); the healthy count holds every healthy seat, and at most the unsure ones.
        if not waiting and dead == len(recorded) and healthy_seats <= healthy <= healthy_seats + len(unsure):
            # Short by the lost ranks' adds, or complete by an add whose rank died before it set ready
            # (the arrival that completes the count sets it): either way nobody else will set it.
            log.warning("barrier %d: every rank arrived (the count holds %d): a rank was lost between its seat and "
                        "its arrival's end; its monitor says the count is complete", barrier, healthy + dead)
            p.counted.set(ready, "1")
            return True
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            return False
        try:
            p.counted.wait_key(ready, RECHECK_S if remaining is None else min(RECHECK_S, remaining), "ready")
        except Exception as e:
            if not is_timeout(e) and type(e).__name__ != "TimeoutError":
                raise
