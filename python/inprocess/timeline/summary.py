"""The text summary of a timeline: one paragraph per restart."""

from __future__ import annotations

import re
from typing import Any

from inprocess.timeline.model import Restart, Timeline, fault_label

_MESSAGE_CHARS = 70
_SOURCE_LOCATION = re.compile(r"^\[[^\]\s]*:\d+\]\s*")


def _ms(ns: int | None) -> str:
    return "?" if ns is None else f"{ns / 1e6:.1f} ms"


def _fault(f: dict[str, Any]) -> str:
    message = " ".join(str(f.get("message") or "").split())
    message = _SOURCE_LOCATION.sub("", message)  # "[.../pair.cc:553] Connection closed": the words matter
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS - 3] + "..."
    text = f"rank {f.get('rank')} {fault_label(f)}"
    return f"{text}: {message}" if message else text


def restart_lines(number: int, r: Restart) -> list[str]:
    first = _fault(r.causes[0]) if r.causes else "no fault recorded"
    lines = [f"restart {number} (iteration {r.iteration} failed): {first}"]
    lines += [f"  and {_fault(f)}" for f in r.causes[1:]]
    extra = []
    if r.secondary:
        ranks = ", ".join(str(f.get("rank")) for f in r.secondary)
        extra.append(f"secondary errors (raised once the restart was under way) on rank(s) {ranks}")
    if r.terminated:
        extra.append("excluded: rank(s) " + ", ".join(str(x) for x in r.terminated))
    if extra:
        lines.append("  " + "; ".join(extra))
    if r.resumed_ns is None:
        recovery = "the job did not resume after it"
    else:
        recovery = f"{_ms(r.recovery_ns)} from the first fault ({r.first_fault_what}) to the last rank's next RUNNING"
    lines.append(f"  {recovery}")
    if r.earlier_sign_ns is not None and r.first_fault_ns is not None:
        lines.append(f"  {r.earlier_sign_what} was seen {_ms(r.first_fault_ns - r.earlier_sign_ns)} before that fault "
                     "was recorded (a death is recorded by its monitor once it saw it: its consequences can come "
                     "first)")
    if r.slowest is not None:
        lines.append(f"  slowest phase: {r.slowest.name} on rank {r.slowest.rank} (the last at the barrier), "
                     f"{_ms(r.slowest.dur_ns)}")
    return lines


def summary_lines(timeline: Timeline, source: str, n_events: int) -> list[str]:
    hosts = ", ".join(timeline.hosts)
    lines = [f"{n_events} events of {len(timeline.ranks)} rank(s) from {source}; "
             f"{len(timeline.hosts)} host(s): {hosts} (clock: {timeline.alignment})"]
    if not timeline.restarts:
        lines.append("no restart")
    runs: dict[tuple[int, int], list[Restart]] = {}
    for r in timeline.restarts:
        runs.setdefault((r.call, r.attempt), []).append(r)
    several = len(runs) > 1
    number = 0  # counted across calls, as the PNG numbers them
    for (call, attempt), restarts in runs.items():
        if several or call or attempt:
            lines.append(f"call {call}" + (f", started again ({attempt} time(s) before)" if attempt else "") + ":")
        for r in restarts:
            number += 1
            lines.extend(restart_lines(number, r))
    return lines
