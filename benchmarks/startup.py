"""What entering and leaving a wrapped call costs: inprocess against the bare
function and against nvidia_resiliency_ext, in one run.

    python benchmarks/startup.py [--samples 10] [--ranks 1,4] [--nvrx-python PATH]

Each sample launches fresh rank processes (benchmarks/startup_worker.py); the
ranks meet on a plain TCPStore first, then call at the same moment, so what is
measured is the library, not the launcher's skew. Reported per library and
world size, over the samples (the slowest rank of each sample):

* entry: from the call to the first line of the function (store, helper
  processes, the initial barrier);
* exit: from the function's return to the call's return;
* soft timeout (one rank): from the call to the RestartAbort of a job whose
  only rank stops making progress, soft_timeout 1 s, RetryController(max_iterations=1).

``--nvrx-python`` names an interpreter that has nvidia_resiliency_ext
installed (it must be able to import torch too); without it, the NVRx rows are
left out. Rows are printed as each finishes; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path
from inprocess.launch import free_port

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "startup_worker.py"


def run_once(python: str, library: str, world_size: int, scenario: str, timeout_s: float) -> list[dict[str, Any]]:
    """One job, tried again (up to 3 times) when another process took one of its ports meanwhile."""
    for attempt in range(3):
        try:
            return run_job(python, library, world_size, scenario, timeout_s)
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
            print(f"  ({library}, {world_size} ranks: a port was taken meanwhile; again)", file=sys.stderr)
    raise AssertionError("unreachable")


def run_job(python: str, library: str, world_size: int, scenario: str, timeout_s: float) -> list[dict[str, Any]]:
    """One job; every rank reaped on every path (each in its own process group)."""
    port = free_port()
    meeting_port = port + 1
    procs = []
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), STARTUP_MEETING_PORT=str(meeting_port),
                       STARTUP_LIBRARY=library, STARTUP_SCENARIO=scenario,
                       TORCH_CPP_LOG_LEVEL="ERROR")
            procs.append(subprocess.Popen([python, str(WORKER)], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            lines = [line for line in out.splitlines() if line.startswith("STARTUP ")]
            if not lines:
                raise RuntimeError(f"{library} ({world_size} ranks, {scenario}): a rank reported nothing "
                                   f"(exit {p.returncode}): {err[-2000:]}")
            results.append(json.loads(lines[-1][len("STARTUP "):]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "max": ordered[-1], "min": ordered[0], "n": len(ordered)}


def main(argv: list[str] | None = None) -> int:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--ranks", default="1,4", help="world sizes, comma separated")
    ap.add_argument("--nvrx-python", default=None, help="an interpreter with nvidia_resiliency_ext installed")
    ap.add_argument("--timeout", type=float, default=120.0, help="per job, seconds")
    ap.add_argument("--smoke", action="store_true", help="one sample of one rank, to check that it runs (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.samples = 1
        args.ranks = '1'
    if args.samples < 1:
        ap.error(f"--samples={args.samples}: expected >= 1")
    sizes = [int(s) for s in args.ranks.split(",") if s]  # --ranks "": the soft-timeout rows only
    libraries = [("bare", sys.executable, "bare"), ("inprocess", sys.executable, "inprocess")]
    if args.nvrx_python:
        libraries.append(("nvrx", args.nvrx_python, "nvidia_resiliency_ext.inprocess"))
    rows: dict[str, Any] = {}
    print(f"{'library':<10} {'ranks':>5} {'entry p50':>10} {'entry max':>10} {'exit p50':>9} {'exit max':>9}  (ms)")
    for world_size in sizes:
        samples: dict[str, dict[str, list[float]]] = {name: {"entry": [], "exit": []} for name, _, _ in libraries}
        for i in range(args.samples):
            for name, python, library in libraries:  # alternated: the machine's noise hits all alike
                print(f"{name}, {world_size} ranks: sample {i + 1}/{args.samples} ...", file=sys.stderr, flush=True)
                ranks = run_once(python, library, world_size, "return", args.timeout)
                samples[name]["entry"].append(max(r["entry_ms"] for r in ranks))
                samples[name]["exit"].append(max(r["exit_ms"] for r in ranks))
        for name, _, _ in libraries:
            entry, exit_ = summary(samples[name]["entry"]), summary(samples[name]["exit"])
            rows[f"{name}/{world_size}"] = {"entry_ms": entry, "exit_ms": exit_}
            print(f"{name:<10} {world_size:>5} {entry['p50']:>10.1f} {entry['max']:>10.1f} "
                  f"{exit_['p50']:>9.1f} {exit_['max']:>9.1f}", flush=True)
    print(f"\n{'library':<10} soft timeout (1 rank, soft_timeout=1 s): call -> RestartAbort, ms")
    for name, python, library in libraries[1:]:
        totals, other_endings = [], []
        for _ in range(max(1, args.samples // 2)):
            launched = time.monotonic()
            try:
                (rank,) = run_once(python, library, 1, "soft_timeout", args.timeout)
            except RuntimeError as e:
                # No answer from the rank: what ended it, and when (from the launch, imports included).
                other_endings.append(f"{str(e).split(': ')[1].split(')')[0]})"
                                     f" {time.monotonic() - launched:.1f} s after launch")
                continue
            if rank["outcome"] != "RestartAbort":
                other_endings.append(f"ended with {rank['outcome']}")
                continue
            totals.append(rank["total_ms"])
        if totals:
            rows[f"{name}/soft_timeout"] = summary(totals)
            s = rows[f"{name}/soft_timeout"]
            print(f"{name:<10} p50 {s['p50']:.0f}, max {s['max']:.0f} (n={s['n']})", flush=True)
        if other_endings:
            rows[f"{name}/soft_timeout_other_endings"] = other_endings
            print(f"{name:<10} without RestartAbort: {'; '.join(other_endings)}", flush=True)
    print(json.dumps({"benchmark": "startup", "samples": args.samples, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
