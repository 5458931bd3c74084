"""The healthy ranks' pause per grow, next to a fault restart's, and a joiner's start to its first step.

A *grow* is a restart the job makes on purpose, at a safe point, to take
waiting joiners in (``Wrapper(grow=GrowPolicy(...))``,
``inprocess/engine/grow.py``): no fault. Real processes on 127.0.0.1
(``inprocess.launch.LocalJob``, gloo, the job's own TCPStore),
``benchmarks/join_latency_worker.py`` as every rank with ``GROW_CHECK_EVERY``:
a 3-seat job, every rank active, each step one gloo ``all_reduce``, a sleep of
``--step-s``, then ``call_wrapper.safe_point()``, under
``GrowPolicy(min_waiting=1, min_interval_s=0, check_every=--check-every)``.
Per cycle:

1. **lose**: the driver SIGKILLs seat 2's process; the others restart
   without it (world 2; no spare);
2. **grow**: the driver starts seat 2's replacement (``LocalJob.respawn``:
   ``INPROCESS_JOIN=1``), which announces itself and waits; nobody else does
   anything: the grow policy makes the healthy ranks stop at a safe point and
   restart, and the restart's leader admits the joiner (world 3 again);
3. **plain**: once every rank stepped, seat 0 raises (the driver asks it
   through a file): a restart of the same 3 ranks, a fault, no joiner.

The pause of the healthy ranks (seats 0 and 1) is, for each restart, from
the job's last step before it (the first of the two ranks to finish its last
all_reduce) to its first step after (the last of them to finish its first
all_reduce of the next iteration), with ``time.monotonic()`` stamps that every
process of this machine shares. It thus includes one ``--step-s`` sleep, as a
step without restart does (the normal step interval is printed with it).
Every restart is checked against the library's events
(``INPROCESS_EVENTS_DIR``): the grow's decision names only causes of kind
``grow`` and the joiner as joined; the plain one's names rank 0's
``exception`` and nobody joined; no restart comes between them. The events
also split each pause: last step -> restart requested (the grow's record:
the last rank at the grow point; the fault's: the raise) -> every healthy
rank detected it -> every one held the decision -> first step.

The joiner's figures: its process start (the driver's ``Popen``) to its
announcement (the library's log line), to its admission, to its first step.

``python benchmarks/grow_pause.py --grows 50``. Prints a table, then one JSON
line. INPROCESS_RESTART_STORM=off: the restarts come on purpose, one after
another (README, "Restart storms"); grows are not counted by the brake anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import time
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path
from join_latency import Timeline, measured, stats, table

HERE = pathlib.Path(__file__).resolve().parent
WORLD_SIZE = 3
JOINER_SEAT = 2
HEALTHY = [(0, 0), (1, 0)]


def library_events(out: pathlib.Path, seat: int) -> list[dict[str, Any]]:
    """The library's events of a seat (every life of it appends to the same file)."""
    path = out / "events" / f"rank{seat}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def decision_of(out: pathlib.Path, seat: int, iteration: int) -> dict[str, Any]:
    for e in library_events(out, seat):
        if e["kind"] == "decision" and e["iteration"] == iteration:
            return e
    raise RuntimeError(f"seat {seat}: no decision event for iteration {iteration}")


def detected_ns(out: pathlib.Path, seat: int, iteration: int) -> int:
    for e in library_events(out, seat):
        if e["kind"] == "restart_detected" and e["iteration"] == iteration:
            return int(e["t_ns"])
    raise RuntimeError(f"seat {seat}: no restart_detected event for iteration {iteration}")


class Restart:
    """One restart of the healthy ranks, from iteration ``before`` to the next, read from both timelines."""

    def __init__(self, tl: Timeline, out: pathlib.Path, before: int, firsts: dict[tuple[int, int], Any]):
        self.before = before
        self.after = max(e["iteration"] for e in firsts.values())
        if self.after != before + 1:
            raise RuntimeError(f"iterations {before} -> {self.after}: expected one restart, not {self.after - before}")
        lasts = [tl.wait_for(seat, life, "last_step", f"the end of iteration {before}", iteration=before)
                 for seat, life in HEALTHY]
        self.t_last = min(e["t"] for e in lasts)
        self.t_first = max(firsts[h]["t"] for h in HEALTHY)
        # The iteration's normal step, where it made more than one (all_reduce + sleep + safe point).
        self.step_interval_s = min(((e["t"] - e["t_first"]) / (e["steps"] - 1) for e in lasts if e["steps"] > 1),
                                   default=None)
        self.decisions = [decision_of(out, seat, self.after) for seat, _ in HEALTHY]
        self.t_detected = max(detected_ns(out, seat, before) for seat, _ in HEALTHY) / 1e9
        self.t_decided = max(e["t_ns"] for e in self.decisions) / 1e9
        self.faults = self.decisions[0]["faults"]
        self.t_requested = min((f["t_ns"] for f in self.faults if f["t_ns"]), default=0) / 1e9

    @property
    def pause_ms(self) -> float:
        return 1e3 * (self.t_first - self.t_last)

    def split_ms(self) -> dict[str, float]:
        return {"last_step_to_requested_ms": 1e3 * (self.t_requested - self.t_last),
                "requested_to_detected_ms": 1e3 * (self.t_detected - self.t_requested),
                "detected_to_decided_ms": 1e3 * (self.t_decided - self.t_detected),
                "decided_to_first_step_ms": 1e3 * (self.t_first - self.t_decided)}

    def check(self, what: str, kinds: set[str], joined: list[int]) -> None:
        for d in self.decisions:
            got = {f["kind"] for f in d["faults"]}
            if got != kinds or sorted(d.get("joined", [])) != joined:
                raise RuntimeError(f"{what}: iteration {self.after}'s decision has causes {sorted(got)} and joined "
                                   f"{d.get('joined')}, expected {sorted(kinds)} and {joined}: {d}")


def run(cycles: int, out: pathlib.Path, timeout_s: float, step_s: float, check_every: int) -> dict[str, Any]:
    from inprocess.launch import LocalJob

    env = {"OUT": str(out), "STEP_S": str(step_s), "GROW_CHECK_EVERY": str(check_every),
           "INPROCESS_EVENTS_DIR": str(out / "events"), "INPROCESS_RESTART_STORM": "off"}
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    tl = Timeline(out, timeout_s)
    with LocalJob([str(HERE / "join_latency_worker.py")], WORLD_SIZE, env=env, capture=False) as job:
        try:
            joiner = (JOINER_SEAT, 0)
            popen = job.ranks[JOINER_SEAT].popen
            steps = tl.steps_after(HEALTHY + [joiner], -1, "the job's start")
            iteration = max(e["iteration"] for e in steps.values())
            for cycle in range(cycles):
                # 1. lose: seat 2's process is killed; the job shrinks to 2.
                os.kill(popen.pid, signal.SIGKILL)
                popen.wait(timeout_s)
                lose = Restart(tl, out, iteration, tl.steps_after(HEALTHY, iteration, f"cycle {cycle}: after the kill"))
                if any(d["active_world_size"] != WORLD_SIZE - 1 for d in lose.decisions):
                    raise RuntimeError(f"cycle {cycle}: after the kill, {lose.decisions[0]}")
                add("lose_pause_ms", lose.pause_ms)
                iteration = lose.after
                # 2. grow: its replacement announces itself; the grow policy takes it in, nobody asks.
                life = cycle + 1
                t_spawn = time.monotonic()
                popen = job.respawn(JOINER_SEAT, life).popen
                joiner = (JOINER_SEAT, life)
                announced = tl.wait_for(*joiner, "announced", "announcement")
                steps = tl.steps_after(HEALTHY + [joiner], iteration, f"cycle {cycle}: the grow")
                grow = Restart(tl, out, iteration, steps)
                grow.check(f"cycle {cycle}: the grow", {"grow"}, [JOINER_SEAT])
                admitted = tl.wait_for(*joiner, "admitted", "admission")
                first = steps[joiner]
                if first["active_world_size"] != WORLD_SIZE:
                    raise RuntimeError(f"cycle {cycle}: the joiner stepped in a world of {first['active_world_size']}")
                add("grow_pause_ms", grow.pause_ms)
                for name, value in grow.split_ms().items():
                    add(f"grow_{name}", value)
                if grow.step_interval_s is not None:
                    add("step_interval_ms", 1e3 * grow.step_interval_s)
                add("start_to_announced_ms", 1e3 * (announced["t"] - t_spawn))
                add("announced_to_admitted_ms", 1e3 * (admitted["t"] - announced["t"]))
                add("admitted_to_first_step_ms", 1e3 * (first["t"] - admitted["t"]))
                add("start_to_first_step_ms", 1e3 * (first["t"] - t_spawn))
                iteration = grow.after
                # 3. plain: seat 0 raises; the same 3 ranks restart, no joiner.
                (out / f"fault{cycle}").touch()
                steps = tl.steps_after(HEALTHY + [joiner], iteration, f"cycle {cycle}: the plain restart")
                plain = Restart(tl, out, iteration, steps)
                plain.check(f"cycle {cycle}: the plain restart", {"exception"}, [])
                add("plain_pause_ms", plain.pause_ms)
                for name, value in plain.split_ms().items():
                    add(f"plain_{name}", value)
                iteration = plain.after
                print(f"cycle {cycle + 1}/{cycles}: pause lose {lose.pause_ms:.0f} ms, grow {grow.pause_ms:.0f} ms, "
                      f"plain {plain.pause_ms:.0f} ms; joiner start->step {samples['start_to_first_step_ms'][-1]:.0f} "
                      f"ms", file=sys.stderr, flush=True)
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
    return {name: stats(values) for name, values in samples.items()}


LABELS = {
    "start_to_announced_ms": "joiner: process start -> announced",
    "announced_to_admitted_ms": "joiner: announced -> admitted (by the grow)",
    "admitted_to_first_step_ms": "joiner: admitted -> first step",
    "start_to_first_step_ms": "joiner: process start -> first step",
    "step_interval_ms": "a step without restart (all_reduce + sleep)",
    "lose_pause_ms": "healthy ranks' pause: SIGKILL, rank lost",
    "grow_pause_ms": "healthy ranks' pause: GROW, joiner admitted",
    "grow_last_step_to_requested_ms": "  grow: last step -> requested (at the grow point)",
    "grow_requested_to_detected_ms": "  grow: requested -> every rank detected it",
    "grow_detected_to_decided_ms": "  grow: detected -> decision held",
    "grow_decided_to_first_step_ms": "  grow: decision -> first step",
    "plain_pause_ms": "healthy ranks' pause: exception, no joiner",
    "plain_last_step_to_requested_ms": "  plain: last step -> requested (the raise)",
    "plain_requested_to_detected_ms": "  plain: requested -> every rank detected it",
    "plain_detected_to_decided_ms": "  plain: detected -> decision held",
    "plain_decided_to_first_step_ms": "  plain: decision -> first step",
}


def main(argv: list[str] | None = None) -> int:
    reaping.exit_on_sigterm()  # kill PID stops the job this started, as Ctrl-C does
    ap = argparse.ArgumentParser(prog="python benchmarks/grow_pause.py", description=__doc__.split("\n")[0])
    ap.add_argument("--grows", type=int, default=10, help="kill, grow, plain restart cycles (default 10)")
    ap.add_argument("--step-s", type=float, default=0.02, help="sleep per step (default 0.02)")
    ap.add_argument("--check-every", type=int, default=5, help="GrowPolicy(check_every=...) (default 5)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="every wait (default 120)")
    ap.add_argument("--smoke", action="store_true", help="one cycle: checks that it works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.grows = 1
    if args.grows < 1:
        ap.error(f"--grows={args.grows}: expected >= 1")
    if args.check_every < 1:
        ap.error(f"--check-every={args.check_every}: expected >= 1")
    figures = measured("grow_pause.",
                       lambda out: run(args.grows, out, args.timeout_s, args.step_s, args.check_every))
    print(table(figures, LABELS))
    print(json.dumps({"benchmark": "grow_pause", "grows": args.grows, "world_size": WORLD_SIZE,
                      "step_s": args.step_s, "check_every": args.check_every,
                      "load_average": os.getloadavg()[0], **figures}, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
