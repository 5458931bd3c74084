"""A chaos run in figures: faults by kind and place, restarts by cause, restart times per kind.

A restart's time is from its first sign on any rank (a fault the rank reported, or its trigger seeing
the restart) to the last active rank's start of the next iteration, on the host's monotonic clock.
Its kind is the scheduled fault of the iteration it ends, unless its causes say otherwise: a grow
(joiners taken in at a safe point) or a filler (the scheduled fault did not fire).
"""

from __future__ import annotations

import collections
import math
from typing import Any

from ..timeline.reading import Segment
from .schedule import Schedule


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of ``values`` (not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _restart_kind(schedule: Schedule, barrier: int, causes: list[dict[str, Any]]) -> str:
    if causes and all(c.get("kind") == "grow" for c in causes):
        return "grow"
    if any(c.get("type") == "ChaosFiller" for c in causes):
        return "filler"
    if barrier - 1 < len(schedule.faults):
        return schedule.faults[barrier - 1].kind
    return "after the schedule"


def restarts(schedule: Schedule, segments: list[Segment]) -> list[dict[str, Any]]:
    """Per restart decision: barrier, kind, causes' kinds, seconds from its first sign to the last resume."""
    began: dict[int, int] = {}
    resumed: dict[int, int] = {}
    decided: dict[int, dict[str, Any]] = {}
    for seg in segments:
        for e in seg.events:
            it = e.iteration
            if it is None:
                continue
            if e.kind in ("fault", "restart_detected"):
                began[it] = min(began.get(it, e.t_ns), e.t_ns)
            elif e.kind == "iteration_start" and e.fields.get("mode") == "ACTIVE":
                resumed[it] = max(resumed.get(it, e.t_ns), e.t_ns)
            elif e.kind == "decision" and it > 0:
                decided.setdefault(it, e.fields)
    out = []
    for barrier, fields in sorted(decided.items()):
        causes = [c for c in fields.get("faults") or [] if isinstance(c, dict)]
        seconds = None
        if barrier - 1 in began and barrier in resumed:
            seconds = (resumed[barrier] - began[barrier - 1]) / 1e9
        out.append({"barrier": barrier, "kind": _restart_kind(schedule, barrier, causes), "seconds": seconds,
                    "causes": sorted({str(c.get("kind")) for c in causes}), "joined": len(fields.get("joined_lives")
                                                                                      or []),
                    "terminated": len(fields.get("terminated") or [])})
    return out


def summarize(schedule: Schedule, segments: list[Segment]) -> dict[str, Any]:
    done = restarts(schedule, segments)
    times: dict[str, list[float]] = collections.defaultdict(list)
    for r in done:
        if r["seconds"] is not None:
            times[r["kind"]].append(r["seconds"])
    per_kind = {kind: {"n": len(v), "p50_s": round(percentile(v, 50), 3), "p99_s": round(percentile(v, 99), 3),
                       "max_s": round(max(v), 3)} for kind, v in sorted(times.items())}
    scheduled = collections.Counter(f"{f.kind} @ {f.where}" for f in schedule.faults)
    causes = collections.Counter(c for r in done for c in r["causes"])
    lives = collections.Counter(s.rank for s in segments)
    return {
        "faults": len(schedule.faults), "scheduled": dict(sorted(scheduled.items())),
        "restarts": len(done), "restart_kinds": dict(collections.Counter(r["kind"] for r in done)),
        "causes": dict(sorted(causes.items())), "restart_seconds": per_kind,
        "admitted": sum(r["joined"] for r in done), "terminated": sum(r["terminated"] for r in done),
        "processes": sum(lives.values()), "respawns": sum(n - 1 for n in lives.values()),
    }


def render(schedule: Schedule, figures: dict[str, Any], status: int, seconds: float, partial_checks: int) -> str:
    lines = [f"chaos run: seed {schedule.seed}, {schedule.ranks} active + {schedule.spares} spare ranks on "
             f"{schedule.nodes} node(s), {figures['faults']} faults scheduled; launcher exit status {status}; "
             f"{seconds:.0f} s; invariants checked {partial_checks} times while it ran",
             f"restarts {figures['restarts']} ({figures['restart_kinds']}); processes {figures['processes']} "
             f"({figures['respawns']} respawned); admitted {figures['admitted']}; terminated {figures['terminated']}",
             "faults scheduled (kind @ place): " + ", ".join(f"{k} {n}" for k, n in figures["scheduled"].items()),
             "restart causes recorded (fault kinds): " + ", ".join(f"{k} {n}" for k, n in figures["causes"].items()),
             f"{'restart time by kind':<24} {'n':>4} {'p50 s':>7} {'p99 s':>7} {'max s':>7}"]
    for kind, t in figures["restart_seconds"].items():
        lines.append(f"{kind:<24} {t['n']:>4} {t['p50_s']:>7.3f} {t['p99_s']:>7.3f} {t['max_s']:>7.3f}")
    return "\n".join(lines)
