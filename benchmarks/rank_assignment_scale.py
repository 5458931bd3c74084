"""Leader-side cost of one rank-assignment decision at 16,384 ranks with 1,024 lost.

Every decision goes through :func:`inprocess.rank_assignment.run_assignment`,
as the restart leader runs it (copy of the previous table, termination of the
lost ranks, the assignment, ``Membership.validate``). Each row is the median
of ``--repeat`` runs (min and max alongside); the machine is shared, so
compare rows of one run, not runs::

    python benchmarks/rank_assignment_scale.py
    python benchmarks/rank_assignment_scale.py --n 4096 --lost 256 --repeat 31
    python benchmarks/rank_assignment_scale.py --markdown benchmarks/rank_assignment.md

Topology: nodes of 8 ranks, racks of 64 nodes (512 ranks), keys gathered as
the Wrapper gathers them (``local_keys`` on every rank, once).

* ``tree: node spares`` -- job (RESERVE) / rack (RESERVE|BACKFILL) / node
  (max_ranks=7, RESERVE): one spare per node; random lost ranks.
* ``tree: spare nodes`` -- job (max_ranks = N - lost, RESERVE) / rack / node
  (min_ranks=8): whole spare nodes; lost = whole nodes (lost // 8 of them).
* ``tree: backfill+filter`` -- no spares; rack BACKFILL and
  ``world_size_filter`` keeping a multiple of 8; random lost ranks.

``cold`` rows use a new Tree, which first builds its tree from the keys;
``restart`` rows reuse it, as the leader does from the second restart on
(the keys never change during a job). ``inferred`` is the engine's context
today (no previous table); ``exact`` also passes ``ctx.previous``.
The last line is one JSON object with every median.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from inprocess import Compose  # noqa: E402
from inprocess.control.membership import TERMINATED, Membership  # noqa: E402
from inprocess.rank_assignment import (  # noqa: E402
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignmentCtx,
    ShiftRanks,
    Topology,
    Tree,
    key_gathering_leaves,
    run_assignment,
)

PER_NODE = 8
PER_RACK = 512
RESERVE, BACKFILL = LayerFlag.RESERVE, LayerFlag.BACKFILL


def node_key(rank: int, world_size: int) -> str:
    return f"node{rank // PER_NODE}"


def rack_key(rank: int, world_size: int) -> str:
    return f"rack{rank // PER_RACK}"


def gather(ra: Any, n: int) -> Topology:
    owners = key_gathering_leaves(ra)
    return Topology(owners, [[o.local_keys(r, n) for r in range(n)] for o in owners])


def run_exact(ra: Any, previous: Membership, lost: set[int], iteration: int, topo: Topology) -> Membership:
    """run_assignment with the previous table in the context (the interface Tree is exact with)."""
    membership = previous.copy()
    membership.terminate(lost)
    ctx = RankAssignmentCtx(membership, set(lost), iteration, topo)
    ctx.previous = previous  # type: ignore[attr-defined]
    ctx = ra(ctx) or ctx
    newly = {r for r, m in enumerate(ctx.membership.mode) if m == TERMINATED and previous.mode[r] != TERMINATED}
    ctx.membership.validate(previous, newly)
    return ctx.membership


def measure(fn: Callable[[], Membership], repeat: int) -> tuple[list[float], Membership]:
    times = []
    out = fn()  # warm-up, not counted
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter_ns()
        out = fn()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return times, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384, help="initial world size (a multiple of 512)")
    ap.add_argument("--lost", type=int, default=1024, help="ranks lost in the measured restart (multiple of 8)")
    ap.add_argument("--repeat", type=int, default=21, help="measured runs per row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", help="also write the table, command and machine to this Markdown file")
    args = ap.parse_args()
    n, n_lost = args.n, args.lost
    if n % PER_RACK or n_lost % PER_NODE or not 0 < n_lost < n:
        ap.error(f"--n={n} must be a multiple of {PER_RACK} and --lost={n_lost} a multiple of {PER_NODE} below it")
    rng = random.Random(args.seed)
    lost_random = set(rng.sample(range(n), n_lost))
    lost_nodes = set()
    for node in rng.sample(range(n // PER_NODE - n_lost // PER_NODE), n_lost // PER_NODE):
        lost_nodes.update(range(node * PER_NODE, (node + 1) * PER_NODE))  # among the running nodes
    everyone = Membership.all_active(n)

    def node_spares() -> Tree:
        return Tree([
            Layer(key_or_fn="job", flag=RESERVE),
            Layer(key_or_fn=rack_key, flag=RESERVE | BACKFILL),
            Layer(max_ranks=PER_NODE - 1, key_or_fn=node_key, flag=RESERVE),
        ])

    def spare_nodes() -> Tree:
        return Tree([
            Layer(max_ranks=n - n_lost, key_or_fn="job", flag=RESERVE),
            Layer(key_or_fn=rack_key, flag=RESERVE),
            Layer(min_ranks=PER_NODE, key_or_fn=node_key),
        ])

    def backfill_filter() -> Tree:
        return Tree(
            [Layer(key_or_fn="job"), Layer(key_or_fn=rack_key, flag=BACKFILL), Layer(key_or_fn=node_key)],
            world_size_filter=lambda a: a - a % 8,
        )

    rows: list[tuple[str, list[float], Membership]] = []

    def row(name: str, fn: Callable[[], Membership]) -> None:
        times, out = measure(fn, args.repeat)
        rows.append((name, times, out))
        print(f"  {name}: {statistics.median(times):.2f} ms", file=sys.stderr, flush=True)

    # Floor: what run_assignment costs around any assignment (copy, terminate, validate).
    def floor() -> Membership:
        m = everyone.copy()
        m.validate(everyone, ())
        return m

    row("floor: copy + validate", floor)

    for label, make, lost in (
        ("node spares", node_spares, lost_random),
        ("spare nodes", spare_nodes, lost_nodes),
        ("backfill+filter", backfill_filter, lost_random),
    ):
        keys_tree = make()
        topo_keys = gather(keys_tree, n)
        keys = topo_keys.keys(keys_tree)

        def cold_start(make=make, keys=keys) -> Membership:
            t = make()
            return run_assignment(t, everyone, set(), 0, Topology([t], [keys]))[0]

        row(f"tree: {label}, iteration 0, cold", cold_start)
        tree = make()
        topo = Topology([tree], [keys])
        start = run_assignment(tree, everyone, set(), 0, topo)[0]
        row(f"tree: {label}, iteration 0", lambda tree=tree, topo=topo: run_assignment(tree, everyone, set(), 0, topo)[0])

        def cold_restart(make=make, keys=keys, start=start, lost=lost) -> Membership:
            t = make()
            return run_assignment(t, start, lost, 1, Topology([t], [keys]))[0]

        row(f"tree: {label}, restart, cold", cold_restart)
        row(f"tree: {label}, restart, inferred",
            lambda tree=tree, topo=topo, start=start, lost=lost: run_assignment(tree, start, lost, 1, topo)[0])
        row(f"tree: {label}, restart, exact",
            lambda tree=tree, topo=topo, start=start, lost=lost: run_exact(tree, start, lost, 1, topo))

    filt = FilterCountGroupedByKey(node_key, lambda c: c == PER_NODE)
    simple = [
        ("ShiftRanks", ShiftRanks()),
        ("FillGaps", FillGaps()),
        ("ActivateAllRanks+ShiftRanks", Compose(ActivateAllRanks(), ShiftRanks())),
        ("MaxActiveWorldSize+ShiftRanks", Compose(MaxActiveWorldSize(n - 2 * n_lost), ShiftRanks())),
        ("ActiveWorldSizeDivisibleBy(8)+ShiftRanks", Compose(ActiveWorldSizeDivisibleBy(8), ShiftRanks())),
        ("ShiftRanks+FilterCountGroupedByKey(node)", Compose(ShiftRanks(), filt)),
    ]
    for name, ra in simple:
        topo = gather(ra, n)
        row(f"simple: {name}", lambda ra=ra, topo=topo: run_assignment(ra, everyone, lost_random, 1, topo)[0])

    header = "| decision | median ms | min ms | max ms | active after | world after |"
    lines = [header, "|---|---:|---:|---:|---:|---:|"]
    for name, times, out in rows:
        lines.append(
            f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | "
            f"{out.active_world_size} | {out.world_size} |"
        )
    table = "\n".join(lines)
    print(table)
    worst_tree = max(statistics.median(t) for name, t, _ in rows if name.startswith("tree:"))
    result = {
        "bench": "rank_assignment_scale",
        "n": n,
        "lost": n_lost,
        "repeat": args.repeat,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "median_ms": {name: round(statistics.median(t), 3) for name, t, _ in rows},
        "worst_tree_median_ms": round(worst_tree, 3),
        "tree_under_100ms": worst_tree < 100.0,
    }
    print(json.dumps(result))
    if args.markdown:
        command = "python benchmarks/rank_assignment_scale.py " + " ".join(sys.argv[1:])
        with open(args.markdown, "w") as f:
            f.write(
                f"# Rank assignment at scale\n\n"
                f"One leader decision (`run_assignment`: copy, terminate, assign, validate) for "
                f"{n:,} ranks with {n_lost:,} lost, median of {args.repeat} runs. What each row means: "
                f"the docstring of `benchmarks/rank_assignment_scale.py`.\n\n"
                f"Command: `{command.strip()}`  \n"
                f"Machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, {platform.machine()}; "
                f"shared and noisy, so compare rows of one run.\n\n"
                f"{table}\n\n"
                f"Slowest Tree row: {worst_tree:.1f} ms (target: under 100 ms).\n"
            )


if __name__ == "__main__":
    main()
