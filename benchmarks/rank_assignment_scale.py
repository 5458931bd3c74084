"""Leader-side cost of one rank-assignment decision at 16,384 ranks with 1,024 lost.

Every job-wide decision goes through :func:`inprocess.rank_assignment.run_job_wide`,
as the restart leader runs it (copy of the previous table, the assignment, the
consistency checks). ``per-rank`` rows add a pass-through per-rank hook to the
composition, so the leader runs it for every rank on the agreed inputs
(:func:`inprocess.rank_assignment.decision.run_per_rank`); ``verify`` is what
each rank then pays to check its own row. Each row is the median of
``--repeat`` runs (min and max alongside); the machine is shared, so compare
rows of one run, not runs::

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
(the keys never change during a job). ``simple`` and ``per-rank`` rows start
from the decision of iteration 0 and lose the same random ranks.
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
from collections.abc import Callable
from typing import Any

from inprocess import Compose, FrozenState
from inprocess.control.membership import ACTIVE, TERMINATED, Membership
from inprocess.control.protocol import Decision
from inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    ShiftRanks,
    Topology,
    Tree,
    initial_membership,
    key_gathering_leaves,
    run_job_wide,
)
from inprocess.rank_assignment.agreed import AgreedInputs
from inprocess.rank_assignment.consistency import check_membership
from inprocess.rank_assignment.decision import run_per_rank, verify_own_row

PER_NODE = 8
PER_RACK = 512
RESERVE, BACKFILL = LayerFlag.RESERVE, LayerFlag.BACKFILL


def node_key(state: FrozenState) -> str:
    return f"node{state.initial_rank // PER_NODE}"


def rack_key(state: FrozenState) -> str:
    return f"rack{state.initial_rank // PER_RACK}"


def gather(ra: Any, n: int) -> Topology:
    owners = key_gathering_leaves(ra)
    return Topology(owners, [[o.local_keys(FrozenState(rank=r, world_size=n)) for r in range(n)] for o in owners])


class PassThrough(RankAssignment):
    """A per-rank hook that changes nothing: it makes the Wrapper run the composition per rank."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        return ctx


def measure(fn: Callable[[], Membership], repeat: int) -> tuple[list[float], Membership]:
    times = []
    out = fn()  # warm-up, not counted
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter_ns()
        out = fn()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return times, out


class Bench:
    """The rows of one run: each a named decision, measured ``repeat`` times."""

    def __init__(self, n: int, n_lost: int, repeat: int, seed: int):
        self.n, self.n_lost, self.repeat = n, n_lost, repeat
        rng = random.Random(seed)
        self.lost_random = set(rng.sample(range(n), n_lost))
        self.lost_nodes: set[int] = set()
        for node in rng.sample(range(n // PER_NODE - n_lost // PER_NODE), n_lost // PER_NODE):
            self.lost_nodes.update(range(node * PER_NODE, (node + 1) * PER_NODE))  # among the running nodes
        self.everyone = initial_membership(n)
        self.rows: list[tuple[str, list[float], Membership]] = []

    def row(self, name: str, fn: Callable[[], Membership]) -> None:
        times, out = measure(fn, self.repeat)
        self.rows.append((name, times, out))
        print(f"  {name}: {statistics.median(times):.2f} ms", file=sys.stderr, flush=True)

    def floor(self) -> None:
        """What run_job_wide costs around any assignment (copy, consistency checks)."""
        all_active = Membership.all_active(self.n)

        def floor() -> Membership:
            m = all_active.copy()
            check_membership(m, m.active_world_size, all_active, set())
            return m

        self.row("floor: copy + check", floor)

    def trees(self) -> None:
        n, n_lost = self.n, self.n_lost

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

        for label, make, lost in (
            ("node spares", node_spares, self.lost_random),
            ("spare nodes", spare_nodes, self.lost_nodes),
            ("backfill+filter", backfill_filter, self.lost_random),
        ):
            self.tree(label, make, lost)

    def tree(self, label: str, make: Callable[[], Tree], lost: set[int]) -> None:
        keys_tree = make()
        keys = gather(keys_tree, self.n).keys(keys_tree)
        everyone = self.everyone

        def cold_start() -> Membership:
            t = make()
            return run_job_wide(t, everyone, set(), 0, Topology([t], [keys]))[0]

        tree = make()
        topo = Topology([tree], [keys])
        start = run_job_wide(tree, everyone, set(), 0, topo)[0]

        def cold_restart() -> Membership:
            t = make()
            return run_job_wide(t, start, lost, 1, Topology([t], [keys]))[0]

        self.row(f"tree: {label}, iteration 0, cold", cold_start)
        self.row(f"tree: {label}, iteration 0", lambda: run_job_wide(tree, everyone, set(), 0, topo)[0])
        self.row(f"tree: {label}, restart, cold", cold_restart)
        self.row(f"tree: {label}, restart", lambda: run_job_wide(tree, start, lost, 1, topo)[0])

    def simple(self, filt: FilterCountGroupedByKey) -> None:
        for name, ra in (
            ("ActivateAllRanks+ShiftRanks", Compose(ActivateAllRanks(), ShiftRanks())),
            ("ActivateAllRanks+FillGaps", Compose(ActivateAllRanks(), FillGaps())),
            ("MaxActiveWorldSize+ShiftRanks", Compose(MaxActiveWorldSize(self.n - 2 * self.n_lost), ShiftRanks())),
            ("ActiveWorldSizeDivisibleBy(8)+ShiftRanks", Compose(ActiveWorldSizeDivisibleBy(8), ShiftRanks())),
            ("ActivateAllRanks+ShiftRanks+FilterCountGroupedByKey(node)",
             Compose(ActivateAllRanks(), ShiftRanks(), filt)),
        ):
            topo = gather(ra, self.n)
            begun = run_job_wide(ra, self.everyone, set(), 0, topo)[0]
            self.row(f"simple: {name}",
                     lambda ra=ra, topo=topo, begun=begun: run_job_wide(ra, begun, self.lost_random, 1, topo)[0])

    def per_rank(self, filt: FilterCountGroupedByKey) -> None:
        for name, job_wide in (
            ("ActivateAllRanks+ShiftRanks", Compose(ActivateAllRanks(), ShiftRanks())),
            ("ActivateAllRanks+ShiftRanks+FilterCountGroupedByKey(node)",
             Compose(ActivateAllRanks(), ShiftRanks(), filt)),
        ):
            self.per_rank_row(name, job_wide)

    def per_rank_row(self, name: str, job_wide: Compose) -> None:
        n, lost = self.n, self.lost_random
        ra = Compose(*job_wide.instances, PassThrough())
        topo = gather(ra, n)
        begun = run_job_wide(job_wide, self.everyone, set(), 0, topo)[0]

        def leader() -> Membership:
            return run_per_rank(ra, AgreedInputs(begun, 1, 0, lambda: topo), lost)[0]

        decided = leader()
        newly = [r for r in range(n) if decided.mode[r] == TERMINATED and begun.mode[r] != TERMINATED]
        decision = Decision(1, decided, newly, [], 0, 0)
        survivor = next(r for r in range(n) if decided.mode[r] == ACTIVE)
        before = AgreedInputs(begun, 1, 0, lambda: topo).state_of(survivor).freeze()

        def verify() -> Membership:
            verify_own_row(ra, AgreedInputs(begun, 1, 0, lambda: topo), before, decision)
            return decision.membership

        self.row(f"per-rank: {name}, leader", leader)
        self.row(f"per-rank: {name}, verify on one rank", verify)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384, help="initial world size (a multiple of 512)")
    ap.add_argument("--lost", type=int, default=1024, help="ranks lost in the measured restart (multiple of 8)")
    ap.add_argument("--repeat", type=int, default=21, help="measured runs per row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-per-rank", action="store_true", help="leave out the per-rank rows (slow at 16,384 ranks)")
    ap.add_argument("--markdown", help="also write the table, command and machine to this Markdown file")
    ap.add_argument("--smoke", action="store_true", help="512 ranks, one run per row, to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.n = 512
        args.lost = 8
        args.repeat = 1
    n, n_lost = args.n, args.lost
    if n % PER_RACK or n_lost % PER_NODE or not 0 < n_lost < n:
        ap.error(f"--n={n} must be a multiple of {PER_RACK} and --lost={n_lost} a multiple of {PER_NODE} below it")
    bench = Bench(n, n_lost, args.repeat, args.seed)
    filt = FilterCountGroupedByKey(node_key, lambda c: c == PER_NODE)
    bench.floor()
    bench.trees()
    bench.simple(filt)
    if not args.no_per_rank:
        bench.per_rank(filt)
    write_results(args, bench.rows)


def write_results(args: argparse.Namespace, rows: list[tuple[str, list[float], Membership]]) -> None:
    n, n_lost = args.n, args.lost
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
                f"One leader decision (`run_job_wide`: copy, assign, check) for "
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
