"""The recovery plan: what one decision of a barrier means for one rank.

The leader's decision (:class:`inprocess.control.records.Decision`) travels as
O(changes): the new membership's runs, the ranks terminated, the joiners
admitted, the faults. Each rank derives its own :class:`RecoveryPlan` from it
with one pure function, :meth:`RecoveryPlan.for_rank` (the membership the rank
had before, the decision, its initial rank): which way its role goes
(:class:`Transition`), which rank it had and gets, what it releases of the
failed iteration once the decision is known (:class:`Resource`, by the
:data:`RELEASE_SCHEDULE`), and where its state comes from
(:class:`StateSource`). The executor (``engine/recovery.py``) carries the plan
out instead of reading those facts out of the membership itself.
:class:`DecisionSummary` is the same decision for the whole job (who leaves,
who stays, who joins), as plain data for the logs and the events.

Two rules every reader of a decision shares are defined here once:
:func:`leaves` (a decision takes a rank out of the job) and :func:`seated`
(the decision's joiners take their seats in the membership before it, which
the leader's rank assignment and every rank's check of it start from). The
monitor, the counting out of a rank and the executor call them.

At the job's start (the initial barrier) there is no previous membership: no
rank has run the function, so none has state in memory, and each one starts
as what the first decision makes it: active (:attr:`Transition.ACTIVATE`, its
state from the user's code) or a spare (:attr:`Transition.STAY_SPARE`).

:attr:`Transition.JOIN` is for a process admitted by this decision into a seat
(an initial rank) that had left the job (``Decision.joined``,
:mod:`inprocess.control.joining`): the joiner itself, which had no membership
before, and every other rank, whose previous membership had the seat
terminated, derive it from the decision alone.

This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any

from ..exception import InternalError
from ..state import Mode
from .membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from .records import Decision


class Transition(enum.Enum):
    """Which way a rank's role goes at a decision."""

    STAY_ACTIVE = "stay_active"  # active before and after: keeps its state in memory
    ACTIVATE = "activate"  # a spare becomes active (at the job's start: every active rank)
    STAY_SPARE = "stay_spare"  # a spare stays one (at the job's start: starts as one)
    DEACTIVATE = "deactivate"  # an active rank becomes a spare
    LEAVE = "leave"  # out of the job: terminated by the decision, or the job ends
    JOIN = "join"  # a process admitted into a seat that had left the job


class Resource(enum.Enum):
    """What a failed iteration leaves behind on a rank, which a restart releases."""

    PROCESS_GROUPS = "process_groups"  # the torch.distributed groups the iteration created (engine/pg_tracker.py)
    ITERATION_STORE = "iteration_store"  # the function's store client of the iteration (CallWrapper.store)
    # NCCL's teardown of the iteration's communicators: started by the abort on a reaper's threads,
    # released when it is over (gpu/nccl_reaper.py); no NCCL of the next iteration runs before.
    NCCL_TEARDOWN = "nccl_teardown"


class Moment(enum.Enum):
    """When a restart releases a resource of the failed iteration."""

    BEFORE_DECISION = "before_decision"  # back in the main thread after the abort, before the barrier
    AFTER_DECISION = "after_decision"  # once the rank's plan is known, before the function runs again


class StateSource(enum.Enum):
    """Where an active rank's training state comes from in the iteration the decision starts."""

    MEMORY = "memory"  # the rank was active: what its function left in memory (the arguments it mutated)
    USER = "user"  # the rank was not: the user's code loads it (from a checkpoint, from storage)


# When every restart releases what. Before its barrier (no rank knows the decision yet): the groups
# and the store client. NCCL's teardown runs from the abort on, beside finalize, the health check and
# the barrier (its proxy threads take up to a second to exit): it is awaited once the decision is
# known, before the function runs again. A resource at AFTER_DECISION is released by the plan
# (RecoveryPlan.release), on every rank whatever its transition.
RELEASE_SCHEDULE: Mapping[Resource, Moment] = {
    Resource.PROCESS_GROUPS: Moment.BEFORE_DECISION,
    Resource.ITERATION_STORE: Moment.BEFORE_DECISION,
    Resource.NCCL_TEARDOWN: Moment.AFTER_DECISION,
}


def released_at(moment: Moment, schedule: Mapping[Resource, Moment] = RELEASE_SCHEDULE) -> frozenset[Resource]:
    """The resources ``schedule`` releases at ``moment``."""
    return frozenset(r for r in Resource if schedule[r] is moment)


def leaves(decision: Decision, initial_rank: int) -> bool:
    """The leave rule: ``decision`` takes ``initial_rank`` out of the job (the job ends, or the
    rank is terminated). Every reader of a decision asks it here."""
    return decision.abort is not None or decision.membership.mode[initial_rank] == TERMINATED


def seated(previous: Membership | None, joined: Iterable[tuple[int, int]]) -> Membership | None:
    """The membership a decision changes: ``previous`` with the decision's joiners (``(seat, life)``
    pairs) seated as spares (:meth:`Membership.with_joined`); ``previous`` itself when none joined,
    and None before the first decision (nobody joins at barrier 0). The leader's rank assignment
    starts from it, and every rank's check of its own row."""
    joined = list(joined)
    return previous.with_joined(joined) if joined and previous is not None else previous


def _mode(column: int, initial_rank: int) -> Mode:
    try:
        return Mode(column)  # INITIALIZED too: a decision that ends the job at its start keeps that table
    except ValueError:
        raise InternalError(f"initial rank {initial_rank} has mode {column} in the membership") from None


def _rank(value: int) -> int | None:
    return None if value == NONE else value


def transition(old: Mode, new: Mode, joined: bool = False) -> Transition:
    """The transition of a rank whose mode goes from ``old`` (``Mode.INITIALIZED`` at the
    job's start) to ``new``; ``joined``: this decision admitted a process into its seat."""
    if new == Mode.TERMINATED:
        return Transition.LEAVE
    if joined:
        return Transition.JOIN
    if old == Mode.TERMINATED:
        raise InternalError(f"a rank that had left the job is {new.name} without a join")
    if new == Mode.ACTIVE:
        return Transition.STAY_ACTIVE if old == Mode.ACTIVE else Transition.ACTIVATE
    if new == Mode.INACTIVE:
        return Transition.DEACTIVATE if old == Mode.ACTIVE else Transition.STAY_SPARE
    raise InternalError(f"no transition to mode {new.name}")


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What one decision means for one rank (initial rank ``initial_rank``).

    ``old_*`` describe the rank before the decision (``None`` at the job's
    start and for a joiner), ``new_*`` after it (``None`` where a rank has no
    such rank: a spare has no active rank, a leaving rank none at all). The
    world sizes before are the previous plan's (and :class:`DecisionSummary`
    has the changes): counting them again would cost O(world size) per rank.
    ``release``: what the rank releases of the failed iteration once the
    decision is known (:data:`RELEASE_SCHEDULE`). ``ends_job`` is the reason
    the whole job ends at this decision (every rank leaves).
    """

    iteration: int  # the iteration the decision starts
    initial_rank: int
    transition: Transition
    new_mode: Mode
    old_rank: int | None
    new_rank: int | None
    old_active_rank: int | None
    new_active_rank: int | None
    new_world_size: int
    new_active_world_size: int
    release: frozenset[Resource]
    state_source: StateSource | None  # None: the rank runs no function in the next iteration
    ends_job: str | None = None

    @classmethod
    def for_rank(cls, previous: Membership | None, decision: Decision, initial_rank: int,
                 schedule: Mapping[Resource, Moment] = RELEASE_SCHEDULE) -> RecoveryPlan:
        """The plan of ``initial_rank`` from the membership it had (``None`` at the job's start and
        for a joiner the decision admits) and the decision; ``schedule``: when the restart releases
        each resource of the failed iteration."""
        m = decision.membership
        r = initial_rank
        if not 0 <= r < m.initial_world_size:
            raise InternalError(f"initial rank {r} is not in a membership of {m.initial_world_size} ranks")
        if previous is not None and previous.initial_world_size != m.initial_world_size:
            raise InternalError(f"initial world size changed from {previous.initial_world_size} "
                                f"to {m.initial_world_size}")
        new_mode = _mode(m.mode[r], r)
        joined = any(seat == r for seat, _ in decision.joined)
        if previous is None or joined:
            old_mode, old_rank, old_active = Mode.TERMINATED if joined else Mode.INITIALIZED, None, None
        else:
            old_mode = _mode(previous.mode[r], r)
            old_rank, old_active = _rank(previous.rank[r]), _rank(previous.active_rank[r])
        kind = Transition.LEAVE if leaves(decision, r) else transition(old_mode, new_mode, joined)
        source = None
        if kind is not Transition.LEAVE and new_mode == Mode.ACTIVE:
            source = StateSource.MEMORY if kind is Transition.STAY_ACTIVE else StateSource.USER
        return cls(
            iteration=decision.iteration, initial_rank=r, transition=kind, new_mode=new_mode,
            old_rank=old_rank, new_rank=_rank(m.rank[r]),
            old_active_rank=old_active, new_active_rank=_rank(m.active_rank[r]),
            new_world_size=m.world_size, new_active_world_size=m.active_world_size,
            # Nothing ran before a first decision, nor in a joiner's process; after a failed iteration, what
            # the schedule releases once the decision is known.
            release=frozenset() if previous is None or joined else released_at(Moment.AFTER_DECISION, schedule),
            state_source=source, ends_job=decision.abort,
        )

    def fields(self) -> dict[str, Any]:
        """This rank's part of a decision as JSON-ready fields (its ``decision`` event's ``plan``)."""
        return {"transition": self.transition.value, "rank": [self.old_rank, self.new_rank],
                "active_rank": [self.old_active_rank, self.new_active_rank],
                "state": None if self.state_source is None else self.state_source.value,
                "release": sorted(x.value for x in self.release)}

    @property
    def leaves(self) -> bool:
        return self.transition is Transition.LEAVE

    @property
    def active(self) -> bool:
        """The rank runs the function in the iteration the decision starts."""
        return not self.leaves and self.new_mode == Mode.ACTIVE

    def environment(self) -> dict[str, str | None]:
        """``RANK`` and ``WORLD_SIZE`` as the function sees them: its active rank and the active world
        size; a spare has no rank in the running job, so both are removed (``None``)."""
        if self.active:
            return {"RANK": str(self.new_active_rank), "WORLD_SIZE": str(self.new_active_world_size)}
        return {"RANK": None, "WORLD_SIZE": None}


MAX_LISTED = 32  # initial ranks listed per change in a summary's fields (counts are always whole)


@dataclasses.dataclass(frozen=True)
class DecisionSummary:
    """One decision for the whole job: who leaves, who stays, who joins (initial ranks, ascending)."""

    iteration: int
    left: list[int]  # in the job before, out of it now (terminated, or every rank when the job ends)
    activated: list[int]  # spares made active
    deactivated: list[int]  # active ranks made spares
    joined: list[int]  # seats filled by joiners
    stayed_active: int
    stayed_spare: int  # at the job's start: the ranks that start as spares
    started_active: int  # at the job's start: the ranks that start active (0 after it)
    world_size: int
    active_world_size: int
    ends_job: str | None = None

    @classmethod
    def of(cls, previous: Membership | None, decision: Decision) -> DecisionSummary:
        """The transition of each initial rank, as its own plan gives it, counted and listed. Every rank
        computes it at every decision: one C-speed comparison of the mode columns, then Python work
        only for the ranks whose mode changed (16,384 ranks: about 1 ms).

        ``previous`` None: the job's start, or a joiner's first decision. A joiner knew no membership
        before: it lists the seats the decision fills and the ranks it names terminated, and counts
        the spares the decision activated among those that stayed."""
        m = decision.membership
        new = m.mode
        seats = sorted(seat for seat, _ in decision.joined)
        if decision.abort is not None:  # the job ends: everyone still in it leaves
            old = previous.mode if previous is not None else None
            left = [r for r, x in enumerate(new) if x != TERMINATED or (old is not None and old[r] != TERMINATED)]
            return cls(decision.iteration, left, [], [], [], 0, 0, 0, m.world_size, m.active_world_size,
                       ends_job=decision.abort)
        if previous is None and seats:  # a joiner's view of the decision that admits it
            joined_active = sum(1 for r in seats if new[r] == ACTIVE)
            return cls(decision.iteration, sorted(decision.terminated), [], [], seats,
                       stayed_active=new.count(ACTIVE) - joined_active,
                       stayed_spare=new.count(INACTIVE) - (len(seats) - joined_active), started_active=0,
                       world_size=m.world_size, active_world_size=m.active_world_size)
        if previous is None:  # the job's start: nobody was anything yet
            return cls(decision.iteration, [r for r, x in enumerate(new) if x == TERMINATED], [], [], [],
                       stayed_active=0, stayed_spare=new.count(INACTIVE), started_active=new.count(ACTIVE),
                       world_size=m.world_size, active_world_size=m.active_world_size)
        old = previous.mode
        changed = [] if old == new else [r for r, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
        lists: dict[Transition, list[int]] = {t: [] for t in Transition}
        joined_set = set(seats)
        for r in changed:
            lists[transition(_mode(old[r], r), _mode(new[r], r), r in joined_set)].append(r)
        joined_list = lists[Transition.JOIN]  # a refilled seat had left: its mode changed
        joined_active = sum(1 for r in joined_list if new[r] == ACTIVE)
        return cls(
            iteration=decision.iteration, left=lists[Transition.LEAVE], activated=lists[Transition.ACTIVATE],
            deactivated=lists[Transition.DEACTIVATE], joined=joined_list,
            stayed_active=new.count(ACTIVE) - len(lists[Transition.ACTIVATE]) - joined_active,
            stayed_spare=new.count(INACTIVE) - len(lists[Transition.DEACTIVATE]) - (len(joined_list) - joined_active),
            started_active=0, world_size=m.world_size, active_world_size=m.active_world_size,
        )

    def fields(self) -> dict[str, Any]:
        """As JSON-ready fields (an event's): each list cut to MAX_LISTED ranks, with its full count."""
        out: dict[str, Any] = {}
        for name in ("left", "activated", "deactivated", "joined"):
            ranks: list[int] = getattr(self, name)
            out[name] = ranks[:MAX_LISTED]
            out[f"n_{name}"] = len(ranks)
        out.update(stayed_active=self.stayed_active, stayed_spare=self.stayed_spare,
                   started_active=self.started_active, ends_job=self.ends_job)
        return out
