"""A restart storm with the brake and without it: restarts per second and log lines.

    python benchmarks/restart_storm.py [--mode raise|own_store] [--seconds 30] [--out results.json]
    python benchmarks/restart_storm.py --smoke          # 3 s of storm each, about a minute

The job is ``tests/workers/storm_worker.py`` on 4 local ranks. ``--mode
raise`` (the default): rank 1 raises at once in every iteration. ``--mode
own_store``: as in nvidia_resiliency_ext's advanced example, rank 0 hosts a
TCPStore of its own and every rank builds its gloo group on it; rank 0 is
SIGKILLed in iteration 0, and from then on every iteration fails at once on
every rank (the store died with rank 0). ``--seconds`` after rank 1 first
entered the function, the function stops failing and the job ends. The job
runs twice: with ``INPROCESS_RESTART_STORM=off`` (no brake, as before it
existed) and with the default limits. Logging as that example configures it
(the root logger at INFO). Restarts are counted from rank 1's events
(``INPROCESS_EVENTS_DIR``). Prints, for each run, the restarts, their rate, and
the job's output in lines and bytes (the library's lines, torch's, and the
launcher's), and how many of the lines the library wrote; writes nothing unless
``--out``. Ctrl-C kills every rank it started.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path
from inprocess.launch import LocalJob

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE.parent / "tests" / "workers" / "storm_worker.py"
WORLD_SIZE = 4


def run(mode: str, brake: str, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="inprocess-storm-") as tmp:
        events = pathlib.Path(tmp, "events")
        env = {"INPROCESS_TEST_OUT": tmp, "STORM_MODE": mode, "STORM_SECONDS": str(seconds),
               "INPROCESS_RESTART_STORM": brake, "INPROCESS_EVENTS_DIR": str(events)}
        print(f"INPROCESS_RESTART_STORM={brake or '(unset: the defaults)'}: 4 ranks, {mode}, "
              f"{seconds:g} s of storm ...", flush=True)
        ended = "finished"
        with LocalJob([str(WORKER)], WORLD_SIZE, env=env) as job:  # kills every rank on any exit
            try:
                job.wait(seconds + 120)
            except TimeoutError:
                ended = "killed after a hang"
        # Restarts: the decisions rank 1 read after the initial one (its events survive a kill).
        lines_of_events = (events / "rank1.jsonl").read_text().splitlines() if (events / "rank1.jsonl").exists() \
            else []
        restarts = sum(1 for line in lines_of_events if '"kind":"decision"' in line.replace(" ", "")) - 1
    output = job.outputs()
    lines = [line for line in output.splitlines() if line and not line.startswith("--- rank")]
    if any(rp.returncode not in (0, -9) for rp in job.ranks):
        ended += " (ranks ended " + ", ".join(str(rp.returncode) for rp in job.ranks) + ")"
    return {"mode": mode, "brake": brake or "default", "seconds": seconds, "ended": ended, "restarts": max(restarts, 0),
            "restarts_per_s": max(restarts, 0) / seconds, "lines": len(lines), "bytes": len(output.encode()),
            "library_lines": sum(" inprocess" in line for line in lines),
            "storm_warnings": sum("restart storm:" in line for line in lines)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("raise", "own_store"), default="raise",
                        help="raise: rank 1 raises at once; own_store: rank 0's own store dies with it")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the storm lasts in each run")
    parser.add_argument("--smoke", action="store_true", help="3 s of storm each: checks that it works")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args()
    seconds = 3.0 if args.smoke else args.seconds
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    results = [run(args.mode, "off", seconds), run(args.mode, "", seconds)]
    print(f"\n{'brake':<8} {'restarts':>9} {'per s':>7} {'lines':>7} {'bytes':>9} {'library lines':>14} "
          f"{'storm warnings':>15}  ended")
    for r in results:
        print(f"{r['brake']:<8} {r['restarts']:>9} {r['restarts_per_s']:>7.1f} {r['lines']:>7} {r['bytes']:>9} "
              f"{r['library_lines']:>14} {r['storm_warnings']:>15}  {r['ended']}")
    print(json.dumps({"benchmark": "restart_storm", "results": results}))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
