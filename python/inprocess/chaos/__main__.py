"""``python -m inprocess.chaos``: check a job's events, run a chaos schedule, or simulate the control plane.

    python -m inprocess.chaos check EVENTS_DIR [--observations FILE] [--json]
    python -m inprocess.chaos run [--seed N] [--faults N] [--ranks N] [--spares N] [--nodes N] [--steps N]
                                  [--kinds K,K...] [--out DIR]
    python -m inprocess.chaos simulate [--schedules N] [--seed N] [--ranks N]

Exit status: 0 when no invariant was violated, 1 when one was, 2 on bad arguments or input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import invariants, report


def _check(args: argparse.Namespace) -> int:
    from ..timeline.reading import load

    try:
        loaded = load(args.directory)
    except (FileNotFoundError, ValueError) as e:
        print(f"inprocess.chaos check: {e}", file=sys.stderr)
        return 2
    observations = None
    if args.observations:
        with open(args.observations) as f:
            observations = invariants.Observations(**json.load(f))
    segments = [s for run in loaded.runs for s in run.segments.values()]
    findings = invariants.check(segments, observations)
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(report.as_json(findings, directory=args.directory) if args.json else report.table(findings))
    return 1 if invariants.violations(findings) else 0


def _run(args: argparse.Namespace) -> int:
    from .runner import main as run_main

    return run_main(args)


def _simulate(args: argparse.Namespace) -> int:
    from .simulator import main as simulate_main

    return simulate_main(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inprocess.chaos", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="check the invariants on a directory of a job's events")
    c.add_argument("directory", help="the job's events directory (Wrapper(events_dir=...), INPROCESS_EVENTS_DIR)")
    c.add_argument("--observations", help="a JSON file of what the events cannot tell (invariants.Observations)")
    c.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    c.set_defaults(func=_check)
    r = sub.add_parser("run", help="run a job under a seeded schedule of faults, and check it")
    r.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: drawn, and printed)")
    r.add_argument("--faults", type=int, default=12, help="faults in the schedule (default 12)")
    r.add_argument("--ranks", type=int, default=4, help="active ranks (default 4)")
    r.add_argument("--spares", type=int, default=1, help="spare ranks (default 1)")
    r.add_argument("--nodes", type=int, default=1, help="simulated nodes, each with a node agent (default 1)")
    r.add_argument("--out", default=None,
                   help="a new or empty folder for the job's events, logs and report (default: a temp dir)")
    r.add_argument("--steps", type=int, default=40, help="steps per iteration, 25 ms each (default 40)")
    r.add_argument("--timeout", type=float, default=None, help="the whole run's limit in seconds")
    r.add_argument("--kinds", default=None, help="only these fault kinds (comma-separated)")
    r.add_argument("--json", action="store_true", help="one JSON line of the report after the table")
    r.set_defaults(func=_run)
    s = sub.add_parser("simulate", help="the control plane under a seeded scheduler, crashes between store calls")
    s.add_argument("--schedules", type=int, default=1000, help="schedules to explore (default 1000)")
    s.add_argument("--seed", type=int, default=0, help="the first schedule's seed (default 0)")
    s.add_argument("--ranks", type=int, default=4, help="ranks per schedule (default 4)")
    s.add_argument("--json", action="store_true", help="one JSON line of the report after the table")
    s.set_defaults(func=_simulate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
