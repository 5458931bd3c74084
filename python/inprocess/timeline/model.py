"""Turns the segments of a job into slices, instants and restarts on one clock.

Times here are integers, ns since the timeline's origin (its earliest event),
on the common clock described in :mod:`inprocess.timeline`.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from inprocess.control import phases as phase_table
from inprocess.control.protocol import FaultRecord
from inprocess.engine.restart_record import is_consequence
from inprocess.timeline.reading import Event, Loaded, Run, Segment

MAIN = "main"  # the rank's main thread: its phases
TRIGGER = "trigger"  # the restart trigger thread: the abort

RESTART_PHASES = phase_table.restart_phase_names()  # in a restart's order
SPARE = "SPARE"  # a slice the timeline adds: a spare waits out an iteration (no phase event says so)
# The main thread still in the function after the restart was detected: the abort releasing it.
RELEASE = "RUNNING after the restart was detected"
SECONDARY = "after_restart"  # a fault raised once the restart was under way: a consequence, not a cause

# A process whose own offset (wall - monotonic) differs from its host's by more
# than this read another monotonic clock (the host rebooted, or shares a name).
_CLOCK_MISMATCH_NS = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class Slice:
    rank: int
    track: str  # MAIN or TRIGGER
    name: str  # a phase, SPARE, or "abort"
    start_ns: int
    end_ns: int
    iteration: int | None
    args: dict[str, Any]
    run: int = 0  # which run (wrapped call of the job) it belongs to: iterations repeat across runs

    @property
    def dur_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclasses.dataclass(frozen=True)
class Instant:
    rank: int
    track: str
    name: str
    category: str  # "call", "fault", "restart", "decision", "exit"
    t_ns: int
    iteration: int | None
    args: dict[str, Any]
    run: int = 0


@dataclasses.dataclass(frozen=True)
class Step:
    rank: int
    name: str  # a restart phase, or RELEASE
    dur_ns: int


@dataclasses.dataclass
class Restart:
    """One restart of one run: iteration ``iteration`` failed.

    Which faults are causes is decided by one rule, the restart record's
    (:func:`inprocess.engine.restart_record.is_consequence`), for the summary,
    the trace's fault instants (their ``role``) and the PNG alike. Times are
    measured from the first cause as recorded (``first_fault_ns``); a death is
    recorded by its monitor once it saw it, so a consequence of it (a peer's
    broken connection) can be seen earlier: ``earlier_sign_ns`` says when.
    """

    call: int
    attempt: int  # the run's ordinal: > 0 when the processes were started again
    iteration: int
    causes: list[dict[str, Any]]  # faults that were not consequences: rank, kind, type, message
    secondary: list[dict[str, Any]]  # consequences (engine/restart_record.py: the rule)
    terminated: list[int]  # initial ranks excluded by the restart
    first_fault_ns: int | None  # the first cause's time; without one, the earliest fault or detection seen
    first_fault_what: str
    resumed_ns: int | None  # the last rank's first RUNNING (or SPARE) of iteration + 1
    slowest: Step | None  # the longest step of the last rank at the restart barrier
    run: int = 0
    earlier_sign_ns: int | None = None  # a consequence or detection seen before the first cause's record
    earlier_sign_what: str = ""

    @property
    def recovery_ns(self) -> int | None:
        if self.first_fault_ns is None or self.resumed_ns is None:
            return None
        return self.resumed_ns - self.first_fault_ns


@dataclasses.dataclass
class RankInfo:
    rank: int
    hosts: list[str]
    pids: list[int]


@dataclasses.dataclass
class Timeline:
    slices: list[Slice]
    instants: list[Instant]
    restarts: list[Restart]
    ranks: dict[int, RankInfo]
    hosts: list[str]
    origin_wall: float  # time.time() of the origin
    alignment: str  # how the hosts' clocks were put on one
    warnings: list[str]


def fault_label(fault: dict[str, Any]) -> str:
    """``kind type`` of a fault record, e.g. "exception RuntimeError", "killed SIGKILL"."""
    # An event names it "fault" (its "kind" is the event's); a decision's record, "kind".
    kind, kind_type = fault["fault"] if "fault" in fault else fault.get("kind"), fault.get("type")
    return " ".join(str(x) for x in (kind, kind_type) if x)


class _Clocks:
    """Puts every segment's CLOCK_MONOTONIC readings on one clock (see the package docstring)."""

    def __init__(self, runs: list[Run], warnings: list[str]):
        by_clock: dict[str, list[int]] = {}
        own: dict[int, int] = {}
        segments = [s for run in runs for s in run.segments.values()]
        for s in segments:
            diffs = [round(e.wall * 1e9) - e.t_ns for e in s.events]
            own[id(s)] = round(statistics.median(diffs))
            by_clock.setdefault(s.clock, []).extend(diffs)
        self.offset_of_clock = {clock: round(statistics.median(d)) for clock, d in by_clock.items()}
        self._offset: dict[int, int] = {}
        for s in segments:
            host_offset = self.offset_of_clock[s.clock]
            if abs(own[id(s)] - host_offset) > _CLOCK_MISMATCH_NS:
                warnings.append(f"rank {s.rank}, call {s.call}: its monotonic clock does not match the other "
                                f"processes of host {s.clock} (a reboot?); aligned by its own wall clock")
                host_offset = own[id(s)]
            self._offset[id(s)] = host_offset
        self.origin = min(e.t_ns + self._offset[id(s)] for s in segments for e in s.events)
        self.hosts = sorted(by_clock)

    def at(self, segment: Segment, t_ns: int) -> int:
        return t_ns + self._offset[id(segment)] - self.origin

    def of_record(self, record: dict[str, Any]) -> int | None:
        """The time of a record dated with ``t_ns`` and ``host``, or ``wall``; None if it has neither."""
        t_ns, host, wall = record.get("t_ns"), record.get("host"), record.get("wall")
        if isinstance(t_ns, int) and t_ns > 0 and host in self.offset_of_clock:
            return t_ns + self.offset_of_clock[host] - self.origin
        if isinstance(wall, (int, float)) and not isinstance(wall, bool):
            return round(wall * 1e9) - self.origin
        return None


def build(loaded: Loaded) -> Timeline:
    warnings = list(loaded.warnings)
    clocks = _Clocks(loaded.runs, warnings)
    slices: list[Slice] = []
    instants: list[Instant] = []
    restarts: list[Restart] = []
    ranks: dict[int, RankInfo] = {}
    for k, run in enumerate(loaded.runs):
        run_slices, run_instants = _run_timeline(run, clocks)
        run_slices = [dataclasses.replace(s, run=k) for s in run_slices]
        run_instants = [dataclasses.replace(i, run=k) for i in run_instants]
        run_restarts = _restarts(run, clocks, run_slices, run_instants)
        for restart in run_restarts:
            restart.run = k
        run_instants = [_with_role(i, run_restarts) for i in run_instants]
        _date_by_causes(run_restarts, run_instants)
        slices.extend(run_slices)
        instants.extend(run_instants)
        restarts.extend(run_restarts)
        for rank, s in run.segments.items():
            info = ranks.setdefault(rank, RankInfo(rank, [], []))
            if s.host is not None and s.host not in info.hosts:
                info.hosts.append(s.host)
            if s.pid is not None and s.pid not in info.pids:
                info.pids.append(s.pid)
    _warn_overlaps(slices, warnings)
    n = len(clocks.hosts)
    alignment = ("one host: CLOCK_MONOTONIC" if n == 1 else
                 f"{n} hosts: CLOCK_MONOTONIC within each, hosts aligned by their wall clocks")
    origin_wall = clocks.origin / 1e9
    slices.sort(key=lambda s: (s.rank, s.track, s.start_ns))
    instants.sort(key=lambda i: (i.t_ns, i.rank))
    return Timeline(slices, instants, restarts, dict(sorted(ranks.items())), clocks.hosts, origin_wall,
                    alignment, warnings)


def _run_timeline(run: Run, clocks: _Clocks) -> tuple[list[Slice], list[Instant]]:
    slices: list[Slice] = []
    instants: list[Instant] = []
    for segment in run.segments.values():
        end, end_note = _segment_end(run, segment, clocks)
        slices.extend(_phase_slices(segment, clocks, end, end_note))
        slices.extend(_abort_slices(segment, clocks))
        instants.extend(_own_instants(segment, clocks))
    instants.extend(_reported_faults(run, clocks, slices, instants))
    return slices, instants


def _last_iteration(segment: Segment) -> int | None:
    its = [e.iteration for e in segment.events if e.iteration is not None]
    return its[-1] if its else None


def _segment_end(run: Run, segment: Segment, clocks: _Clocks) -> tuple[int, str | None]:
    """When the segment's last phase ends, and a note when that time is inferred.

    A call that exited ends at its last event. A segment that just stops (its
    process was killed, or still runs) in iteration i ends when the other ranks
    learnt of it: their first detection of a restart of iteration i or later,
    or decision of a later iteration, after its last event.
    """
    last = clocks.at(segment, segment.events[-1].t_ns)
    if segment.exited:
        return last, None
    stop = _last_iteration(segment) or 0
    later = [clocks.at(other, e.t_ns) for r, other in run.segments.items() if r != segment.rank
             for e in other.events if e.iteration is not None and (
                 (e.kind == "restart_detected" and e.iteration >= stop)
                 or (e.kind == "decision" and e.iteration > stop))]
    later = [t for t in later if t > last]
    if later:
        return min(later), ("the rank's events stop without an exit event (its process was killed, or is "
                            "still running); its last phase is drawn until the other ranks learnt of it: their "
                            "first restart detection or decision that follows its last event")
    ends = [clocks.at(other, other.events[-1].t_ns) for other in run.segments.values()]
    return max(ends), ("the rank's events stop here without an exit event; its last phase is drawn until "
                       "the last event of the job")


def _phase_slices(segment: Segment, clocks: _Clocks, end: int, end_note: str | None) -> list[Slice]:
    """A slice from each phase event to the next; a spare's iteration gets a SPARE slice
    from its iteration_start when no RUNNING of that iteration follows it."""
    marks: list[tuple[int, str, int | None, dict[str, Any]]] = []
    starts = {e.iteration: e for e in segment.events if e.kind == "iteration_start"}
    phase_events = [e for e in segment.events if e.kind == "phase"]
    for e in segment.events:
        if e.kind == "phase":
            args: dict[str, Any] = {"iteration": e.iteration}
            start = starts.get(e.iteration)
            if e.fields["phase"] == "RUNNING" and start is not None:
                args.update(_iteration_args(start))
            marks.append((clocks.at(segment, e.t_ns), e.fields["phase"], e.iteration, args))
        elif e.kind == "iteration_start" and e.fields.get("mode") == "INACTIVE":
            following = next((p for p in phase_events if p.t_ns >= e.t_ns), None)
            if following is None or following.fields["phase"] != "RUNNING" or following.iteration != e.iteration:
                args = {"iteration": e.iteration, "note": "a spare waiting (added by the timeline: no phase "
                        "event marks it)", **_iteration_args(e)}
                marks.append((clocks.at(segment, e.t_ns), SPARE, e.iteration, args))
    out = []
    for k, (start_ns, name, iteration, args) in enumerate(marks):
        last = k + 1 == len(marks)
        stop = marks[k + 1][0] if not last else max(end, start_ns)
        if last and end_note is not None:
            args = {**args, "end": "inferred", "note": end_note}
        out.append(Slice(segment.rank, MAIN, name, start_ns, stop, iteration, args))
    return out


def _iteration_args(start: Event) -> dict[str, Any]:
    keys = ("mode", "job_rank", "active_rank", "world_size", "active_world_size")
    return {k: start.fields[k] for k in keys if k in start.fields}


def _abort_slices(segment: Segment, clocks: _Clocks) -> list[Slice]:
    """The abort, on the trigger thread: from restart_detected to abort_done of the same iteration."""
    detected = {e.iteration: e for e in segment.events if e.kind == "restart_detected"}
    out = []
    for e in segment.events:
        if e.kind == "abort_done" and e.iteration in detected:
            start = clocks.at(segment, detected[e.iteration].t_ns)
            out.append(Slice(segment.rank, TRIGGER, "abort", start, max(start, clocks.at(segment, e.t_ns)),
                             e.iteration, {"iteration": e.iteration}))
    return out


def _own_instants(segment: Segment, clocks: _Clocks) -> list[Instant]:
    out = []
    for e in segment.events:
        t = clocks.at(segment, e.t_ns)
        f = e.fields
        args: dict[str, Any]
        if e.kind == "call_start":
            args = {k: f[k] for k in ("call", "world_size", "host", "pid") if k in f}
            out.append(Instant(segment.rank, MAIN, f"call {e.call} starts", "call", t, None, args))
        elif e.kind == "fault":
            args = {k: f.get(k) for k in ("iteration", "fault", "type", "message")}
            out.append(Instant(segment.rank, MAIN, f"fault: {fault_label(f)}", "fault", t, e.iteration, args))
        elif e.kind in ("restart_detected", "abort_done"):
            out.append(Instant(segment.rank, TRIGGER, e.kind, "restart", t, e.iteration,
                               {"iteration": e.iteration}))
        elif e.kind == "decision":
            args = {k: f.get(k) for k in ("iteration", "world_size", "active_world_size", "terminated",
                                          "leader", "n_faults", "faults")}
            out.append(Instant(segment.rank, MAIN, f"decision: iteration {e.iteration}", "decision", t,
                               e.iteration, args))
        elif e.kind == "exit":
            args = {k: f[k] for k in ("outcome", "reason", "iteration", "type", "message") if k in f}
            out.append(Instant(segment.rank, MAIN, f"exit: {f.get('outcome')}", "exit", t, e.iteration, args))
    return out


def _decision_faults(run: Run) -> dict[int, list[dict[str, Any]]]:
    """iteration that failed -> the faults its restart's decision lists (every rank reads the same one)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for segment in run.segments.values():
        for e in segment.events:
            faults = e.fields.get("faults")
            if e.kind == "decision" and e.iteration and isinstance(faults, list):
                out.setdefault(e.iteration - 1, [f for f in faults if isinstance(f, dict)])
    return out


def _reported_by_itself(segment: Segment | None, iteration: int, kind: Any) -> bool:
    if segment is None:
        return False
    for e in segment.events:
        if e.kind == "fault" and e.iteration == iteration and e.fields.get("fault") == kind:
            return True
        if e.kind == "exit" and e.fields.get("reason") == kind:
            return True
    return False


def _reported_faults(run: Run, clocks: _Clocks, slices: list[Slice], instants: list[Instant]) -> list[Instant]:
    """A fault that only the decision tells (a death or a lost rank, recorded by its
    monitor), as an instant on that rank: at the fault's own time when the
    record carries one, else where the rank's events end, else at the decision."""
    out = []
    for iteration, faults in _decision_faults(run).items():
        for f in faults:
            rank = f.get("rank")
            if not isinstance(rank, int) or _reported_by_itself(run.segments.get(rank), iteration, f.get("kind")):
                continue
            args = {"iteration": iteration, "fault": f.get("kind"), "type": f.get("type"),
                    "message": f.get("message"), "reported_by": f"the decision of iteration {iteration + 1}"}
            t = clocks.of_record(f)
            if t is None:
                t, args["time"] = _inferred_fault_time(rank, iteration, slices, instants)
            out.append(Instant(rank, MAIN, f"fault: {fault_label(f)}", "fault", t, iteration, args))
    return out


def _inferred_fault_time(rank: int, iteration: int, slices: list[Slice], instants: list[Instant]) -> tuple[int, str]:
    ends = [s for s in slices if s.rank == rank and s.track == MAIN and s.args.get("end") == "inferred"
            and s.iteration == iteration]
    if ends:
        return ends[-1].end_ns, "not recorded: drawn where the rank's last phase is drawn to end"
    decisions = [i.t_ns for i in instants if i.category == "decision" and i.iteration == iteration + 1]
    if decisions:
        return min(decisions), "not recorded: drawn at the first decision that reports it"
    return 0, "not recorded"


def _restarts(run: Run, clocks: _Clocks, slices: list[Slice], instants: list[Instant]) -> list[Restart]:
    failed = {e.iteration for s in run.segments.values() for e in s.events
              if e.kind == "restart_detected" and e.iteration is not None}
    failed |= {e.iteration - 1 for s in run.segments.values() for e in s.events
               if e.kind == "decision" and e.iteration}
    decided = _decision_faults(run)
    ranks = set(run.segments)
    out = []
    for i in sorted(failed):
        faults = decided.get(i)
        if faults is None:  # the job ended before a decision: what the ranks reported themselves
            faults = [{"rank": x.rank, "kind": x.args["fault"], "type": x.args["type"], "message": x.args["message"]}
                      for x in instants if x.category == "fault" and x.iteration == i and x.rank in ranks]
        records = [_as_record(f, i) for f in faults]
        causes = [f for f, r in zip(faults, records, strict=True) if not is_consequence(r, records)]
        # A fault no rank reported itself (a death, found by a monitor) has no
        # time of its own, and the others' errors of that iteration are often its
        # consequence: those come first.
        causes.sort(key=lambda f: _reported_by_itself(run.segments.get(f.get("rank", -1)), i, f.get("kind")))
        secondary = [f for f, r in zip(faults, records, strict=True) if is_consequence(r, records)]
        terminated = next((list(e.fields.get("terminated") or []) for s in run.segments.values()
                           for e in s.events if e.kind == "decision" and e.iteration == i + 1), [])
        first, what = _first_sign(run, clocks, i)
        by_rank: dict[int, int] = {}
        for s in slices:
            if s.track == MAIN and s.iteration == i + 1 and s.name in ("RUNNING", SPARE) and s.rank in ranks:
                by_rank[s.rank] = min(by_rank.get(s.rank, s.start_ns), s.start_ns)
        resumed = list(by_rank.values())
        out.append(Restart(run.call, run.ordinal, i, causes, secondary, terminated, first, what,
                           max(resumed) if resumed else None, _slowest_step(i, slices)))
    return out


def fault_kind(fault: dict[str, Any]) -> Any:
    """The kind of a fault: an event names it "fault" (its "kind" is the event's), a decision's record "kind"."""
    return fault["fault"] if "fault" in fault else fault.get("kind")


def is_cause(restart: Restart, rank: Any, kind: Any) -> bool:
    """A fault of ``rank`` of this ``kind`` in the restart's iteration is one of its causes (the one rule)."""
    return any(f.get("rank") == rank and fault_kind(f) == kind for f in restart.causes)


def drawn_as_consequence(instant: Instant) -> bool:
    """A fault instant that is a consequence, not a cause: its restart's rule says so (``role``), or,
    outside any restart (no decision came), it was raised once a restart was under way. The PNG
    draws by it; the summary lists the same restart's ``causes``."""
    role = instant.args.get("role")
    return role == "consequence" if role is not None else instant.args.get("fault") == SECONDARY


def _with_role(instant: Instant, restarts: list[Restart]) -> Instant:
    """A fault instant marked as its restart's cause or consequence (``args["role"]``)."""
    if instant.category != "fault":
        return instant
    restart = next((r for r in restarts if r.iteration == instant.iteration), None)
    if restart is None:
        return instant
    role = "cause" if is_cause(restart, instant.rank, instant.args.get("fault")) else "consequence"
    return dataclasses.replace(instant, args={**instant.args, "role": role})


def _date_by_causes(restarts: list[Restart], instants: list[Instant]) -> None:
    """Each restart measured from its first cause, and the sign seen before it, if any."""
    for r in restarts:
        # A cause whose time was not recorded (drawn where its rank's events end) dates nothing.
        dated = [i for i in instants if i.category == "fault" and i.iteration == r.iteration
                 and i.args.get("role") == "cause" and "time" not in i.args]
        if not dated or r.first_fault_ns is None:
            continue
        cause = min(dated, key=lambda i: (i.t_ns, i.rank))
        first = cause.t_ns
        if r.first_fault_ns < first:
            r.earlier_sign_ns, r.earlier_sign_what = r.first_fault_ns, r.first_fault_what
        r.first_fault_ns, r.first_fault_what = first, f"rank {cause.rank} {fault_label(cause.args)}"


def _as_record(fault: dict[str, Any], iteration: int) -> FaultRecord:
    """A fault dict of an event as the record the cause rule reads."""
    return FaultRecord(int(fault.get("rank", -1)), iteration, str(fault.get("kind", "")), str(fault.get("type", "")),
                       str(fault.get("message", "")))


def _slowest_step(iteration: int, slices: list[Slice]) -> Step | None:
    """The longest step of the rank that arrived last at the restart barrier: the
    one every other rank waited for (their own barrier time is that wait)."""
    mine = [s for s in slices if s.iteration == iteration]
    arrivals = {s.rank: s.start_ns for s in mine if s.track == MAIN and s.name == "RESTART_BARRIER"}
    if not arrivals:
        return None
    last = max(arrivals, key=lambda r: (arrivals[r], r))
    steps = [Step(last, s.name, s.dur_ns) for s in mine
             if s.rank == last and s.track == MAIN and s.name in RESTART_PHASES]
    detected = [s.start_ns for s in mine if s.rank == last and s.track == TRIGGER]
    aborting = [s.start_ns for s in mine if s.rank == last and s.track == MAIN and s.name == "ABORTING"]
    if detected and aborting:
        steps.append(Step(last, RELEASE, aborting[0] - detected[0]))
    return max(steps, key=lambda step: step.dur_ns)


def _first_sign(run: Run, clocks: _Clocks, iteration: int) -> tuple[int | None, str]:
    """The earliest first-hand fault or restart detection of ``iteration``, and what it was."""
    signs = []
    for rank, s in run.segments.items():
        for e in s.events:
            if e.iteration != iteration:
                continue
            if e.kind == "fault" and e.fields.get("fault") != SECONDARY:
                signs.append((clocks.at(s, e.t_ns), f"fault on rank {rank}"))
            elif e.kind == "restart_detected":
                signs.append((clocks.at(s, e.t_ns), f"restart detected on rank {rank}"))
    for f in _decision_faults(run).get(iteration, []):
        t = clocks.of_record(f)
        if t is not None and f.get("kind") != SECONDARY:
            signs.append((t, f"fault on rank {f.get('rank')}"))
    if not signs:
        return None, "no fault seen"
    return min(signs)


def _warn_overlaps(slices: list[Slice], warnings: list[str]) -> None:
    """Two processes writing as the same rank at once overlap on its track."""
    last_end: dict[tuple[int, str], int] = {}
    for s in sorted(slices, key=lambda s: (s.rank, s.track, s.start_ns)):
        key = (s.rank, s.track)
        if s.start_ns < last_end.get(key, s.start_ns):
            warnings.append(f"rank {s.rank}: its {s.name} slice at {s.start_ns / 1e6:.3f} ms overlaps an earlier "
                            "one (two processes wrote events as the same rank at once?)")
        last_end[key] = max(last_end.get(key, 0), s.end_ns)
