"""Runs a job under a seeded chaos schedule and checks its invariants: ``python -m inprocess.chaos run``.

The job is :mod:`inprocess.chaos.worker` under :mod:`inprocess.chaos.launcher` (``inprocess.launch``'s
supervisor: a process that dies is replaced, and the new one joins the running job), with the
schedule's toolkit faults in ``INPROCESS_FAULTS``. While it runs, the runner stops the store host at
the scheduled restarts (a slow store) and checks the invariants on the events written so far, every
few seconds; at the end it checks them all, with what it observed outside the events (processes left,
shared memory, descriptors, the store's keys), and prints the report: the seed, the command that
replays it, the faults by kind and place, the restart times per kind (p50, p99, max), and what each
invariant checked. A seed replays the same schedule; how the processes interleave is the machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

from ..timeline.reading import load
from . import invariants, report, stats
from .schedule import Schedule, draw

CHECK_EVERY_S = 10.0


def _of_run(pid: str, marker: bytes) -> str | None:
    """The comm of a live process whose environment holds ``marker``; None for any other (or a zombie).
    Every process of a run (ranks in sessions of their own, monitors, node agents, the store host
    forked from rank 0) inherits the run's INPROCESS_EVENTS_DIR."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rfind(")") + 2:].split()[0] == "Z" or marker not in pathlib.Path(f"/proc/{pid}/environ")\
                .read_bytes().split(b"\0"):
            return None
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _processes_of_run(events: pathlib.Path) -> dict[int, str]:
    """pid -> comm of every live process of the run whose events go to ``events``."""
    marker = f"INPROCESS_EVENTS_DIR={events}".encode()
    found = {pid: _of_run(pid, marker) for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != os.getpid()}
    return {int(pid): comm for pid, comm in found.items() if comm is not None}


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class Run:
    """One chaos run: its schedule, directories, the launcher's process."""

    def __init__(self, schedule: Schedule, out: pathlib.Path, timeout_s: float):
        self.schedule = schedule
        self.out = out
        self.events = out / "events"
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.stops_done = 0
        self.partial_checks = 0
        self.partial_violations: list[str] = []

    def command(self) -> list[str]:
        s = self.schedule
        cmd = [sys.executable, "-m", "inprocess.chaos.launcher", "--nproc", str(s.world_size), "--respawn-delay",
               "0.2", "--timeout", str(int(self.timeout_s)), "--events", str(self.events)]
        if s.nodes > 1:
            cmd += ["--ranks-per-node", str(-(-s.world_size // s.nodes))]
        worker = pathlib.Path(__file__).with_name("worker.py")  # a script: importing it would run it
        return cmd + [str(worker), str(self.out / "schedule.json"), str(self.out)]

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.events.mkdir(exist_ok=True)
        (self.out / "schedule.json").write_text(self.schedule.to_json())
        env = {**os.environ, "INPROCESS_FAULTS": self.schedule.plan(), "INPROCESS_EVENTS_DIR": str(self.events)}
        log = open(self.out / "launch.log", "wb")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

    def watch(self) -> int:
        """Until the launcher exits: the store stops, and the invariants on the events so far."""
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s + 60
        next_check = time.monotonic() + CHECK_EVERY_S
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                for pid in _processes_of_run(self.events):  # the ranks run in sessions of their own
                    os.kill(pid, signal.SIGKILL)
                break
            self._stop_store_if_due()
            if time.monotonic() >= next_check:
                self._check_so_far()
                next_check = time.monotonic() + CHECK_EVERY_S
            time.sleep(0.2)
        return self.proc.wait()

    def _restarts_so_far(self) -> int:
        barriers = set()
        for path in self.events.glob("rank*.jsonl"):
            for line in path.read_bytes().splitlines():
                if b'"decision"' in line:
                    try:
                        barriers.add(json.loads(line)["iteration"])
                    except (ValueError, KeyError):
                        continue
        return max(barriers, default=0)

    def _stop_store_if_due(self) -> None:
        stops = self.schedule.store_stops
        if self.stops_done >= len(stops) or self._restarts_so_far() < stops[self.stops_done][0]:
            return
        assert self.proc is not None
        duration = stops[self.stops_done][1]
        self.stops_done += 1
        host = [pid for pid, comm in _processes_of_run(self.events).items() if comm == "inprocess-store"]
        for pid in host:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(duration)
        for pid in host:
            os.kill(pid, signal.SIGCONT)

    def _check_so_far(self) -> None:
        try:
            loaded = load(str(self.events))
        except (FileNotFoundError, ValueError):
            return
        segments = [s for run in loaded.runs for s in run.segments.values()]
        found = invariants.violations(invariants.check(segments, horizon_s=time.time()))
        self.partial_checks += 1
        self.partial_violations += [str(v) for v in found if str(v) not in self.partial_violations]

    def observations(self, shm_before: set[str]) -> invariants.Observations:
        assert self.proc is not None
        deadline = time.monotonic() + 20
        left = _processes_of_run(self.events)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _processes_of_run(self.events)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        o = invariants.Observations(leftover_processes=[f"pid {p}: {c}" for p, c in left.items()],
                                    leftover_shm=sorted(_shm() - shm_before))
        read_observations(self.out / "obs", o)
        return o


def read_observations(obs: pathlib.Path, o: invariants.Observations) -> None:
    """What the workers wrote to ``obs/`` (worker.observe), into ``o``: each process's descriptors per
    iteration, beyond one per peer (gloo's full mesh: a process whose world grew back from 2 to 8 ranks
    holds six more sockets from then on, which is no leak), and the store's keys."""
    for path in sorted(obs.glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        o.fds[path.stem] = [r["fds"] - r.get("world", 0) for r in records]
        o.store_keys += [(r["iteration"], r["keys"]) for r in records if "keys" in r]


def main(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    kinds = set(args.kinds.split(",")) if args.kinds else None
    schedule = draw(seed, args.faults, args.ranks, args.spares, args.nodes, steps=args.steps, kinds=kinds)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix=f"inprocess-chaos-{seed}-"))
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held:
        # An earlier run's events would be read with this one's as one job: violations that never happened.
        print(f"inprocess.chaos run: --out {out} is not empty ({', '.join(held)}): give a new or empty folder "
              f"(the invariants are checked on every event file in its events/)", file=sys.stderr)
        return 2
    timeout_s = args.timeout or max(120.0, (3.0 + 0.05 * args.steps) * args.faults)
    replay = (f"python -m inprocess.chaos run --seed {seed} --faults {args.faults} --ranks {args.ranks} "
              f"--spares {args.spares} --nodes {args.nodes} --steps {args.steps}"
              + (f" --kinds {args.kinds}" if args.kinds else ""))
    print(f"chaos: seed {seed}; replay: {replay}; output in {out}", flush=True)
    run = Run(schedule, out, timeout_s)
    shm_before = _shm()
    started = time.monotonic()
    run.start()
    status = run.watch()
    observations = run.observations(shm_before)
    loaded = load(str(run.events))
    segments = [s for r in loaded.runs for s in r.segments.values()]
    findings = invariants.check(segments, observations)
    figures = stats.summarize(schedule, segments)
    text = stats.render(schedule, figures, status, time.monotonic() - started, run.partial_checks)
    print(text + "\n" + report.table(findings))
    for v in run.partial_violations:
        print(f"  while running: {v}")
    completed = next(f.checked for f in findings if f.invariant == "same_final_iteration")
    line = report.as_json(findings, seed=seed, command=replay, launcher_status=status, figures=figures,
                          partial_checks=run.partial_checks, partial_violations=run.partial_violations,
                          store_stops=run.stops_done, completed_ranks=completed)
    (out / "report.json").write_text(line + "\n")
    print(f"{run.stops_done} store stops; {completed} ranks completed the job; launcher status {status}")
    if args.json:
        print(line)
    # The job must have completed on some rank. The launcher's own status is reported, not judged: a
    # replacement started in the job's last iteration finds no store once the job ended (its host
    # exited) and exits 1, and the launcher then calls the job failed.
    failed = bool(invariants.violations(findings)) or bool(run.partial_violations) or completed == 0
    return 1 if failed else 0
