"""The leader's one decision per restart (design principle 3): run the rank
assignment over the previous membership and turn the outcome into a
:class:`~inprocess.control.protocol.Decision`.

The store protocol only carries the decision; it imports no assignment. The
wrapper hands :func:`decide` to the restart barrier as its decide callback.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from ..control.membership import TERMINATED, Membership
from ..control.protocol import Decision, FaultRecord
from .base import RankAssignmentCtx, Topology

log = logging.getLogger("inprocess")


def run_assignment(
    rank_assignment: Any,
    previous: Membership,
    terminated: set[int],
    iteration: int,
    topology: Topology,
) -> tuple[Membership, set[int]]:
    """Apply the hook to a copy of ``previous`` and check the result.

    Returns the new table and every rank terminated in this restart (those
    reported plus those the assignment terminated itself).
    """
    membership = previous.copy()
    membership.terminate(terminated)
    ctx = RankAssignmentCtx(membership, set(terminated), iteration, topology, previous)
    out = rank_assignment(ctx)
    if out is not None:
        ctx = out
    newly = {r for r, mode in enumerate(ctx.membership.mode) if mode == TERMINATED and previous.mode[r] != TERMINATED}
    ctx.membership.validate(previous, newly)
    return ctx.membership, newly




def decide(
    rank_assignment: Any,
    previous: Membership,
    dead: set[int],
    faults: list[FaultRecord],
    iteration: int,
    leader: int,
    topology: Optional[Topology] = None,
) -> Decision:
    """The leader's one decision for the whole job.

    Never raises: a failing rank assignment becomes a decision that ends the
    job on every rank (``abort``), with the error in its message.
    """
    start = time.monotonic_ns()
    abort = None
    try:
        membership, newly = run_assignment(
            rank_assignment, previous, dead, iteration, topology if topology is not None else Topology.empty()
        )
        if membership.active_world_size == 0 and membership.world_size > 0:
            abort = "no active rank is left"
    except BaseException as e:
        log.error("rank assignment failed on leader %d: %s: %s", leader, type(e).__name__, e)
        membership = previous.copy()
        membership.terminate(dead)
        newly = set(dead)
        abort = f"rank assignment failed: {type(e).__name__}: {e}"
    end = time.monotonic_ns()
    return Decision(
        iteration, membership, sorted(newly), faults, len(faults), leader, abort, end, assignment_ns=end - start
    )
