"""The simulator's command line: ``python benchmarks/control_plane_sim.py [options]``
(or ``python -m benchmarks.control_plane [options]`` from the repository root).

Prints progress on stderr as it goes, then the tables, the verdicts and one
JSON line on stdout. Writes files only where told (``--out DIR``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from .config import SimConfig
from .harness import Session
from .report import STEADY_COLUMNS, join_table, join_verdicts, markdown_block, plot, table, verdicts, write_markdown

DEFAULT_N = [256, 1024, 4096, 16384]
SMOKE: dict[str, Any] = {"n": [64], "procs": 2, "groups": 2, "restarts": 1, "heartbeat_rounds": 1, "settle_s": 0.1,
         "steady_s": 0.2, "timeout_s": 60.0}
BENCH_EXTRA = "pip install inprocess[bench]"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    ap = argparse.ArgumentParser(
        prog="python benchmarks/control_plane_sim.py",
        description="Restart control plane: restarts of N simulated ranks against one TCPStore, "
                    "with node agents (node mode) and without (direct mode).",
        epilog="Examples:\n"
               "  python benchmarks/control_plane_sim.py                 # N = 256 1024 4096 16384, both modes\n"
               "  python benchmarks/control_plane_sim.py --smoke         # a few seconds: N = 64, one restart\n"
               "  python benchmarks/control_plane_sim.py --n 16384 --node-only --out results/\n"
               "  python benchmarks/control_plane_sim.py --plot-from results/control_plane.json --out results/\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--n", type=int, nargs="+", default=None, help=f"simulated world sizes (default {DEFAULT_N})")
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds: N = 64, one restart, small windows (other options still apply)")
    ap.add_argument("--procs", type=int, default=None, help=f"client processes (default {d.procs})")
    ap.add_argument("--groups", type=int, default=None, help=f"groups of ranks per client process (default {d.groups})")
    ap.add_argument("--restarts", type=int, default=None,
                    help=f"restarts per N, medians are over them (default {d.restarts})")
    ap.add_argument("--kind", choices=["killed", "exception"], default=d.kind)
    ap.add_argument("--decode", choices=["shared", "every-rank"], default=d.decode)
    ap.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node,
                    help="ranks per node agent (node mode); 0: direct mode only")
    ap.add_argument("--relay", choices=["native", "python"], default=d.relay,
                    help="the node agents' relay: native (NativeNodeRelay, what an agent runs; default) or python "
                         "(NodeRelay, for comparison)")
    ap.add_argument("--direct", action="store_true", help="direct mode only (same as --ranks-per-node 0)")
    ap.add_argument("--node-only", action="store_true", help="node mode only: skip the direct mode's comparison")
    ap.add_argument("--steady-s", type=float, default=None,
                    help=f"idle window measured before each fault (default {d.steady_s})")
    ap.add_argument("--heartbeat-rounds", type=int, default=None,
                    help=f"rounds of monitor heartbeats measured per N, 0: none (default {d.heartbeat_rounds})")
    ap.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                    help="heartbeat interval the steady-state figures are given for")
    ap.add_argument("--joiners", type=int, default=d.joiners,
                    help="joins: restarts go in threes, K ranks lost, K joiners admitted into their seats, a plain "
                         "restart; before that job, one of the same N without joiners (the baseline); figures per "
                         "kind of restart (default 0: no joiners; with joiners, --restarts counts all three kinds)")
    ap.add_argument("--joiner-layout", choices=["nodes", "spread"], default=d.joiner_layout,
                    help="--joiners: the lost ranks are whole nodes of 8 (default) or single ranks far apart")
    ap.add_argument("--timeout-s", type=float, default=None, help=f"every wait (default {d.timeout_s})")
    ap.add_argument("--out", metavar="DIR",
                    help="write control_plane.json, control_plane.md (its results block) and control_plane.png "
                         "(with matplotlib) into DIR; without it nothing is written")
    ap.add_argument("--plot-from", metavar="JSON",
                    help="run nothing: write the outputs (--out) from an earlier run's JSON line or file")
    return ap


def _config(args: argparse.Namespace, ap: argparse.ArgumentParser) -> SimConfig:
    base = SMOKE if args.smoke else {}
    chosen = {name: getattr(args, name) for name in ("procs", "groups", "restarts", "steady_s", "heartbeat_rounds",
                                                      "timeout_s") if getattr(args, name) is not None}
    settings = {k: v for k, v in base.items() if k != "n"}
    settings.update(chosen)
    if args.ranks_per_node < 0:
        ap.error(f"--ranks-per-node={args.ranks_per_node}: expected >= 0")
    try:
        return SimConfig(kind=args.kind, decode=args.decode, heartbeat_interval_s=args.heartbeat_interval_s,
                         joiners=args.joiners, joiner_layout=args.joiner_layout, relay=args.relay,
                         ranks_per_node=0 if args.direct else args.ranks_per_node, **settings)
    except ValueError as e:
        ap.error(str(e))


def _load_run(path: str) -> dict[str, Any]:
    """The JSON of a run: a control_plane.json, or a saved stdout holding its JSON line."""
    with open(path) as f:
        text = f.read()
    for candidate in [text, *(line for line in text.splitlines() if line.startswith("{"))]:
        try:
            run = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(run, dict) and run.get("benchmark") == "control_plane":
            return run
    raise SystemExit(f"--plot-from {path}: no control-plane run in it (a JSON object with "
                     f"\"benchmark\": \"control_plane\")")


def write_outputs(out: str, run: dict[str, Any], command: str) -> None:
    """control_plane.json, control_plane.md and (with matplotlib) control_plane.png in ``out``."""
    os.makedirs(out, exist_ok=True)
    cfg = SimConfig(**run["config"])
    results = run["results"]
    json_path = os.path.join(out, "control_plane.json")
    with open(json_path, "w") as f:
        json.dump(run, f, indent=1)
        f.write("\n")
    png = os.path.join(out, "control_plane.png")
    drawn = plot(results, png, cfg)
    md = os.path.join(out, "control_plane.md")
    _, lines = verdicts(results)
    write_markdown(md, markdown_block(results, cfg, command, lines, "control_plane.png" if drawn else None))
    written = [json_path, md] + ([png] if drawn else [])
    print(f"wrote {', '.join(written)}", file=sys.stderr)
    if not drawn:
        print(f"skipped {png}: matplotlib is not installed ({BENCH_EXTRA} to draw it)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    command = "python benchmarks/control_plane_sim.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.plot_from:
        if not args.out:
            ap.error("--plot-from writes files: give --out DIR")
        write_outputs(args.out, _load_run(args.plot_from), command.strip())
        return 0
    cfg = _config(args, ap)
    sizes = args.n or (SMOKE["n"] if args.smoke else DEFAULT_N)
    if args.node_only and cfg.ranks_per_node == 0:
        ap.error("--node-only needs node mode (--ranks-per-node > 0, no --direct)")
    for n in sizes:
        try:
            cfg.check_world_size(n)
        except ValueError as e:
            ap.error(f"--n: {e}")
    # Node mode first, then (unless --node-only) direct mode, for each N in turn:
    # both modes of one N run a few seconds apart, under the same load.
    modes = [cfg.ranks_per_node] if cfg.ranks_per_node == 0 or args.node_only else [cfg.ranks_per_node, 0]
    results = []
    t = time.monotonic()
    with Session(cfg, _progress) as session:
        _progress(f"session: server + {cfg.procs} client processes, {session.connections} connections "
                  f"({time.monotonic() - t:.0f}s)")
        for n in sizes:
            for rpn in modes:
                # --joiners: first the same N without joiners, as many restarts as the job with joiners
                # admits in (its baseline, in the same session and minutes).
                jobs = [cfg] if not cfg.joiners else [
                    dataclasses.replace(cfg, joiners=0, restarts=max(1, cfg.restarts // 3)), cfg]
                for job_cfg in jobs:
                    session.cfg = job_cfg
                    t = time.monotonic()
                    r = session.simulate(n, rpn)
                    r["run_s"] = time.monotonic() - t
                    r["job_joiners"] = job_cfg.joiners
                    results.append(r)
                    _progress(f"N={n} {r['mode']}, {job_cfg.joiners} joiners: median {r['median_ms']:.1f} ms, "
                              f"max {r['max_ms']:.1f} ms over {job_cfg.restarts} restarts ({r['run_s']:.0f}s)")
                session.cfg = cfg
    results.sort(key=lambda r: (r["mode"] != "node", r["n"]))  # tables: node mode first
    print(table(results))
    print(table(results, columns=STEADY_COLUMNS))
    scaling, lines = verdicts(results)
    for line in lines:
        print(line)
    if cfg.joiners:
        print(join_table(results))
        for line in join_verdicts(results):
            print(line)
    summary = [{k: v for k, v in r.items() if k != "per_restart"} for r in results]
    run = {"benchmark": "control_plane", "config": dataclasses.asdict(cfg), "results": summary, "scaling": scaling}
    print(json.dumps(run, separators=(",", ":")), flush=True)
    if args.out:
        write_outputs(args.out, run, command.strip())
    else:
        print(f"nothing written (--out DIR writes the JSON, the markdown block and, with matplotlib "
              f"({BENCH_EXTRA}), the PNG)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
