"""How long a joiner takes to become an active rank, and what a restart that admits one costs the others.

Real processes on 127.0.0.1 (``inprocess.launch.LocalJob``, gloo, the job's
own TCPStore), ``benchmarks/join_latency_worker.py`` as every rank: a 3-seat
job, every rank active (``ActivateAllRanks`` + ``ShiftRanks``), one gloo
``all_reduce`` per step. Per cycle:

1. **lose**: the driver SIGKILLs seat 2's process; the others restart
   without it (world 2);
2. the driver starts seat 2's replacement (``LocalJob.respawn``:
   ``INPROCESS_JOIN=1``), which announces itself and waits;
3. **admit**: once it announced, the driver asks seat 0 for a fault (an
   exception); the restart's leader admits the joiner, which becomes active
   at once (world 3 again);
4. **plain**: once every rank stepped, seat 0 raises again: a restart with
   the same fault and no joiner, the baseline of 3.

Measured, with ``time.monotonic()`` stamps that every process of this machine
shares: (a) the joiner's process start (the driver's ``Popen``) to its
announcement, to its admission, to its first step (the first all_reduce of
its first iteration, with every rank); (b) every restart's pause of the
healthy ranks: from the fault (the kill, or the raise) to the first step of
the next iteration, the last healthy rank's. (b) is measured for restarts
that admit a joiner *triggered by a fault*, next to restarts of the same fault
without one; the pause per *grow* (a restart the grow policy makes at a safe
point, no fault) is ``benchmarks/grow_pause.py``'s.

``python benchmarks/join_latency.py --cycles 50`` (each cycle pays a joiner's
interpreter and torch import, seconds on a loaded machine). Prints a table,
then one JSON line. INPROCESS_RESTART_STORM=off: the restarts come on purpose,
one after another (README, "Restart storms").
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path

HERE = pathlib.Path(__file__).resolve().parent
WORLD_SIZE = 3
JOINER_SEAT = 2


def _events(out: pathlib.Path, seat: int, life: int) -> list[dict[str, Any]]:
    path = out / f"events.seat{seat}.life{life}.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _first(events: list[dict[str, Any]], ev: str, **match: Any) -> dict[str, Any] | None:
    for e in events:
        if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


class Timeline:
    """The events of every process of the job, read from disk as the job goes."""

    def __init__(self, out: pathlib.Path, timeout_s: float):
        self.out = out
        self.timeout_s = timeout_s

    def wait_for(self, seat: int, life: int, ev: str, what: str, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            e = _first(_events(self.out, seat, life), ev, **match)
            if e is not None:
                return e
            time.sleep(0.01)
        raise TimeoutError(f"seat {seat} life {life}: no {what} within {self.timeout_s:g}s")

    def steps_after(self, seats: list[tuple[int, int]], iteration_above: int, what: str) -> dict[tuple[int, int], Any]:
        """The first step of each process in the first iteration after ``iteration_above``."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            found = {}
            for seat, life in seats:
                for e in _events(self.out, seat, life):
                    if e["ev"] == "step" and e["iteration"] > iteration_above:
                        found[(seat, life)] = e
                        break
            if len(found) == len(seats):
                return found
            time.sleep(0.01)
        raise TimeoutError(f"{what}: not every rank of {seats} stepped within {self.timeout_s:g}s")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": statistics.median(values), "p99": _pct(values, 0.99), "max": max(values)}


def run(cycles: int, out: pathlib.Path, timeout_s: float, step_s: float) -> dict[str, Any]:
    from inprocess.launch import LocalJob

    env = {"OUT": str(out), "STEP_S": str(step_s), "INPROCESS_RESTART_STORM": "off"}
    samples: dict[str, list[float]] = {"lose_pause_ms": [], "admit_pause_ms": [], "plain_pause_ms": [],
                                       "start_to_announced_ms": [], "announced_to_admitted_ms": [],
                                       "admitted_to_first_step_ms": [], "start_to_first_step_ms": []}
    tl = Timeline(out, timeout_s)
    healthy = [(0, 0), (1, 0)]
    with LocalJob([str(HERE / "join_latency_worker.py")], WORLD_SIZE, env=env, capture=False) as job:
        try:
            joiner = (JOINER_SEAT, 0)
            popen = job.ranks[JOINER_SEAT].popen
            steps = tl.steps_after(healthy + [joiner], -1, "the job's start")
            iteration = max(e["iteration"] for e in steps.values())
            fault = 0
            for cycle in range(cycles):
                # 1. lose: seat 2's process is killed.
                t_kill = time.monotonic()
                os.kill(popen.pid, signal.SIGKILL)
                popen.wait(timeout_s)
                steps = tl.steps_after(healthy, iteration, f"cycle {cycle}: the restart after the kill")
                samples["lose_pause_ms"].append(1e3 * (max(e["t"] for e in steps.values()) - t_kill))
                iteration = max(e["iteration"] for e in steps.values())
                # 2. its replacement announces itself.
                life = cycle + 1
                t_spawn = time.monotonic()
                popen = job.respawn(JOINER_SEAT, life).popen
                joiner = (JOINER_SEAT, life)
                announced = tl.wait_for(*joiner, "announced", "announcement")
                # 3. admit: a fault of seat 0; the restart's leader admits the joiner.
                (out / f"fault{fault}").touch()
                raised = tl.wait_for(0, 0, "raise", f"fault {fault}", k=fault)
                fault += 1
                steps = tl.steps_after(healthy + [joiner], raised["iteration"], f"cycle {cycle}: the admitting restart")
                admitted = tl.wait_for(*joiner, "admitted", "admission")
                first = steps[joiner]
                if first["active_world_size"] != WORLD_SIZE:
                    raise RuntimeError(f"cycle {cycle}: the joiner stepped in a world of {first['active_world_size']}")
                samples["admit_pause_ms"].append(1e3 * (max(steps[h]["t"] for h in healthy) - raised["t"]))
                samples["start_to_announced_ms"].append(1e3 * (announced["t"] - t_spawn))
                samples["announced_to_admitted_ms"].append(1e3 * (admitted["t"] - announced["t"]))
                samples["admitted_to_first_step_ms"].append(1e3 * (first["t"] - admitted["t"]))
                samples["start_to_first_step_ms"].append(1e3 * (first["t"] - t_spawn))
                iteration = max(e["iteration"] for e in steps.values())
                # 4. plain: the same fault, no joiner.
                (out / f"fault{fault}").touch()
                raised = tl.wait_for(0, 0, "raise", f"fault {fault}", k=fault)
                fault += 1
                steps = tl.steps_after(healthy + [joiner], raised["iteration"], f"cycle {cycle}: the plain restart")
                samples["plain_pause_ms"].append(1e3 * (max(steps[h]["t"] for h in healthy) - raised["t"]))
                iteration = max(e["iteration"] for e in steps.values())
                print(f"cycle {cycle + 1}/{cycles}: pause lose {samples['lose_pause_ms'][-1]:.0f} ms, admit "
                      f"{samples['admit_pause_ms'][-1]:.0f} ms, plain {samples['plain_pause_ms'][-1]:.0f} ms; joiner "
                      f"start->step {samples['start_to_first_step_ms'][-1]:.0f} ms", file=sys.stderr, flush=True)
            (out / "end").touch()
            for rp in [*job.ranks, *job.respawned]:
                if rp.popen.poll() is None:
                    rp.popen.wait(timeout_s)
        finally:
            (out / "end").touch()
    # Every process but the killed ones returned from the wrapped call (the last joiner among them).
    codes = {f"seat{rp.rank}": rp.popen.returncode for rp in [*job.ranks, *job.respawned]
             if rp.popen.returncode != -signal.SIGKILL}
    if sorted(codes) != [f"seat{s}" for s in range(WORLD_SIZE)] or any(codes.values()):
        raise RuntimeError(f"exit statuses of the processes not killed: {codes}, expected 0 for each seat")
    return {name: stats(values) for name, values in samples.items() if values}


LABELS = {
    "start_to_announced_ms": "joiner: process start -> announced",
    "announced_to_admitted_ms": "joiner: announced -> admitted",
    "admitted_to_first_step_ms": "joiner: admitted -> first step",
    "start_to_first_step_ms": "joiner: process start -> first step",
    "lose_pause_ms": "healthy ranks' pause: SIGKILL, rank lost",
    "admit_pause_ms": "healthy ranks' pause: exception, joiner admitted",
    "plain_pause_ms": "healthy ranks' pause: exception, no joiner",
}


def table(figures: dict[str, Any], labels: dict[str, str] = LABELS) -> str:
    """The figures named in `labels`, in its order: n, p50, p99, max."""
    rows = [("what", "n", "p50 ms", "p99 ms", "max ms")]
    for key, label in labels.items():
        s = figures.get(key)
        if s:
            rows.append((label, str(s["n"]), f"{s['p50']:.0f}", f"{s['p99']:.0f}", f"{s['max']:.0f}"))
    widths = [max(len(r[k]) for r in rows) for k in range(5)]
    return "\n".join("  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths,
                                                                                                   strict=True)))
                     for r in rows)


def measured(prefix: str, measure: Callable[[pathlib.Path], dict[str, Any]]) -> dict[str, Any]:
    """`measure` with a temporary folder for the job's files; where it fails, the end of every
    process's output goes to stderr first."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = pathlib.Path(tmp)
        try:
            return measure(out)
        except BaseException:
            for path in sorted(out.glob("output.*.txt")):
                print(f"--- {path.name}\n{path.read_text()[-3000:]}", file=sys.stderr)
            raise


def main(argv: list[str] | None = None) -> int:
    reaping.exit_on_sigterm()  # kill PID stops the job this started, as Ctrl-C does
    ap = argparse.ArgumentParser(prog="python benchmarks/join_latency.py", description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=10, help="kill, join, plain restart cycles (default 10)")
    ap.add_argument("--step-s", type=float, default=0.02, help="sleep per step (default 0.02)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="every wait (default 120)")
    ap.add_argument("--smoke", action="store_true", help="one cycle: checks that it works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.cycles = 1
    if args.cycles < 1:
        ap.error(f"--cycles={args.cycles}: expected >= 1")
    figures = measured("join_latency.", lambda out: run(args.cycles, out, args.timeout_s, args.step_s))
    print(table(figures))
    print(json.dumps({"benchmark": "join_latency", "cycles": args.cycles, "world_size": WORLD_SIZE,
                      "load_average": os.getloadavg()[0], **figures}, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
