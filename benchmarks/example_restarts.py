"""Restart latency of the two ways to wrap a job: ``examples/minimal.py`` (its
``main()`` wrapped as it is: a restart reruns all of it) against
``examples/optimal.py`` (only the process group and DDP are rebuilt, the state
resumes from an in-memory checkpoint).

    python benchmarks/example_restarts.py [--faults 20] [--out results.json]
    python benchmarks/example_restarts.py --smoke          # 1 fault each, about 20 s

Each example runs once on 4 local ranks (gloo), unchanged: rank 2 raises an
``InjectedException`` (``INPROCESS_FAULTS``) ``--after`` seconds into each of
the first ``--faults`` iterations. **Latency** = from rank 2's fault (its
``fault`` event, CLOCK_MONOTONIC) to the end of the first optimizer step of the
next iteration on the last rank to get there (a global optimizer hook of torch,
``benchmarks/example_timing.py``): the restart and the user's own
re-initialisation. Prints progress, then p50/p99/max per example; writes
nothing unless ``--out``. Ctrl-C kills every rank it started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path
from inprocess.launch import LocalJob

# Faults injected back to back, each a restart to time: the storm brake (inprocess/engine/storm.py)
# would back off from the third of the same shape on, and this would time its back-off instead.
os.environ.setdefault("INPROCESS_RESTART_STORM", "off")

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
WORLD_SIZE = 4
FAULTY_RANK = 2


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with 20 samples p99 is the largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run_example(name: str, steps: int, faults: int, after_s: float, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"inprocess-{name}-") as tmp:
        events, timing = pathlib.Path(tmp, "events"), pathlib.Path(tmp, "timing")
        timing.mkdir()
        iterations = "|".join(str(i) for i in range(faults))
        env = {"INPROCESS_FAULTS": f"exception@rank={FAULTY_RANK},after={after_s}s,iteration={iterations}",
               "INPROCESS_EVENTS_DIR": str(events)}
        argv = [str(HERE / "example_timing.py"), str(timing), str(EXAMPLES / f"{name}.py"), "--steps", str(steps)]
        start = time.monotonic()
        print(f"{name}: 4 ranks, {faults} faults on rank {FAULTY_RANK} {after_s}s into each iteration ...", flush=True)
        with LocalJob(argv, WORLD_SIZE, env=env) as job:  # kills every rank on any exit, Ctrl-C included
            ranks = job.wait(timeout)
        failed = [r.rank for r in ranks if r.returncode != 0]
        if failed:
            raise RuntimeError(f"{name}: ranks {failed} failed:\n{job.outputs()[-5000:]}")
        fault_ns: dict[int, int] = {}
        for line in (events / f"rank{FAULTY_RANK}.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["kind"] == "fault" and event.get("type") == "InjectedException":
                fault_ns.setdefault(event["iteration"], event["t_ns"])
        first_step = [{int(k): v for k, v in json.loads((timing / f"steps{r}.json").read_text()).items()}
                      for r in range(WORLD_SIZE)]
        latencies_ms = []
        for iteration, t_fault in sorted(fault_ns.items()):
            resumed = [steps.get(iteration + 1) for steps in first_step]
            if all(t is not None for t in resumed):
                latencies_ms.append((max(t for t in resumed if t is not None) - t_fault) / 1e6)
        wall = time.monotonic() - start
        print(f"{name}: {len(latencies_ms)} restarts measured in {wall:.1f} s", flush=True)
        if len(latencies_ms) < faults:
            print(f"{name}: WARNING: {faults - len(latencies_ms)} faults not measured (the job ended first: "
                  f"raise --steps)", flush=True)
        return {"example": name, "faults": len(latencies_ms), "latencies_ms": latencies_ms,
                "p50_ms": percentile(latencies_ms, 50) if latencies_ms else None,
                "p99_ms": percentile(latencies_ms, 99) if latencies_ms else None,
                "max_ms": max(latencies_ms) if latencies_ms else None, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--after", type=float, default=1.0, help="seconds into each iteration the fault fires")
    parser.add_argument("--minimal-steps", type=int, default=400, help="more than one iteration can run in --after")
    parser.add_argument("--optimal-steps", type=int, default=2500,
                        help="more than --faults iterations of --after seconds can run")
    parser.add_argument("--smoke", action="store_true", help="1 fault each, small step counts: about 20 s")
    parser.add_argument("--out", type=pathlib.Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.faults, args.minimal_steps, args.optimal_steps = 1, 150, 150
    if args.faults < 1:
        parser.error(f"--faults={args.faults}: expected >= 1")
    timeout = 120 + args.faults * 10
    results = [run_example("minimal", args.minimal_steps, args.faults, args.after, timeout),
               run_example("optimal", args.optimal_steps, args.faults, args.after, timeout)]
    print(f"\n{'example':<8} {'n':>3} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for r in results:
        if r["faults"]:
            print(f"{r['example']:<8} {r['faults']:>3} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['max_ms']:>8.1f}")
        else:
            print(f"{r['example']:<8} {0:>3}        -        -        -")
    if args.out is not None:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=1) + "\n")
        print(f"written: {args.out}")
    return 0 if all(r["faults"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
