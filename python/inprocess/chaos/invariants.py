"""What must never happen in a job, checked from the library's own events (``Wrapper(events_dir=...)``).

Each invariant is a function of the job's processes (one per wrapped call of each process, as its
rank's ``rank<N>.jsonl`` records it: :mod:`inprocess.timeline.reading`) that returns what it
checked and what it found wrong:

``one_decision``           every barrier has one decision: every process that read barrier i's
                           decision read the same one (its digest: the decision's JSON hashed)
``went_on_by_decision``    a process starts iteration i only after it read barrier i's decision,
                           with the world sizes that decision gives
``one_rank_each``          the active ranks of an iteration are distinct, below its active world size
``one_process_per_life``   no seat is held by two processes in one life, nor by the processes of
                           two lives at once (a joiner enters after its seat's previous process left)
``joiner_admitted_once``   no (seat, life) is admitted at two barriers, no process admitted twice
``counted_at_next``        every member of iteration i (a joiner admitted at barrier i among them)
                           is counted at barrier i + 1 when the job gets there: it reads that
                           decision, or that decision terminates it
``bounded_resume``         after a restart, every rank the decision keeps starts the next iteration
                           within the bound its configuration implies, or leaves with a documented
                           reason, or is terminated by a later decision
``same_final_iteration``   the ranks that finish the job (or leave it at a decision that ends it,
                           or with a RestartAbort, as RetryController's) do so in one iteration
``nothing_left``           (from observations outside the events, :class:`Observations`) no process
                           of the job outlives it, no shared memory and no store key of a finished
                           iteration is left, no process's descriptors grow from restart to restart

``python -m inprocess.chaos check DIR`` runs them on a directory of events. This module imports no
torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from ..timeline.reading import Event, Segment

# A process reads a decision and starts the iteration: more than this beside the bound is a
# scheduling delay of a loaded machine, not a protocol's wait (seconds).
RESUME_SLACK_S = 10.0
# The documented reasons a rank leaves with (engine/leave.py: Leave), and the kinds of its exit.
DOCUMENTED_REASONS = frozenset({
    "terminated", "completion_timeout", "store", "abort", "finalize", "health_check", "counted_out",
    "discarded", "abort_job", "barrier_timeout", "never joined",
})


@dataclasses.dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}" + (f" ({self.where})" if self.where else "")


@dataclasses.dataclass
class Finding:
    """One invariant's result: how many things it checked, and what it found wrong."""

    invariant: str
    checked: int = 0
    violations: list[Violation] = dataclasses.field(default_factory=list)

    def fail(self, message: str, where: str = "") -> None:
        self.violations.append(Violation(self.invariant, message, where))


@dataclasses.dataclass
class Process:
    """One wrapped call of one process: its seat (initial rank), the life it holds it in, its events."""

    segment: Segment
    life: int = 0
    decisions: dict[int, Event] = dataclasses.field(default_factory=dict)  # by barrier
    starts: dict[int, Event] = dataclasses.field(default_factory=dict)  # iteration_start, by iteration
    exit: Event | None = None
    call_start: Event | None = None
    horizon_s: float | None = None  # the events were read at this wall time, while the job ran (None: after)

    def settled(self, event: Event, within_s: float) -> bool:
        """Whether what ``event`` asks for had ``within_s`` to happen before the events were read."""
        return self.horizon_s is None or event.wall < self.horizon_s - within_s

    @property
    def seat(self) -> int:
        return self.segment.rank

    @property
    def call(self) -> int:
        return self.segment.call

    @property
    def name(self) -> str:
        return f"rank {self.seat} (pid {self.segment.pid}, life {self.life})"

    def time_s(self, event: Event) -> float:
        """A comparable time of ``event``: its host's monotonic clock where known, else its wall clock."""
        return event.t_ns / 1e9 if self.segment.host is not None else event.wall

    @classmethod
    def of(cls, segment: Segment) -> Process:
        p = cls(segment)
        for e in segment.events:
            if e.kind == "decision" and e.iteration is not None:
                p.decisions.setdefault(e.iteration, e)
                life = e.fields.get("life")
                if isinstance(life, int):
                    p.life = life
            elif e.kind == "iteration_start" and e.iteration is not None:
                p.starts.setdefault(e.iteration, e)
            elif e.kind == "exit":
                p.exit = e
            elif e.kind == "call_start":
                p.call_start = e
        return p


@dataclasses.dataclass
class Observations:
    """What the events cannot tell, observed by whoever ran the job (the chaos runner)."""

    leftover_processes: list[str] = dataclasses.field(default_factory=list)
    leftover_shm: list[str] = dataclasses.field(default_factory=list)
    # Per process (a label), its descriptors in each iteration once its process group is made, in order.
    fds: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # Snapshots of the store's keys: (the iteration the snapshot was taken at the start of, keys).
    store_keys: list[tuple[int, list[str]]] = dataclasses.field(default_factory=list)
    # Descriptors the late iterations may hold beyond the early ones' (a socket whose last reference
    # sits in a reference cycle closes at the next garbage collection; a group of another world size).
    fds_slack: int = 4


def _digest(e: Event) -> Any:
    """What identifies a decision: its digest, or (older events) the fields every rank logs alike."""
    f = e.fields
    if isinstance(f.get("digest"), str):
        return f["digest"]
    return tuple(str(f.get(k)) for k in ("world_size", "active_world_size", "terminated", "leader", "ends_job",
                                         "joined"))


def check_one_decision(processes: list[Process]) -> Finding:
    finding = Finding("one_decision")
    seen: dict[tuple[int, int], dict[Any, Event]] = {}
    for p in processes:
        for barrier, e in p.decisions.items():
            seen.setdefault((p.call, barrier), {}).setdefault(_digest(e), e)
    for (call, barrier), digests in sorted(seen.items()):
        finding.checked += 1
        if len(digests) > 1:
            where = ", ".join(e.where for e in digests.values())
            finding.fail(f"call {call}, barrier {barrier}: {len(digests)} different decisions were read", where)
    return finding


def check_went_on_by_decision(processes: list[Process]) -> Finding:
    finding = Finding("went_on_by_decision")
    for p in processes:
        for iteration, start in p.starts.items():
            finding.checked += 1
            decision = p.decisions.get(iteration)
            if decision is None or decision.t_ns > start.t_ns:
                finding.fail(f"{p.name} started iteration {iteration} without reading its decision", start.where)
                continue
            for key in ("world_size", "active_world_size"):
                if start.fields.get(key) != decision.fields.get(key):
                    finding.fail(f"{p.name} started iteration {iteration} with {key}={start.fields.get(key)}, "
                                 f"its decision says {decision.fields.get(key)}", start.where)
    return finding


def check_one_rank_each(processes: list[Process]) -> Finding:
    finding = Finding("one_rank_each")
    active: dict[tuple[int, int], dict[int, Process]] = {}
    for p in processes:
        for iteration, start in p.starts.items():
            if start.fields.get("mode") != "ACTIVE":
                continue
            finding.checked += 1
            rank, size = start.fields.get("active_rank"), start.fields.get("active_world_size")
            if not isinstance(rank, int) or not isinstance(size, int) or not 0 <= rank < size:
                finding.fail(f"{p.name}: active rank {rank} in iteration {iteration} of {size} active", start.where)
                continue
            other = active.setdefault((p.call, iteration), {}).setdefault(rank, p)
            if other is not p:
                finding.fail(f"{p.name} and {other.name} are both active rank {rank} in iteration {iteration}",
                             start.where)
    return finding


def _admission(p: Process) -> tuple[int, Event] | None:
    """(barrier, decision) that admitted a joining process: its first decision, if it lists its seat."""
    if not p.decisions:
        return None
    barrier = min(p.decisions)
    e = p.decisions[barrier]
    joined = e.fields.get("joined_lives") or []
    return (barrier, e) if any(isinstance(j, list) and j[:1] == [p.seat] for j in joined) else None


def _end_s(p: Process) -> float:
    return p.time_s(p.segment.events[-1])


def check_one_process_per_life(processes: list[Process]) -> Finding:
    finding = Finding("one_process_per_life")
    by_seat: dict[tuple[int, int], list[Process]] = {}
    for p in processes:
        if p.decisions:  # a process that never entered the job held no seat
            by_seat.setdefault((p.call, p.seat), []).append(p)
    for (call, seat), held in sorted(by_seat.items()):
        held.sort(key=lambda q: q.life)
        finding.checked += len(held)
        for a, b in zip(held, held[1:], strict=False):
            if a.life == b.life:
                finding.fail(f"call {call}, seat {seat}: pids {a.segment.pid} and {b.segment.pid} both held life "
                             f"{a.life}", b.segment.events[0].where)
                continue
            admitted = _admission(b)
            if admitted is None or a.segment.host != b.segment.host:
                continue
            if _end_s(a) > b.time_s(admitted[1]) and _after_in_job(a, admitted[0]):
                finding.fail(f"call {call}, seat {seat}: {a.name} still took part in the job after {b.name} was "
                             f"admitted at barrier {admitted[0]}", admitted[1].where)
    return finding


def _after_in_job(p: Process, barrier: int) -> bool:
    """Whether ``p`` read a decision of ``barrier`` or later that kept it in the job."""
    return any(b >= barrier and p.seat not in (e.fields.get("terminated") or []) for b, e in p.decisions.items())


def check_joiner_admitted_once(processes: list[Process]) -> Finding:
    finding = Finding("joiner_admitted_once")
    barriers: dict[tuple[int, int, int], set[int]] = {}
    for p in processes:
        for barrier, e in p.decisions.items():
            for pair in e.fields.get("joined_lives") or []:
                if isinstance(pair, list) and len(pair) == 2:
                    barriers.setdefault((p.call, pair[0], pair[1]), set()).add(barrier)
    for (call, seat, life), where in sorted(barriers.items()):
        finding.checked += 1
        if len(where) > 1:
            finding.fail(f"call {call}: seat {seat} life {life} admitted at barriers {sorted(where)}")
    return finding


def check_counted_at_next(processes: list[Process]) -> Finding:
    finding = Finding("counted_at_next")
    decided: dict[tuple[int, int], Event] = {}
    for p in processes:
        for barrier, e in p.decisions.items():
            decided.setdefault((p.call, barrier), e)
    for p in processes:
        for barrier, e in p.decisions.items():
            if e.fields.get("ends_job") or p.seat in (e.fields.get("terminated") or []):
                continue
            following = decided.get((p.call, barrier + 1))
            if following is None:
                continue
            if not p.settled(following, RESUME_SLACK_S):
                continue  # decided just before the events were read: it may not have read it yet
            finding.checked += 1
            if barrier + 1 not in p.decisions and p.seat not in (following.fields.get("terminated") or []):
                finding.fail(f"{p.name}, a member of iteration {barrier}, was neither counted at barrier "
                             f"{barrier + 1} nor terminated by it", following.where)
    return finding


def resume_bound_s(call_start: Event | None, backoff_s: float = 0.0) -> float | None:
    """How long after a restart began a healthy rank may start the next iteration, from the call's
    configuration (``call_start``'s ``timeouts``): the slowest detection (a hang: hard timeout and
    grace; a lost rank: the heartbeat timeout), then the barrier's timeout, the storm's back-off, slack."""
    timeouts = call_start.fields.get("timeouts") if call_start is not None else None
    if not isinstance(timeouts, dict):
        return None
    t = {k: float(v) for k, v in timeouts.items() if isinstance(v, (int, float))}
    detection = max(t.get("hard_timeout", 0) + t.get("termination_grace_time", 0), t.get("heartbeat_timeout", 0),
                    t.get("soft_timeout", 0))
    return detection + t.get("barrier_timeout", 0) + backoff_s + RESUME_SLACK_S


def _restart_began_s(processes: list[Process], call: int, iteration: int) -> float | None:
    """The earliest sign of the restart after ``iteration`` on any process: a fault or a detection."""
    times = [p.time_s(e) for p in processes if p.call == call for e in p.segment.events
             if e.kind in ("fault", "restart_detected") and e.iteration == iteration]
    return min(times) if times else None


def check_bounded_resume(processes: list[Process]) -> Finding:
    finding = Finding("bounded_resume")
    for p in processes:
        for barrier, e in sorted(p.decisions.items()):
            if barrier == 0 or e.fields.get("ends_job") or p.seat in (e.fields.get("terminated") or []):
                continue
            bound = resume_bound_s(p.call_start, float(e.fields.get("backoff_s") or 0))
            if not p.settled(e, bound if bound is not None else 60.0):
                continue
            finding.checked += 1
            start = p.starts.get(barrier)
            if start is None:
                if p.exit is not None and p.exit.fields.get("reason") not in DOCUMENTED_REASONS | {None}:
                    finding.fail(f"{p.name} left after barrier {barrier} with an undocumented reason "
                                 f"{p.exit.fields.get('reason')!r}", p.exit.where)
                elif p.exit is None and not _terminated_later(processes, p, barrier):
                    finding.fail(f"{p.name} read barrier {barrier}'s decision, never started its iteration, "
                                 "never left, and no later decision terminated it", e.where)
                continue
            began = _restart_began_s([q for q in processes if q.segment.host == p.segment.host], p.call, barrier - 1)
            if began is None or bound is None:
                continue
            took = p.time_s(start) - began
            if took > bound:
                finding.fail(f"{p.name} started iteration {barrier} {took:.1f}s after the restart began, "
                             f"beyond the {bound:.1f}s its configuration implies", start.where)
    return finding


def _terminated_later(processes: list[Process], p: Process, barrier: int) -> bool:
    return any(q.call == p.call and b > barrier and p.seat in (e.fields.get("terminated") or [])
               for q in processes for b, e in q.decisions.items())


def check_same_final_iteration(processes: list[Process]) -> Finding:
    finding = Finding("same_final_iteration")
    ends: dict[int, dict[str, dict[int, list[Process]]]] = {}
    for p in processes:
        if p.exit is None:
            continue
        reason = p.exit.fields.get("reason")
        how = "completed" if p.exit.fields.get("outcome") == "completed" and reason is None else \
            "ended by a decision" if reason == "abort_job" else \
            "ended by RestartAbort" if p.exit.fields.get("type") == "RestartAbort" else None
        if how is not None:
            finding.checked += 1
            iteration = p.exit.fields.get("iteration")
            ends.setdefault(p.call, {}).setdefault(how, {}).setdefault(iteration if isinstance(iteration, int) else -1,
                                                                       []).append(p)
    for call, hows in sorted(ends.items()):
        iterations = {i for by_iteration in hows.values() for i in by_iteration}
        if len(iterations) > 1:
            parts = "; ".join(f"{how} at iteration {i}: ranks {sorted(p.seat for p in ps)}"
                              for how, by_iteration in sorted(hows.items()) for i, ps in sorted(by_iteration.items()))
            finding.fail(f"call {call} ended with ranks in different iterations: {parts}")
    return finding


_ITERATION_KEY = re.compile(r"^inprocess/(?:[^/]+/)?(\d+)/(\d+)/")


def check_nothing_left(observations: Observations | None) -> Finding:
    finding = Finding("nothing_left")
    if observations is None:
        return finding
    o = observations
    finding.checked += 2
    if o.leftover_processes:
        finding.fail(f"processes of the job outlived it: {o.leftover_processes[:8]}")
    if o.leftover_shm:
        finding.fail(f"shared memory left: {o.leftover_shm[:8]}")
    for label, counts in sorted(o.fds.items()):
        finding.checked += 1
        later = counts[1:]  # the first iteration opens what every later one reuses
        third = max(1, len(later) // 3)
        if len(later) >= 6 and min(later[-third:]) > min(later[:third]) + o.fds_slack:
            finding.fail(f"{label}: descriptors grow from restart to restart: {counts}")
    first_seen: dict[str, int] = {}  # each stale key once, where it was first seen
    for iteration, keys in o.store_keys:
        finding.checked += 1
        for k in keys:
            if (m := _ITERATION_KEY.match(k)) and int(m.group(2)) < iteration - 1:
                first_seen.setdefault(k, iteration)
    for k, iteration in sorted(first_seen.items(), key=lambda item: item[1]):
        finding.fail(f"key {k} of a finished iteration still in the store at the start of iteration {iteration}")
    return finding


CHECKS: list[Callable[[list[Process]], Finding]] = [
    check_one_decision, check_went_on_by_decision, check_one_rank_each, check_one_process_per_life,
    check_joiner_admitted_once, check_counted_at_next, check_bounded_resume, check_same_final_iteration,
]


def check(segments: list[Segment], observations: Observations | None = None,
          horizon_s: float | None = None) -> list[Finding]:
    """Every invariant over the job's segments (and what was observed outside them). ``horizon_s``: the
    wall time at which the events were read while the job ran: what was not due yet is not checked."""
    processes = [Process.of(s) for s in segments]
    for p in processes:
        p.horizon_s = horizon_s
    return [c(processes) for c in CHECKS] + [check_nothing_left(observations)]


def violations(findings: list[Finding]) -> list[Violation]:
    return [v for f in findings for v in f.violations]
