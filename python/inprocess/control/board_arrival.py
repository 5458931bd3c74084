"""A rank's arrival at a barrier through its node's board (:mod:`inprocess.processes.node_agent`).

The rank posts its arrival and its seat on the board (:func:`post_arrival`); the
agent takes the node's seats in the store and forwards the arrivals with one
``add``; the board then names this rank the barrier's leader, or holds the
decision (:func:`await_outcome`). A rank whose agent goes away before it
forwarded the arrival, or refused its seat, counts itself at the store
(:meth:`inprocess.control.protocol.RestartProtocol.barrier`, its seat first).
This module imports no torch.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from ..exception import InternalError
from .leadership import RestartStore, decide_barrier
from .node_link import BOARD_TIMEOUT, NODE_POLL_S, OUTCOME_DECIDED, OUTCOME_LEAD, OUTCOME_REFUSED, NodeBoardLink
from .records import DecideFn, Decision
from .seats import SeatTaken
from .store_ops import Deadline, wait_in_chunks

log = logging.getLogger("inprocess")



class BoardArrivals(RestartStore, Protocol):
    """What arriving through the board needs of :class:`inprocess.control.protocol.RestartProtocol`
    (which imports this module: it is named here by what it offers)."""

    link: NodeBoardLink | None
    life: int

    def take_seat(self, iteration: int, initial_rank: int, *, terminated: bool = ...) -> bool: ...
    def barrier(self, iteration: int, initial_rank: int, expected: int, *, decide: DecideFn | None = ...,
                timeout: float, seat_taken: bool = ...) -> Any: ...
    def posted_decision(self, posted: tuple[int, bytes | None] | None, iteration: int) -> Decision | None: ...


def _link(p: BoardArrivals) -> NodeBoardLink:
    if p.link is None:
        raise InternalError("a barrier through the node board needs a node link; this protocol has none")
    return p.link


def post_arrival(p: BoardArrivals, iteration: int, initial_rank: int, expected: int) -> None:
    """A healthy arrival through the node agent, first half: the arrival
    and the rank's seat on the board; the agent takes the seat in the
    store with the node's others and forwards the arrival."""
    _link(p).post_arrival(iteration, expected, initial_rank, p.life)


def replaced(link: NodeBoardLink, iteration: int) -> bool:
    """Whether this rank's slot holds an arrival at a later barrier than ``iteration``: a process
    that joined into its seat posted it (this one was counted out, and is late). Its arrival must
    not take the slot back; at the store, its seat tells it that it was counted out."""
    later = link.posted() > iteration
    if later:
        log.info("barrier %d: node board slot %d holds an arrival at barrier %d: this process was replaced, "
                 "it arrives at the store", iteration, link.slot, link.posted())
    return later


def await_outcome(
    p: BoardArrivals, iteration: int, initial_rank: int, expected: int, *, decide: DecideFn | None = None,
    timeout: float,
) -> Decision:
    """Second half: the board names this rank the leader, or holds the
    decision. If the agent goes away meanwhile, the rank counts itself
    directly unless the agent had forwarded its arrival."""
    link = _link(p)
    deadline = Deadline(timeout)

    def attempt(seconds: float) -> int | None:
        outcome = link.wait_outcome(iteration, seconds)
        if outcome == BOARD_TIMEOUT and link.posted() < iteration:
            # The process this one replaced (counted out, late) posted an older arrival over this
            # one's before the agent read it: posted again. The agent forwards a slot's barrier once.
            post_arrival(p, iteration, initial_rank, expected)
        return outcome if outcome in (OUTCOME_LEAD, OUTCOME_DECIDED, OUTCOME_REFUSED) else None

    outcome = attempt(0.0)  # posted already: no chunked wait to set up
    if outcome is None:
        outcome = wait_in_chunks(attempt, deadline, f"barrier {iteration} decision", "node board",
                                 chunk_s=NODE_POLL_S, go_on=link.alive)
    if outcome == OUTCOME_LEAD:
        return decide_barrier(p, iteration, initial_rank, expected, decide, deadline, lead=True)
    if outcome == OUTCOME_DECIDED:
        decision = p.posted_decision(link.read_decision(), iteration)
        if decision is not None:
            return decision
        # Too large for the board, or a lost mark: the terms are followed at the store.
        return decide_barrier(p, iteration, initial_rank, expected, decide, deadline)
    # The agent refused the seat, or is gone before it counted this rank.
    if outcome == OUTCOME_REFUSED or link.forwarded() < iteration:
        return _arrive_directly(p, iteration, initial_rank, expected, decide, deadline)
    leads = link.leads() == iteration
    return decide_barrier(p, iteration, initial_rank, expected, decide, deadline, lead=leads)


def _arrive_directly(
    p: BoardArrivals, iteration: int, initial_rank: int, expected: int, decide: DecideFn | None,
    deadline: Deadline,
) -> Decision:
    """Count this rank at the store itself: its seat first (the agent may have
    taken it already, which the compare_set answers as taken), then the barrier."""
    if not p.take_seat(iteration, initial_rank):
        raise SeatTaken(f"initial rank {initial_rank} was counted out of barrier {iteration} by another process")
    remaining = max(deadline.remaining() or 0.0, 0.0)
    decision = p.barrier(iteration, initial_rank, expected, decide=decide, timeout=remaining, seat_taken=True)
    assert isinstance(decision, Decision)  # a healthy arrival always returns the decision
    return decision
