"""Restart latency of two source trees of the project, interleaved in one run (before and after a change).

    python benchmarks/restart_latency_ab.py A_TREE B_TREE [--rounds 5] [--faults 12] [--python PY]

Each tree is a checkout (``git worktree add /tmp/before <commit>``) whose ``python/inprocess``
holds a built ``_native`` module (copy the installed one in: ``cp .../site-packages/inprocess/_native*.so
/tmp/before/python/inprocess/``). Round after round, the tree's own ``benchmarks/restart_latency.py
--skip-torchrun`` runs with ``PYTHONPATH=<tree>/python``, A then B, so the machine's noise falls on
both alike. ``--python``: an interpreter with torch whose site-packages holds no editable install of
the project (an editable install's import hook would take precedence over ``PYTHONPATH``). Prints
p50/p90/p99/max per tree over every fault, each round's median, and one JSON line. ``--smoke``: this
checkout against itself, one round of two faults each, with the package this interpreter has installed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def run_once(tree: pathlib.Path, faults: int, python: str, installed: bool = False) -> list[float]:
    env = dict(os.environ, INPROCESS_RESTART_STORM="off")
    if not installed:
        env["PYTHONPATH"] = str(tree / "python")
    done = subprocess.run([python, "benchmarks/restart_latency.py", "--skip-torchrun", "--faults", str(faults)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{tree}: restart_latency.py exited {done.returncode}:\n{done.stderr[-2000:]}")
    return [float(v) for v in json.loads(lines[-1])["inprocess_s"]]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=pathlib.Path, nargs="?")
    ap.add_argument("b", type=pathlib.Path, nargs="?")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--faults", type=int, default=12)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--smoke", action="store_true", help="this checkout against itself, briefly")
    ns = ap.parse_args(argv)
    if ns.smoke:
        ns.a = ns.b = HERE.parent
        ns.rounds, ns.faults = 1, 2
    elif ns.a is None or ns.b is None:
        ap.error("two trees are needed: A_TREE B_TREE (or --smoke)")
    trees = {"A": ns.a.resolve(), "B": ns.b.resolve()}
    runs: dict[str, list[list[float]]] = {"A": [], "B": []}
    for _ in range(ns.rounds):
        for name, tree in trees.items():
            runs[name].append(run_once(tree, ns.faults, ns.python, installed=ns.smoke))
    summary = {}
    for name, rounds in runs.items():
        every = [v * 1e3 for values in rounds for v in values]
        summary[name] = {
            "tree": str(trees[name]), "faults": len(every), "p50_ms": statistics.median(every),
            "p90_ms": quantile(every, 0.9), "p99_ms": quantile(every, 0.99), "max_ms": max(every),
            "round_medians_ms": [round(statistics.median(values) * 1e3, 1) for values in rounds],
        }
        s = summary[name]
        print(f"{name} {s['tree']}: {s['faults']} faults, p50 {s['p50_ms']:.1f} ms, p90 {s['p90_ms']:.1f}, "
              f"p99 {s['p99_ms']:.1f}, max {s['max_ms']:.1f}; round medians {s['round_medians_ms']}")
    print(f"B/A p50 ratio {summary['B']['p50_ms'] / summary['A']['p50_ms']:.2f}")
    print(json.dumps({"benchmark": "restart_latency_ab", **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
