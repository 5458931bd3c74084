"""The control plane's real code under a deterministic scheduler: ``python -m inprocess.chaos simulate``.

Each schedule runs N ranks through B barriers with :class:`inprocess.control.protocol.RestartProtocol`
(barrier, leadership and takeover by terms and lost marks, seats, the arrivals' count) and the rank
assignment of :mod:`inprocess.rank_assignment` (the default one, ShiftRanks), over the in-memory store
of :mod:`inprocess.chaos.simstore`, whose seeded scheduler orders every store call and crashes ranks
between two calls (or with a call's answer lost). A crashed rank's monitor then counts it out with
the monitor's own code (:func:`inprocess.control.counting_out.count_out`, as
:mod:`inprocess.processes.monitor` calls it when its rank died). Checked after each schedule:

* every barrier has one decision, read alike by every process that read it;
* every rank that did not crash reads every barrier's decision (no barrier times out, nothing
  deadlocks) and is not terminated by it; every crashed rank is terminated exactly once;
* every barrier's decision counts exactly its members: the ranks it keeps plus those it terminates
  are the previous decision's (no arrival counted twice, none lost).

What this does not reach, and why: the rank's threads (the restart trigger, its abort and the
main thread's interruption) and the monitor's and node agent's processes run on real time and real
blocking calls (native waits on pidfds and a shared-memory board); simulating them needs their waits
behind the same seam as the store's (an injectable clock and wait), which they do not have. Joins
and grow points run in the chaos runner instead (``python -m inprocess.chaos run``).

This module imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator

from ..compose import Compose
from ..control import store_ops
from ..control.counting_out import count_out
from ..control.membership import TERMINATED, Membership
from ..control.protocol import RestartProtocol
from ..control.records import Decision, FaultRecord
from ..rank_assignment import ActivateAllRanks, ShiftRanks
from ..rank_assignment.agreed import initial_membership
from ..rank_assignment.decision import decide
from .simstore import Crashed, Deadlock, Scheduler, SimClient

BARRIER_TIMEOUT_S = 60.0  # virtual seconds: a barrier that waits this long is a liveness violation


@dataclasses.dataclass
class Outcome:
    """One schedule: what each process read, and what went wrong."""

    seed: int
    decisions: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict)  # (process, barrier) -> JSON
    crashed: list[str] = dataclasses.field(default_factory=list)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    violations: list[str] = dataclasses.field(default_factory=list)
    steps: int = 0


@contextlib.contextmanager
def _virtual_clock(sched: Scheduler) -> Iterator[None]:
    """The control plane's deadlines on the scheduler's clock (store_ops reads ``time.monotonic``)."""

    class Clock:
        monotonic = staticmethod(sched.monotonic)
        sleep = staticmethod(time.sleep)

    real = getattr(store_ops, "time")  # noqa: B009 (the module's own name for the time module)
    setattr(store_ops, "time", Clock)  # noqa: B010
    try:
        yield
    finally:
        setattr(store_ops, "time", real)  # noqa: B010


class Job:
    """N ranks through B barriers, a monitor for each rank that crashes."""

    def __init__(self, sched: Scheduler, ranks: int, barriers: int, outcome: Outcome):
        self.sched = sched
        self.n = ranks
        self.barriers = barriers
        self.outcome = outcome
        self.assignment = Compose(ActivateAllRanks(), ShiftRanks())
        self.finished: set[int] = set()  # ranks that read every barrier's decision, or were terminated

    def protocol(self, actor: str) -> RestartProtocol:
        return RestartProtocol(SimClient(self.sched, actor), initial_world_size=self.n)

    def rank(self, r: int) -> None:
        p = self.protocol(f"r{r}")
        previous = initial_membership(self.n)
        expected = self.n
        for b in range(self.barriers):
            if b > 0:
                p.report_fault(FaultRecord(r, b - 1, "exception", "SimFault", "the restart of a schedule",
                                           "sim", 0))

            def decide_here(dead: set[int], faults: list[FaultRecord], leader: int, b: int = b,
                            previous: Membership = previous) -> Decision:
                d = decide(self.assignment, previous, dead, faults, b, leader)
                d.t_ns, d.assignment_ns, d.host = 0, 0, "sim"  # the real clock's: a seed replays them alike
                return d

            decision = p.barrier(b, r, expected, decide=decide_here, timeout=BARRIER_TIMEOUT_S)
            assert decision is not None
            self.outcome.decisions[(f"r{r}", b)] = decision.to_json()
            if decision.membership.mode[r] == TERMINATED:
                self.outcome.violations.append(f"barrier {b} terminated rank {r}, which did not crash")
                return
            previous, expected = decision.membership, decision.membership.world_size
        self.finished.add(r)

    def monitor(self, r: int) -> None:
        """Rank ``r`` died: its monitor counts it out, as inprocess.processes.monitor does."""
        p = self.protocol(f"m{r}")

        def expected_at(barrier: int) -> int | None:
            if barrier == 0:
                return self.n
            if barrier >= self.barriers:
                return None  # the schedule has no such barrier: nobody waits there
            decision = p.wait_decision(barrier - 1, BARRIER_TIMEOUT_S)
            self.outcome.decisions[(f"m{r}", barrier - 1)] = decision.to_json()
            if decision.abort is not None or decision.membership.mode[r] == TERMINATED:
                return None
            return decision.membership.world_size

        def fault(iteration: int) -> FaultRecord:
            return FaultRecord(r, iteration, "killed", "SIGKILL", "the rank died (simulated)", "sim", 0)

        count_out(p, r, fault, expected_at, timeout=BARRIER_TIMEOUT_S, who=f"m{r}", life=0)


def run_schedule(seed: int, ranks: int = 4, barriers: int = 3, crash_p: float = 0.05,
                 max_crashes: int | None = None, trace: list[str] | None = None) -> Outcome:
    """One seeded schedule; its outcome lists what it found wrong (``trace``: a list to fill with its calls)."""
    outcome = Outcome(seed)
    sched = Scheduler(seed, crash_p, ranks - 1 if max_crashes is None else max_crashes)
    sched.trace = trace
    job = Job(sched, ranks, barriers, outcome)
    def crashed(actor: str) -> None:  # its monitor counts it out
        sched.spawn(f"m{actor[1:]}", lambda: job.monitor(int(actor[1:])))

    def rank(r: int) -> Callable[[], None]:
        return lambda: job.rank(r)

    sched.may_crash = lambda actor: actor.startswith("r")  # monitors are not crashed here
    sched.on_crash = crashed
    with _virtual_clock(sched):
        for r in range(ranks):
            sched.spawn(f"r{r}", rank(r))
        try:
            sched.run()
        except Deadlock as e:
            outcome.violations.append(f"deadlock: {e}")
        except RuntimeError as e:
            outcome.violations.append(str(e))
    outcome.crashed = list(sched.crashed)
    outcome.steps = sched.steps
    outcome.errors = {name: f"{type(e).__name__}: {e}"[:300] for name, e in sched.errors.items()
                      if not isinstance(e, Crashed)}
    _check(job, outcome)
    return outcome


def _check(job: Job, outcome: Outcome) -> None:
    for name, error in sorted(outcome.errors.items()):
        outcome.violations.append(f"{name} ended with {error}")
    by_barrier: dict[int, set[str]] = {}
    for (_, b), raw in outcome.decisions.items():
        by_barrier.setdefault(b, set()).add(raw)
    crashed = {int(a[1:]) for a in outcome.crashed}
    for r in range(job.n):
        if r not in crashed and r not in job.finished:
            outcome.violations.append(f"rank {r} did not crash and did not read every barrier's decision")
    terminated_at: dict[int, list[int]] = {}
    previous = set(range(job.n))
    for b in sorted(by_barrier):
        if len(by_barrier[b]) > 1:
            outcome.violations.append(f"barrier {b}: {len(by_barrier[b])} different decisions were read")
            continue
        d = Decision.from_json(next(iter(by_barrier[b])).encode())
        kept = {r for r in range(job.n) if d.membership.mode[r] != TERMINATED}
        for r in d.terminated:
            terminated_at.setdefault(r, []).append(b)
        if kept | set(d.terminated) != previous or kept & set(d.terminated):
            outcome.violations.append(f"barrier {b}: keeps {sorted(kept)} and terminates {d.terminated}, "
                                      f"its members were {sorted(previous)}")
        previous = kept
    for r, barriers in sorted(terminated_at.items()):
        if len(barriers) > 1 or r not in crashed:
            outcome.violations.append(f"rank {r} terminated at barriers {barriers} (crashed: {r in crashed})")


def explore(first_seed: int, schedules: int, ranks: int = 4) -> tuple[list[Outcome], float]:
    """Schedules ``first_seed`` .. ``first_seed + schedules - 1``: each one's outcome, and the seconds taken."""
    started = time.monotonic()
    outcomes = [run_schedule(seed, ranks) for seed in range(first_seed, first_seed + schedules)]
    return outcomes, time.monotonic() - started


def main(args: argparse.Namespace) -> int:
    # The protocol's own warnings (a leader lost, a count completed by a monitor) come by the thousand here.
    logging.getLogger("inprocess").setLevel(logging.ERROR)
    outcomes, seconds = explore(args.seed, args.schedules, args.ranks)
    bad = [o for o in outcomes if o.violations]
    crashes = sum(len(o.crashed) for o in outcomes)
    steps = sum(o.steps for o in outcomes)
    print(f"simulated {len(outcomes)} schedules (seeds {args.seed}..{args.seed + len(outcomes) - 1}), {args.ranks} "
          f"ranks, 3 barriers each: {steps} store calls, {crashes} crashes between store calls, "
          f"{seconds:.1f} s ({len(outcomes) / max(seconds, 1e-9) * 60:.0f} schedules a minute); "
          f"{len(bad)} with violations")
    for o in bad[:10]:
        print(f"  seed {o.seed} (crashed {o.crashed}): " + "; ".join(o.violations[:3]))
    if args.json:
        print(json.dumps({"schedules": len(outcomes), "first_seed": args.seed, "ranks": args.ranks,
                          "store_calls": steps, "crashes": crashes, "seconds": round(seconds, 1),
                          "violating_seeds": [o.seed for o in bad]}))
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover - python -m inprocess.chaos simulate is the entry
    sys.exit(main(argparse.Namespace(seed=0, schedules=100, ranks=4, json=False)))
