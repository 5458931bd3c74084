"""Reads a directory of ``rank*.jsonl`` event files into segments and runs.

A *segment* is one wrapped call of one process as its rank's file records it:
from a ``call_start`` record to the end of that call's lines. A file holds
several when the process wrapped several calls, or when a relaunched process
appended to the file of the one before it. A *run* is one wrapped call of the
whole job: the segments of every rank with the same call index and the same
ordinal among that rank's starts of it (the second ``call_start`` of call 0 in
a file belongs to the job's second attempt, e.g. after a launcher restarted
every worker).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")

# Fields every line has, and their JSON types (bool is no int here).
_COMMON: dict[str, Any] = {"t_ns": int, "wall": (int, float), "rank": int, "call": int, "kind": str}
# Fields a kind needs for the timeline; other kinds' fields are kept as they are.
_BY_KIND: dict[str, dict[str, Any]] = {
    "phase": {"phase": str, "iteration": int},
    "iteration_start": {"iteration": int},
    "fault": {"iteration": int},
    "restart_detected": {"iteration": int},
    "abort_done": {"iteration": int},
    "decision": {"iteration": int},
}


class EventFileError(ValueError):
    """A line that is not an event, named by file and line number."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str
    t_ns: int  # CLOCK_MONOTONIC of the writer's host
    wall: float
    rank: int
    call: int
    fields: dict[str, Any]  # the whole record
    where: str  # "file:line", for messages

    @property
    def iteration(self) -> int | None:
        value = self.fields.get("iteration")
        return value if isinstance(value, int) else None


@dataclasses.dataclass
class Segment:
    """One wrapped call of one process, as one rank's file records it."""

    rank: int
    call: int
    ordinal: int  # how many earlier starts of this call the file holds
    host: str | None  # from call_start; None when the file has none for it
    pid: int | None
    events: list[Event]  # in CLOCK_MONOTONIC order (the file's order breaks ties)

    @property
    def exited(self) -> bool:
        """True when the call ended with an ``exit`` event (a killed process's segment just stops)."""
        return any(e.kind == "exit" for e in self.events)

    @property
    def clock(self) -> str:
        """The name of the monotonic clock this segment's ``t_ns`` are read on."""
        return self.host if self.host is not None else f"?rank{self.rank}"


@dataclasses.dataclass
class Run:
    """One wrapped call of the whole job: one segment per rank that took part."""

    call: int
    ordinal: int
    segments: dict[int, Segment]  # by initial rank


@dataclasses.dataclass
class Loaded:
    runs: list[Run]
    warnings: list[str]
    files: list[str]
    n_events: int


def rank_files(directory: str) -> list[tuple[int, str]]:
    """``(rank, path)`` of every ``rank<N>.jsonl`` in ``directory``, by rank."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory!r}: no such directory (expected the events directory of a job)")
    found = []
    for name in os.listdir(directory):
        m = _RANK_FILE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def parse_line(text: str, where: str) -> Event:
    """One line as an :class:`Event`; ``ValueError`` saying what is wrong with it."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    kind = record.get("kind")
    wanted: dict[str, Any] = dict(_COMMON)
    wanted.update(_BY_KIND.get(kind, {}) if isinstance(kind, str) else {})
    for name, types in wanted.items():
        if name not in record:
            raise ValueError(f"no {name!r} field")
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"field {name!r} is {value!r}; expected {_type_names(types)}")
    return Event(record["kind"], record["t_ns"], float(record["wall"]), record["rank"], record["call"], record, where)


def _type_names(types: Any) -> str:
    names = [t.__name__ for t in (types if isinstance(types, tuple) else (types,))]
    return " or ".join("a string" if n == "str" else f"an {n}" if n == "int" else f"a {n}" for n in names)


def read_file(path: str, rank: int, strict: bool = False) -> tuple[list[Segment], list[str], int]:
    """The segments of one rank's file, the warnings about it, and the number of events read.

    A last line without its newline was cut by a killed writer: skipped with a
    warning. Any other bad line is skipped with a warning naming file and line,
    or raises :class:`EventFileError` when ``strict``.
    """
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    cut_last = lines[-1] != b""  # a complete file ends with a newline
    if not cut_last:
        lines.pop()
    warnings: list[str] = []
    segments: list[Segment] = []
    current: dict[int, Segment] = {}  # call index -> the segment its lines go to
    starts: dict[int, int] = {}  # call index -> call_starts seen
    n_events = 0
    for number, raw in enumerate(lines, start=1):
        where = f"{path}:{number}"
        if not raw.strip():
            continue
        try:
            event = parse_line(raw.decode("utf-8", errors="replace"), where)
        except ValueError as e:
            if cut_last and number == len(lines):
                warnings.append(f"{where}: incomplete last line skipped (its writer was killed while writing it?)")
                continue
            if strict:
                raise EventFileError(path, number, str(e)) from None
            warnings.append(f"{where}: line skipped: {e}")
            continue
        if event.rank != rank:
            warnings.append(f"{where}: an event of rank {event.rank} in the file of rank {rank}; kept as rank {rank}")
            event = dataclasses.replace(event, rank=rank)
        n_events += 1
        segment = current.get(event.call)
        if event.kind == "call_start" or segment is None:
            if event.kind != "call_start":
                warnings.append(f"{where}: call {event.call} has no call_start before this line; "
                                "its host is unknown (aligned by its own wall clock)")
            host = event.fields.get("host") if event.kind == "call_start" else None
            pid = event.fields.get("pid") if event.kind == "call_start" else None
            ordinal = starts.get(event.call, 0)
            starts[event.call] = ordinal + 1
            segment = Segment(rank, event.call, ordinal, host if isinstance(host, str) else None,
                              pid if isinstance(pid, int) else None, [])
            current[event.call] = segment
            segments.append(segment)
        segment.events.append(event)
    for segment in segments:
        # Events dated on another thread (restart_detected, abort_done) are
        # written after the phase that follows them: order by the clock.
        segment.events.sort(key=lambda e: e.t_ns)
    return segments, warnings, n_events


def load(directory: str, strict: bool = False) -> Loaded:
    """Every ``rank*.jsonl`` of ``directory``, merged into runs.

    Raises ``FileNotFoundError`` when the directory does not exist or holds no
    event file, ``ValueError`` when no file holds an event.
    """
    files = rank_files(directory)
    if not files:
        raise FileNotFoundError(f"{directory!r} holds no rank<N>.jsonl file (is it the directory the job's "
                                "events were written to, Wrapper(events_dir=...) or INPROCESS_EVENTS_DIR?)")
    warnings: list[str] = []
    runs: dict[tuple[int, int], Run] = {}
    n_events = 0
    for rank, path in files:
        segments, file_warnings, n = read_file(path, rank, strict)
        warnings.extend(file_warnings)
        n_events += n
        for segment in segments:
            run = runs.setdefault((segment.call, segment.ordinal), Run(segment.call, segment.ordinal, {}))
            run.segments[rank] = segment
    if n_events == 0:
        raise ValueError(f"no event in {len(files)} file(s) of {directory!r}")
    ordered = sorted(runs.values(), key=lambda r: min(e.wall for s in r.segments.values() for e in s.events))
    return Loaded(ordered, warnings, [path for _, path in files], n_events)
