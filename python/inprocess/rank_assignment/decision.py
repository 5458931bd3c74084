"""The leader's one decision per restart (design principle 3), for both kinds of rank assignment.

* **Job-wide** (every member a :class:`~inprocess.rank_assignment.job.JobAssignment`,
  as every built-in is): the leader runs the steps once over the whole table.
* **Per-rank** (a member is a per-rank hook, ``__call__(ctx)`` as there): the
  leader runs the composition for every rank on the agreed inputs (the
  previous decision, the ranks leaving), exactly as that rank would, and
  publishes the table their results form. If the results discard further
  ranks, it runs them again with those ranks leaving too, until no rank is
  discarded that is not leaving, so that every rank sees the same
  ``terminated_ranks``: the ones that leave at this restart. Each rank then
  runs its own hook on the same inputs and checks that its result is its row
  of the decision (:func:`verify_own_row`); a rank that disagrees leaves with
  :class:`RankAssignmentMismatch`, and the next decision ends the job with
  the ranks and both results named.

Either way the table passes :mod:`.consistency` before it is published; a
failure ends the job on every rank. The store protocol only carries the
decision and imports no assignment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..compose import leaves
from ..control.membership import NONE, TERMINATED, Membership
from ..control.protocol import Decision, FaultRecord
from ..control.records import ENDS_JOB
from ..exception import RankDiscarded, RestartAbort
from ..state import FrozenState
from .agreed import AgreedInputs, assigned_active_world_size, describe_row, row_of, table_row
from .base import JobAssignmentCtx, RankAssignmentCtx, Topology
from .composition import uses_per_rank_hooks
from .consistency import InconsistentAssignment, check_agreement, check_membership

log = logging.getLogger("inprocess")

# Rounds of the per-rank evaluation before the set of leaving ranks must have settled.
MAX_SETTLE_ROUNDS = 8

Row = tuple[int, int, int, int, int | None]


class RankAssignmentMismatch(RestartAbort):
    """This rank's own run of a per-rank rank assignment differs from its row of the decision."""


class _NoStore:
    """``ctx.store`` of a per-rank hook run on agreed inputs: any use is refused with the reason."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"ctx.store.{name}: a per-rank rank assignment runs on inputs every rank agreed on (on the leader for "
            f"every rank, and on each rank to check its row), so it cannot use the store; see docs/rank_assignment.md"
        )

    def __repr__(self) -> str:
        return "<no store: per-rank rank assignments run on agreed inputs>"


NO_STORE = _NoStore()


def run_job_wide(
    rank_assignment: Any, previous: Membership, lost: set[int], iteration: int, topology: Topology
) -> tuple[Membership, set[int]]:
    """Every member's ``assign_job`` in execution order on a copy of ``previous``; the checked
    table and the initial ranks it terminated (those lost, and those the assignment removed)."""
    job = JobAssignmentCtx(
        previous.copy(), set(lost), assigned_active_world_size(previous), iteration, topology, previous
    )
    for leaf in leaves(rank_assignment):
        job = leaf.assign_job(job) or job
    check_membership(job.membership, job.active_world_size, previous, lost, job.terminated_ranks)
    return job.membership, _newly_terminated(previous, job.membership)


def run_per_rank(rank_assignment: Any, inputs: AgreedInputs, lost: set[int]) -> tuple[Membership, set[int]]:
    """The composition run for every rank on the agreed inputs (see the module docstring)."""
    previous = inputs.previous
    alive = [r for r in range(previous.initial_world_size) if previous.mode[r] != TERMINATED]
    leaving = set(lost)
    with inputs.active():
        for _ in range(MAX_SETTLE_ROUNDS):
            rows, discarded = _evaluate_every_rank(rank_assignment, inputs, alive, leaving)
            if not discarded:
                break
            leaving |= discarded
        else:
            raise InconsistentAssignment(
                f"the per-rank rank assignment discarded more ranks in each of {MAX_SETTLE_ROUNDS} rounds (last: "
                f"initial ranks {sorted(discarded)[:16]}): it must discard the same ranks when they are among "
                f"terminated_ranks"
            )
    n = previous.initial_world_size
    m = Membership([TERMINATED] * n, [NONE] * n, [NONE] * n)
    for r, (mode, rank, act, _, _) in rows.items():
        m.mode[r], m.rank[r], m.active_rank[r] = mode, rank, act
    check_membership(m, m.active_world_size, previous, lost)
    check_agreement(m, {r: (row[3], row[4]) for r, row in rows.items()})
    return m, _newly_terminated(previous, m)


def _evaluate_every_rank(
    rank_assignment: Any, inputs: AgreedInputs, alive: list[int], leaving: set[int]
) -> tuple[dict[int, Row], set[int]]:
    ranks_leaving = {inputs.previous.rank[r] for r in leaving}
    rows: dict[int, Row] = {}
    discarded: set[int] = set()
    for r in alive:
        if r in leaving:
            continue
        try:
            rows[r] = run_for_rank(rank_assignment, inputs, r, ranks_leaving)
        except RankDiscarded:
            discarded.add(r)
    return rows, discarded


def run_for_rank(
    rank_assignment: Any,
    inputs: AgreedInputs,
    initial_rank: int,
    ranks_leaving: set[int],
    fn_exception: BaseException | None = None,
) -> Row:
    """The row the composition gives ``initial_rank`` on the agreed inputs (RankDiscarded passes through)."""
    ctx = RankAssignmentCtx(inputs.state_of(initial_rank, fn_exception), NO_STORE, set(ranks_leaving))
    out = rank_assignment(ctx)
    if out is None:
        out = ctx
    state = getattr(out, "state", None)
    if state is None or not all(hasattr(state, f) for f in ("mode", "rank", "active_rank", "world_size")):
        raise InconsistentAssignment(
            f"{rank_assignment!r} returned {out!r} for initial rank {initial_rank}: expected a RankAssignmentCtx "
            f"holding the rank's next state"
        )
    return row_of(state)


def _newly_terminated(previous: Membership, m: Membership) -> set[int]:
    return {r for r, mode in enumerate(m.mode) if mode == TERMINATED and previous.mode[r] != TERMINATED}


def verify_own_row(
    rank_assignment: Any, inputs: AgreedInputs, before: FrozenState, decision: Decision
) -> None:
    """Run the per-rank composition for this rank on the agreed inputs and compare with its row.

    Raises :class:`RankAssignmentMismatch` naming both results when they differ.
    """
    r = before.initial_rank
    m = decision.membership
    if m.mode[r] == TERMINATED:
        return  # a rank the decision terminated leaves; nothing of it runs on
    previous = inputs.previous
    ranks_leaving = {previous.rank[x] for x in decision.terminated if previous.mode[x] != TERMINATED}
    theirs: Row = table_row(m, m.active_world_size, r)
    with inputs.active():
        try:
            mine = run_for_rank(rank_assignment, inputs, r, ranks_leaving, before.fn_exception)
            described = describe_row(mine)
        except RankDiscarded:
            mine, described = (TERMINATED, NONE, NONE, m.world_size, m.active_world_size), "TERMINATED"
        except Exception as e:
            mine, described = (-1, NONE, NONE, 0, None), f"{type(e).__name__}: {e}"
    if mine != theirs:
        raise RankAssignmentMismatch(
            f"initial rank {r}: the rank assignment gives {described} here, the leader's decision "
            f"{describe_row(theirs)}; a per-rank rank assignment must depend only on ctx.state and "
            f"ctx.terminated_ranks (docs/rank_assignment.md)"
        )


def decide(
    rank_assignment: Any,
    previous: Membership,
    dead: set[int],
    faults: list[FaultRecord],
    iteration: int,
    leader: int,
    topology: Topology | None = None,
    *,
    hook_iteration: int | None = None,
    failures: list[BaseException] | None = None,
    before_assignment: Callable[[], None] | None = None,
) -> Decision:
    """The leader's one decision for the whole job.

    ``previous`` is the decision of the iteration that ended
    (:func:`~inprocess.rank_assignment.initial_membership` before the
    first); ``dead`` the initial ranks lost at this restart. Never raises: a
    failing or inconsistent rank assignment, or a rank that reported a
    :class:`RankAssignmentMismatch`, becomes a decision that ends the job on
    every rank (``abort``), with the error in its message; so does a rank
    that raised a ``RestartAbort`` (a fault of kind ``ENDS_JOB``), and then
    the rank assignment does not run. The exception of
    a failing hook (not the consistency checks' own) is appended to
    ``failures``: the leader leaves with it, as the caller of a per-rank hook
    would. ``before_assignment``
    runs first, inside that rule (the fault injector's ``phase=reassignment``).
    """
    start = time.monotonic_ns()
    abort = None
    topology = topology if topology is not None else Topology.empty()
    try:
        if before_assignment is not None:
            before_assignment()
        _abort_on_mismatch(faults)
        abort = _ended_by_a_rank(faults)
        if abort is not None:
            membership, newly = _unchanged(previous, dead)
        elif uses_per_rank_hooks(rank_assignment):
            seen = max(iteration - 1, 0) if hook_iteration is None else hook_iteration
            inputs = AgreedInputs(previous, iteration, seen, lambda: topology)
            membership, newly = run_per_rank(rank_assignment, inputs, dead)
        else:
            membership, newly = run_job_wide(rank_assignment, previous, dead, iteration, topology)
        if abort is None and membership.active_world_size == 0 and membership.world_size > 0:
            abort = "no active rank is left"
    except BaseException as e:
        log.error("rank assignment failed on leader %d: %s: %s", leader, type(e).__name__, e)
        membership, newly = _unchanged(previous, dead)
        abort = f"rank assignment failed: {type(e).__name__}: {e}"
        if failures is not None and not isinstance(e, (InconsistentAssignment, RankAssignmentMismatch)):
            failures.append(e)
    end = time.monotonic_ns()
    return Decision(
        iteration, membership, sorted(newly), faults, len(faults), leader, abort, end, assignment_ns=end - start
    )


def _unchanged(previous: Membership, dead: set[int]) -> tuple[Membership, set[int]]:
    """The membership of a decision that ends the job: the previous one, the lost ranks terminated."""
    membership = previous.copy()
    membership.terminate(dead)
    return membership, set(dead)


def _ended_by_a_rank(faults: list[FaultRecord]) -> str | None:
    """Why the job ends when a rank raised a RestartAbort (a fault of kind ENDS_JOB): the ranks and the
    first one's exception, whose message a caller may match on (RetryController's "iteration=<n>")."""
    ending = sorted((f for f in faults if f.kind == ENDS_JOB), key=lambda f: f.rank)
    if not ending:
        return None
    first = ending[0]
    ranks = sorted({f.rank for f in ending})
    who = f"initial rank {first.rank}" if len(ranks) == 1 else f"initial ranks {', '.join(map(str, ranks))}"
    return f"{who} raised {first.type} in iteration {first.iteration}: {first.message}"


def _abort_on_mismatch(faults: list[FaultRecord]) -> None:
    mismatched = [f for f in faults if f.type == RankAssignmentMismatch.__name__]
    if mismatched:
        ranks = ", ".join(str(f.rank) for f in mismatched)
        raise RankAssignmentMismatch(f"initial ranks {ranks} disagree with the decision: {mismatched[0].message}")
