"""A :class:`~inprocess.timeline.model.Timeline` as a Chrome/Perfetto trace (Trace Event Format).

One process per rank (pid = rank + 1: viewers treat 0 as no process), with
two threads: the main thread's phases (tid 2·rank + 1) and the restart trigger
thread's abort (tid 2·rank + 2); tids are unique across the trace, because
some viewers key threads by tid alone. Phases and aborts are complete events
("X"); call starts, faults, restart detections, abort ends, decisions and exits are
thread-scoped instant events ("i"). ``ts`` and ``dur`` are µs since the
timeline's origin, with ns kept as decimals.
"""

from __future__ import annotations

import json
from typing import Any

from inprocess.timeline.model import MAIN, TRIGGER, Timeline

THREAD_NAMES = {MAIN: "phases (main thread)", TRIGGER: "abort (trigger thread)"}


def pid_of(rank: int) -> int:
    return rank + 1


def tid_of(rank: int, track: str) -> int:
    return 2 * rank + (1 if track == MAIN else 2)


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def to_trace(timeline: Timeline, source: str = "") -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    for rank, info in timeline.ranks.items():
        pid = pid_of(rank)
        where = ", ".join(info.hosts) or "host unknown"
        pids = ", ".join(str(p) for p in info.pids)
        label = f"rank {rank} ({where}" + (f", pid {pids})" if pids else ")")
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": rank}})
        for order, track in enumerate((MAIN, TRIGGER)):
            tid = tid_of(rank, track)
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": THREAD_NAMES[track]}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                           "args": {"sort_index": order}})
    for s in timeline.slices:
        events.append({"ph": "X", "name": s.name, "cat": "abort" if s.track == TRIGGER else "phase",
                       "ts": _us(s.start_ns), "dur": _us(s.dur_ns), "pid": pid_of(s.rank),
                       "tid": tid_of(s.rank, s.track), "args": s.args})
    for i in timeline.instants:
        events.append({"ph": "i", "s": "t", "name": i.name, "cat": i.category, "ts": _us(i.t_ns),
                       "pid": pid_of(i.rank), "tid": tid_of(i.rank, i.track), "args": i.args})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": source,
            "origin_wall": timeline.origin_wall,
            "clock": timeline.alignment,
            "hosts": timeline.hosts,
            "warnings": timeline.warnings,
        },
    }


def write_trace(timeline: Timeline, path: str, source: str = "") -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_trace(timeline, source), f, separators=(",", ":"))
