"""The membership table: every initial rank's mode and ranks in one iteration.

One leader computes it per restart and publishes it once (design principle 3).
It travels as runs: consecutive initial ranks whose mode is equal and whose
ranks both advance by one share a run, so a table with k changes since the
start encodes in O(k), not O(world size) (the scale issue's bound).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..exception import InternalError
from ..state import Mode

ACTIVE = int(Mode.ACTIVE)
INACTIVE = int(Mode.INACTIVE)
TERMINATED = int(Mode.TERMINATED)
NONE = -1  # "no rank" in the rank columns


class Membership:
    """Columns indexed by initial rank: ``mode``, ``rank`` and ``active_rank``.

    ``rank`` numbers every rank still in the job (active and spare) 0..W-1;
    ``active_rank`` numbers the active ones 0..A-1; both are ``NONE`` where
    they do not apply. Plain lists keep the algorithms O(N) and fast at 16k.
    """

    __slots__ = ("mode", "rank", "active_rank")

    def __init__(self, mode: list[int], rank: list[int], active_rank: list[int]):
        if not (len(mode) == len(rank) == len(active_rank)):
            raise InternalError(f"membership columns differ in length: {len(mode)}, {len(rank)}, {len(active_rank)}")
        self.mode = mode
        self.rank = rank
        self.active_rank = active_rank

    @classmethod
    def all_active(cls, world_size: int) -> Membership:
        ranks = list(range(world_size))
        return cls([ACTIVE] * world_size, ranks, list(ranks))

    def copy(self) -> Membership:
        return Membership(list(self.mode), list(self.rank), list(self.active_rank))

    @property
    def initial_world_size(self) -> int:
        return len(self.mode)

    @property
    def world_size(self) -> int:
        return len(self.mode) - self.mode.count(TERMINATED)

    @property
    def active_world_size(self) -> int:
        return self.mode.count(ACTIVE)

    def alive(self) -> list[int]:
        """Initial ranks still in the job, ordered by their current rank."""
        alive = [r for r, m in enumerate(self.mode) if m != TERMINATED]
        alive.sort(key=self.rank.__getitem__)
        return alive

    def active(self) -> list[int]:
        """Initial ranks that are active, ordered by their active rank."""
        act = [r for r, m in enumerate(self.mode) if m == ACTIVE]
        act.sort(key=self.active_rank.__getitem__)
        return act

    def terminate(self, initial_ranks: Iterable[int]) -> None:
        for r in initial_ranks:
            self.mode[r] = TERMINATED
            self.rank[r] = NONE
            self.active_rank[r] = NONE

    def with_joined(self, joined: Iterable[tuple[int, int]]) -> Membership:
        """A copy in which the seats of ``joined`` ((seat, life) pairs of a decision,
        :mod:`inprocess.control.joining`) hold spares, each ranked where its seat stands:
        just before the first rank of the job (in rank order) whose initial rank is above
        the seat, the ranks from there on one further.

        The joiner takes the place of the process it replaces, so that a job in
        initial-rank order (``ShiftRanks`` keeps it) that lost ranks and took them
        back is numbered as before the loss, and its table encodes as compactly.
        The rank assignment then places the spares as it places any: activating
        ranks below the active world size, a joiner may be activated where a rank
        numbered after it becomes a spare.
        """
        m = self.copy()
        seats = sorted(seat for seat, _ in joined)
        for seat in seats:
            if m.mode[seat] != TERMINATED:
                raise InternalError(f"initial rank {seat} was admitted as a joiner but is {Mode(m.mode[seat]).name}")
        if not seats:
            return m
        by_rank = [NONE] * len(m.mode)  # the ranks in the job by rank, without a sort
        for r, rk in enumerate(m.rank):
            if rk != NONE:
                by_rank[rk] = r
        new = 0
        next_seat = 0
        rank = m.rank
        for r in by_rank:
            if r == NONE:
                continue
            while next_seat < len(seats) and seats[next_seat] < r:
                rank[seats[next_seat]] = new
                next_seat += 1
                new += 1
            rank[r] = new
            new += 1
        for seat in seats[next_seat:]:
            rank[seat] = new
            new += 1
        for seat in seats:
            m.mode[seat], m.active_rank[seat] = INACTIVE, NONE
        return m

    def deactivate(self, initial_rank: int) -> None:
        if self.mode[initial_rank] == ACTIVE:
            self.mode[initial_rank] = INACTIVE
            self.active_rank[initial_rank] = NONE

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Membership)
            and self.mode == other.mode
            and self.rank == other.rank
            and self.active_rank == other.active_rank
        )

    def __repr__(self) -> str:
        return (
            f"Membership(initial_world_size={self.initial_world_size}, world_size={self.world_size}, "
            f"active_world_size={self.active_world_size}, runs={self.encode()})"
        )

    # -- invariants ---------------------------------------------------------

    def validate(self, previous: Membership | None = None, newly_terminated: Iterable[int] = ()) -> None:
        """Raise InternalError unless the table is a consistent assignment."""
        n = len(self.mode)
        seen_rank = [False] * n
        seen_active = [False] * n
        world = active = 0
        for r in range(n):
            m, rk, ar = self.mode[r], self.rank[r], self.active_rank[r]
            if m == TERMINATED:
                if rk != NONE or ar != NONE:
                    raise InternalError(f"terminated initial rank {r} still holds rank={rk} active_rank={ar}")
                continue
            if m not in (ACTIVE, INACTIVE):
                raise InternalError(f"initial rank {r} has mode {m}, expected ACTIVE, INACTIVE or TERMINATED")
            world += 1
            if not 0 <= rk < n or seen_rank[rk]:
                raise InternalError(f"initial rank {r} has rank {rk}: out of range or taken twice")
            seen_rank[rk] = True
            if m == ACTIVE:
                active += 1
                if not 0 <= ar < n or seen_active[ar]:
                    raise InternalError(f"initial rank {r} has active_rank {ar}: out of range or taken twice")
                seen_active[ar] = True
            elif ar != NONE:
                raise InternalError(f"inactive initial rank {r} holds active_rank {ar}")
        if not all(seen_rank[:world]):
            raise InternalError(f"ranks are not 0..{world - 1}")
        if not all(seen_active[:active]):
            raise InternalError(f"active ranks are not 0..{active - 1}")
        self._validate_transition(previous, newly_terminated)

    def _validate_transition(self, previous: Membership | None, newly_terminated: Iterable[int]) -> None:
        """Raise InternalError unless this table can follow ``previous`` with ``newly_terminated`` gone."""
        n = len(self.mode)
        if previous is not None:
            if previous.initial_world_size != n:
                raise InternalError(f"initial world size changed from {previous.initial_world_size} to {n}")
            for r in range(n):
                if previous.mode[r] == TERMINATED and self.mode[r] != TERMINATED:
                    raise InternalError(f"initial rank {r} was terminated and came back")
        for r in newly_terminated:
            if self.mode[r] != TERMINATED:
                raise InternalError(f"initial rank {r} was reported terminated but is {Mode(self.mode[r]).name}")

    # -- compact encoding ---------------------------------------------------

    def encode(self) -> list[list[int]]:
        """Runs ``[first_initial_rank, length, mode, rank, active_rank]``."""
        runs: list[list[int]] = []
        mode, rank, act = self.mode, self.rank, self.active_rank
        n = len(mode)
        start = 0
        while start < n:
            m, rk, ar = mode[start], rank[start], act[start]
            step_r = 0 if rk == NONE else 1
            step_a = 0 if ar == NONE else 1
            end = start + 1
            while (
                end < n
                and mode[end] == m
                and rank[end] == (rk + step_r * (end - start) if step_r else NONE)
                and act[end] == (ar + step_a * (end - start) if step_a else NONE)
            ):
                end += 1
            runs.append([start, end - start, m, rk, ar])
            start = end
        return runs

    @classmethod
    def decode(cls, runs: object, initial_world_size: int) -> Membership:
        """Strict: runs as :meth:`encode` writes them (InternalError naming the first wrong one)."""
        mode: list[int] = []
        rank: list[int] = []
        act: list[int] = []
        if not isinstance(runs, list):
            raise InternalError(f"membership runs {runs!r:.80}: expected a list")
        modes = {int(m) for m in Mode}
        for run in runs:
            if (not isinstance(run, list) or len(run) != 5
                    or not all(type(v) is int for v in run)):  # not bool, float or str
                raise InternalError(f"membership run {run!r:.80}: expected 5 integers")
            start, length, m, rk, ar = run
            if start != len(mode) or length <= 0 or start + length > initial_world_size:
                raise InternalError(f"membership run {run} does not continue at {len(mode)} "
                                    f"within {initial_world_size} ranks")
            if m not in modes or (rk != NONE and not 0 <= rk <= initial_world_size - length) or (
                    ar != NONE and not 0 <= ar <= initial_world_size - length):
                raise InternalError(f"membership run {run}: mode or rank out of range")
            mode.extend([m] * length)
            rank.extend(range(rk, rk + length) if rk != NONE else [NONE] * length)
            act.extend(range(ar, ar + length) if ar != NONE else [NONE] * length)
        if len(mode) != initial_world_size:
            raise InternalError(f"membership runs cover {len(mode)} ranks, expected {initial_world_size}")
        return cls(mode, rank, act)
