"""Joins in the simulator (``--joiners K``): which seats are lost, which are taken back, and the joiners.

With K joiners a job's restarts go in threes (cycle c = restart // 3):

* restart 3c, **lose**: besides the restart's one fault, K more ranks die;
  their monitors count each of them out (``count_out``, as for the fault),
  so that their seats are free in the membership the next restart starts from.
  Layout ``nodes`` (the default): whole nodes of 8 consecutive ranks, as when
  nodes fail and their replacements' processes join; ``spread``: single
  ranks 16384/K apart, the worst case for the decision's size while the
  seats are empty (every lost seat is a run of its own in the encoded
  membership, until its joiner is back in its place);
* restart 3c+1, **admit**: K simulated joiners, one per free seat, announce
  themselves as the restart begins (the real :class:`JoinKeys` calls of
  ``inprocess/engine/join.py``: a read of the seat, a read of ``running``,
  the record and the announcement, a second read of ``running``) and wait for
  their outcome (``JoinKeys.wait_outcome``, then the admitting barrier's
  decision); the barrier's leader runs the real ``joining.admit`` and applies
  ``Membership.with_joined`` (each joiner ranked where its seat stands)
  before the rank assignment, as ``CallWrapper._decide`` does. From the next iteration on each admitted
  process is the simulated rank of its seat again, in its seat's next life: in node mode linked to its
  seat's node board, as the library's joiner is to its node's running agent (``engine/runtime.py``), so
  its later restarts cost the store nothing of its own. (The library's joiner also waits for its
  admission on that board; the simulated ones wait at the store: in the admit restart, where they
  announce just before the fault, both make about the same calls);
* restart 3c+2, **plain**: one fault, no joiner: the baseline, in the same job
  at about the same world size.

The joiners of a client process share one thread and one connection (as the
simulated ranks share theirs, :mod:`.ranks`): they announce one after
another, then wait one after another (the first wait blocks until the
decision, the others find their outcome written). They announce before the
fault is injected, so that all K are pending when the leader decides (the
heaviest case for the leader: every one of them resolved in this restart).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from inprocess.control.joining import ADMITTED, ENDED, Announcement, JoinKeys
from inprocess.control.membership import ACTIVE, TERMINATED
from inprocess.control.protocol import RestartProtocol
from inprocess.control.records import HOST

from .wire import SharedStore, Tally

LOSE, ADMIT, PLAIN = "lose", "admit", "plain"
NODES, SPREAD = "nodes", "spread"  # where the lost ranks sit: whole nodes (blocks of 8 ranks), or one rank apart
LAYOUTS = (NODES, SPREAD)
PHASES = (LOSE, ADMIT, PLAIN)
# What a simulated joiner's configuration holds (engine/join.job_config's fields); the job's is the same.
JOB_CONFIG = {"function": "simulated.train", "initial_world_size": "?", "timeouts": "simulated",
              "rank_assignment": "'Compose'"}


class JoinPlan:
    """Which ranks die and which seats are taken back in each restart of a job with joiners."""

    def __init__(self, n: int, joiners: int, restarts: int, faulty: list[int], layout: str = NODES, block: int = 8):
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {', '.join(LAYOUTS)}")
        self.n, self.joiners, self.restarts = n, joiners, restarts
        self.faulty = faulty
        used = set(faulty)
        self.lost: list[list[int]] = []  # per cycle: the K ranks lost in its restart 3c
        for c in range((restarts + 2) // 3 if joiners else 0):
            ranks: list[int] = []
            if layout == SPREAD:
                for k in range(joiners):
                    r = (k * (n // joiners) + 1 + 2 * c) % n  # one rank here and there, over the whole job
                    while r in used:
                        r = (r + 1) % n
                    used.add(r)
                    ranks.append(r)
            else:
                blocks = -(-joiners // block)
                for b in range(blocks):
                    size = min(block, joiners - b * block)
                    start = ((b * (n // blocks)) // block + 1 + c) * block % n  # whole nodes, spread over the job
                    members = self._free_block(start, size, block, used)
                    used.update(members)
                    ranks.extend(members)
            self.lost.append(sorted(ranks))
        self._cycle_of = {r: c for c, ranks in enumerate(self.lost) for r in ranks}

    def _free_block(self, start: int, size: int, block: int, used: set[int]) -> list[int]:
        """``size`` consecutive free ranks from ``start`` on: at a node boundary if one is free, else anywhere."""
        n = self.n
        for step, tries in ((block, -(-n // block)), (1, n)):
            at = start
            for _ in range(tries):
                members = [(at + i) % n for i in range(size)]
                if not used.intersection(members):
                    return members
                at = (at + step) % n
        raise ValueError(f"N={n}: no {size} consecutive ranks left to lose (faults and earlier losses hold them)")

    def phase(self, j: int) -> str:
        return PLAIN if not self.joiners else PHASES[j % 3]

    def lost_in(self, j: int) -> list[int]:
        """The ranks that die in restart j besides its fault."""
        return self.lost[j // 3] if self.phase(j) == LOSE else []

    def admitted_in(self, j: int) -> list[int]:
        """The seats whose joiners are admitted in restart j."""
        return self.lost[j // 3] if self.phase(j) == ADMIT else []

    def away(self, rank: int, iteration: int) -> bool:
        """Whether ``rank``'s seat has no process in restart ``iteration`` (lost, its joiner not yet in)."""
        c = self._cycle_of.get(rank)
        return c is not None and 3 * c <= iteration <= 3 * c + 1

    def rows(self, j: int) -> list[tuple[int, int, int]]:
        """(mode, rank, active_rank) of every seat after restart j, as ActivateAllRanks + ShiftRanks give
        them: the dead leave, each admitted joiner comes in where its seat stands (before the first rank,
        in rank order, whose seat is above it: Membership.with_joined), relative order kept."""
        order = list(range(self.n))
        for i in range(j + 1):
            dead = {self.faulty[i], *self.lost_in(i)}
            joined = sorted(self.admitted_in(i))
            merged: list[int] = []
            for r in order:
                while joined and joined[0] < r:
                    merged.append(joined.pop(0))
                merged.append(r)
            order = [r for r in merged + joined if r not in dead]
        rows = [(TERMINATED, -1, -1)] * self.n
        for new, r in enumerate(order):
            rows[r] = (ACTIVE, new, new)
        return rows


class SimJoiners:
    """The joiners of one client process for one admit restart, on a thread and a connection of their own."""

    def __init__(self, conn: Any, call: int, seats: list[int], timeout_s: float):
        self.call, self.seats, self.timeout_s = call, seats, timeout_s
        self.tally = Tally()
        # Every joiner is a process of its own with a protocol of its own: counted apart.
        self.protocols = {s: RestartProtocol(SharedStore(conn, conn, self.tally, None), call) for s in seats}
        self.tokens = {s: f"{HOST}-sim{s}-{time.monotonic_ns() % 10**9}" for s in seats}
        self.results: dict[int, list[Any]] = {}  # seat -> [t_announced, t_admitted, t_decided, life, barrier, ops]
        self.decisions: dict[int, Any] = {}
        self.error: str | None = None
        self.thread: threading.Thread | None = None

    def announce(self) -> None:
        """What ``engine.join.wait_for_admission`` sends before it waits, for every joiner in turn."""
        for s in self.seats:
            p = self.protocols[s]
            join = JoinKeys(p.counted, p.call, p.incarnation)
            _check_running(join, p.incarnation)
            p.read_seat(s)
            join.announce(Announcement(self.tokens[s], s, HOST, s, JOB_CONFIG, None))
            _check_running(join, p.incarnation)
            self.results[s] = [time.monotonic_ns(), 0, 0, 0, 0, 0]

    def start_waiting(self) -> None:
        self.thread = threading.Thread(target=self._wait_all, name="joiners", daemon=True)
        self.thread.start()

    def _wait_all(self) -> None:
        try:
            for s in self.seats:
                p = self.protocols[s]
                join = JoinKeys(p.counted, p.call, p.incarnation)
                outcome = join.wait_outcome(self.tokens[s], self.timeout_s)
                if outcome is None or outcome.kind != ADMITTED or outcome.seat != s:
                    raise RuntimeError(f"joiner of seat {s}: outcome {outcome}, expected its admission")
                t_admitted = time.monotonic_ns()
                p.life = outcome.life
                decision = p.wait_decision(outcome.barrier, self.timeout_s)
                self.decisions[s] = decision
                self.results[s][1:] = [t_admitted, time.monotonic_ns(), outcome.life, outcome.barrier, p.ops]
        except BaseException as e:  # reported to the driver, which fails the run
            self.error = f"joiners: {type(e).__name__}: {e}"

    def join(self, timeout: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"joiners of seats {self.seats[:3]}...: no outcome within {timeout:g}s")
        if self.error:
            raise RuntimeError(self.error)


def _check_running(join: JoinKeys, incarnation: str) -> None:
    """A joiner's read of ``running`` (engine/join.py): the job it joins runs this incarnation."""
    running = join.running_incarnation()
    if running is None or running.startswith(ENDED) or running != incarnation:
        raise RuntimeError(f"joiners: the store says the job runs {running!r}, expected {incarnation!r}")
