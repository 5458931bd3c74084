"""Fault-to-resume latency by fault kind: exceptions, deaths and hangs (native monitoring).

    python benchmarks/fault_latency.py [--faults 5] [--kinds exception,sigkill,exit,hang,gil_hang]

Workload: benchmarks/latency_worker.py, 4 ranks on 127.0.0.1 (real processes,
started by inprocess.launch.LocalJob like restart_latency.py), gloo, a
64->128->1 MLP under DDP, ``call_wrapper.ping()`` at every step; the gloo
process group and DDP are built inside ``disable_hang_protection()`` (with a
1 s soft timeout, a first rendezvous slowed by the other ranks' imports on 2
cores was taken for a hang, again and again). Rank 2 injects
the fault at step 5 (rank 0 hosts the store server, so it is never the victim).
Wrapper timeouts: soft_timeout 1 s, hard_timeout 2 s, termination_grace_time
0.5 s, progress_watchdog_interval 0.1 s (monitor_thread_interval 0.1 s,
barrier_timeout 30 s), so that the targets below are checkable in seconds.

Fault kinds:

- ``exception``: rank 2 raises RuntimeError (the reference: the path of
  restart_latency.py).
- ``sigkill``: rank 2 SIGKILLs itself; its monitor process sees the death
  through a pidfd, records the fault and arrives at the barrier for it.
- ``exit``: rank 2 calls os._exit(1) (same path as sigkill).
- ``hang``: rank 2 sleeps forever in time.sleep (GIL released); its watchdog
  fires at soft_timeout, the whole job restarts and rank 2 is interrupted out of
  its sleep and takes part in the next iteration.
- ``gil_hang``: rank 2 spins in native code holding the GIL; the peers' soft
  timeout restarts them, and rank 2's monitor kills it at hard_timeout
  (SIGCONT + SIGTERM, SIGKILL after termination_grace_time) and arrives at the
  barrier for it; the other three resume without it.

Samples: a rank that survives its fault (exception, hang) faults again in the
next iteration, so ONE job gives all --faults samples. A rank that is killed
(sigkill, exit, gil_hang) is excluded from the job, so each sample is its OWN
4-rank job (no spare ranks): --faults jobs per killing kind.

Incidents: a fault after which a HEALTHY rank does not resume (it is lost too,
e.g. killed by its own hard timeout while stuck in a gloo collective that the
abort did not release) is not a clean sample: it is counted in the "lost"
column, listed with its cause, counted as a miss of the target, and replaced
by an extra fault (at most 2 extra jobs per kind) so that the medians still
rest on --faults clean samples.

Latency = from the fault (rank 2 stamps time.monotonic_ns(), CLOCK_MONOTONIC,
just before it raises, dies or hangs) to the moment the LAST surviving rank
starts the first step of the next iteration (user re-init included: a new gloo
process group and DDP construction). Targets (a sample passes when its
latency is under the target; the table gives how many did):

    sigkill, exit  < 300 ms
    hang           < soft_timeout + 100 ms
    gil_hang       < hard_timeout + termination_grace_time + 100 ms, rank 2
                   excluded (terminated in the decision, its process dead)
    exception      reference, no target

The timeline (median over samples, rank that resumed last) places each of the
engine's phase stamps (RestartRecord) and the first fault record written to
the store after the fault. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path

# Faults injected back to back, each a restart to time: the storm brake (inprocess/engine/storm.py)
# would back off from the third of the same shape on, and this would time its back-off instead.
os.environ.setdefault("INPROCESS_RESTART_STORM", "off")

HERE = pathlib.Path(__file__).resolve().parent

WORLD_SIZE = 4
FAULT_RANK = 2
KINDS = ("exception", "sigkill", "exit", "hang", "gil_hang")
KILLING = ("sigkill", "exit", "gil_hang")
TIMEOUTS = {
    "soft_timeout": 1.0,
    "hard_timeout": 2.0,
    "termination_grace_time": 0.5,
    "progress_watchdog_interval": 0.1,
    "monitor_thread_interval": 0.1,
    "barrier_timeout": 30.0,
}
MONITOR_KINDS = ("killed", "exited", "hard_timeout")  # fault records written by a monitor process
MARKS = (  # the timeline, in the order of the restart
    "first fault record (store)",
    "monitor's fault record",
    "trigger woke (detected)",
    "abort done",
    "finalize done (+ groups destroyed)",
    "health check done",
    "barrier decided (+ reassignment)",
    "function called again",
    "first step (gloo PG + DDP rebuilt)",
)


def target_s(kind: str) -> float | None:
    t = TIMEOUTS
    return {
        "sigkill": 0.300,
        "exit": 0.300,
        "hang": t["soft_timeout"] + 0.100,
        "gil_hang": t["hard_timeout"] + t["termination_grace_time"] + 0.100,
    }.get(kind)


def read(out: pathlib.Path) -> list[list[dict]]:
    ranks = []
    for r in range(WORLD_SIZE):
        path = out / f"rank{r}.jsonl"
        ranks.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return ranks


def first(rank: list[dict], event: str, iteration: int) -> dict | None:
    return next((e for e in rank if e["event"] == event and e["iteration"] == iteration), None)


def samples(ranks: list[list[dict]], kind: str, faults: int) -> tuple[list[dict], list[str]]:
    """One entry per fault: the latency, the timeline of the rank that resumed last,
    and the ranks that were expected to resume and did not (``lost``).

    Expected: the ranks that ran the faulty iteration (less rank 2 for a killing
    kind). A fault that happens after the job already lost a healthy rank is not
    counted (it is no longer a 4-rank job).
    """
    out, problems = [], []
    for i in range(faults):
        fault = first(ranks[FAULT_RANK], "fault", i)
        if fault is None:
            problems.append(f"iteration {i}: no fault stamped")
            continue
        ran = [r for r in range(WORLD_SIZE) if first(ranks[r], "first_step", i) is not None]
        if len(ran) < WORLD_SIZE:
            problems.append(f"iteration {i}: not counted, only ranks {ran} ran it")
            continue
        expected = [r for r in ran if not (kind in KILLING and r == FAULT_RANK)]
        starts = {r: first(ranks[r], "first_step", i + 1) for r in expected}
        resumed = [r for r in expected if starts[r] is not None]
        lost = [r for r in expected if starts[r] is None]
        if not resumed:
            problems.append(f"iteration {i}: no rank started iteration {i + 1}")
            continue
        last = max(resumed, key=lambda r: starts[r]["t_ns"])  # type: ignore[index]
        f_ns = fault["t_ns"]
        sample: dict[str, Any] = {
            "iteration": i, "latency_s": (starts[last]["t_ns"] - f_ns) / 1e9,  # type: ignore[index]
            "last_rank": last, "lost": lost,
        }
        rec = first(ranks[last], "restart", i)
        if rec is not None:
            faults_seen = rec.get("faults", [])
            own = [f for f in faults_seen if f["kind"] != "after_restart" and f["t_ns"]]
            by_monitor = [f for f in own if f["kind"] in MONITOR_KINDS]
            marks = {
                "first fault record (store)": min((f["t_ns"] for f in own), default=None),
                "monitor's fault record": min((f["t_ns"] for f in by_monitor), default=None),
                "trigger woke (detected)": rec["detected_ns"],
                "abort done": rec["aborted_ns"],
                "finalize done (+ groups destroyed)": rec["finalized_ns"],
                "health check done": rec["health_checked_ns"],
                "barrier decided (+ reassignment)": rec["decided_ns"],
                "function called again": rec["initialized_ns"],
                "first step (gloo PG + DDP rebuilt)": starts[last]["t_ns"],  # type: ignore[index]
            }
            sample["timeline_ms"] = {k: (v - f_ns) / 1e6 for k, v in marks.items() if v}
            sample["fault_kinds"] = sorted({f"r{f['rank']}:{f['kind']}" for f in own})
            sample["terminated"] = rec.get("terminated", [])
            sample["excluded"] = FAULT_RANK in sample["terminated"]
            if lost:
                sample["lost_why"] = sorted({f"r{f['rank']}:{f['kind']}" for f in faults_seen if f["rank"] in lost})
            if kind in KILLING and not sample["excluded"]:
                problems.append(f"iteration {i}: rank {FAULT_RANK} not terminated in the decision")
        if lost:
            problems.append(f"iteration {i}: healthy rank(s) {lost} did not resume "
                            f"({', '.join(sample.get('lost_why', [])) or 'no record'}); "
                            f"the others resumed after {sample['latency_s'] * 1e3:.0f} ms")
        out.append(sample)
    return out, problems


def run_job(
    kind: str, faults: int, tmp: pathlib.Path, tag: str, timeout: float, ranks_per_node: int | None = None,
) -> tuple[list[list[dict]], list[str]]:
    """One 4-rank job; always reaped (LocalJob kills every rank's process group, monitors included)."""
    from inprocess.launch import LocalJob

    out = tmp / tag
    out.mkdir()
    print(f"job {tag}: {kind}, {faults} fault(s) ...", file=sys.stderr, flush=True)  # progress; results on stdout
    env = {
        "MODE": "inprocess", "OUT": str(out), "FAULTS": str(faults), "FAULT_KIND": kind,
        "FAULT_RANK": str(FAULT_RANK), "FAULT_STEP": "5", "STEPS": "10", "PING": "1", "UNGUARDED_INIT": "1",
        "WRAPPER_TIMEOUTS": json.dumps(TIMEOUTS),
    }
    problems = []
    with LocalJob([str(HERE / "latency_worker.py")], WORLD_SIZE, env=env, ranks_per_node=ranks_per_node) as job:
        try:
            job.wait(timeout=timeout)
        except TimeoutError:
            problems.append(f"job killed after {timeout:g} s")
    for rp in job.ranks:
        victim = rp.rank == FAULT_RANK and kind in KILLING
        if (rp.returncode == 0) == victim:
            problems.append(f"rank {rp.rank} rc={rp.returncode}")
    if problems:
        print(f"--- {tag}: {'; '.join(problems)}\n{job.outputs()[-3000:]}", file=sys.stderr)
    return read(out), problems


def run_kind(
    kind: str, faults: int, tmp: pathlib.Path, deadline: float, ranks_per_node: int | None = None,
) -> dict[str, Any]:
    """--faults clean samples, topped up by extra jobs (at most 2) for faults
    that lost a healthy rank (counted and reported as incidents)."""
    t0 = time.monotonic()
    clean: list[dict] = []
    incidents: list[dict] = []
    problems: list[str] = []
    jobs = 0
    max_jobs = faults + 2 if kind in KILLING else 3
    while len(clean) < faults and jobs < max_jobs:
        n = 1 if kind in KILLING else faults - len(clean)
        tag = f"{kind}-{jobs}"
        jobs += 1
        left = deadline - time.monotonic()
        if left < 20:
            problems.append(f"{tag}: not run, --time-limit reached")
            break
        ranks, p = run_job(kind, n, tmp, tag, min(left, 60 + 10 * n), ranks_per_node)
        got, q = samples(ranks, kind, n)
        clean += [g for g in got if not g["lost"]]
        incidents += [g for g in got if g["lost"]]
        problems += [f"{tag}: {x}" for x in p + q]
        if not got:
            break  # the job itself failed: no use repeating it
    lat = [s["latency_s"] for s in clean]
    tgt = target_s(kind)
    timeline: dict[str, float] = {}
    for name in (clean[0].get("timeline_ms", {}) if clean else {}):
        vals = [s["timeline_ms"][name] for s in clean if name in s.get("timeline_ms", {})]
        timeline[name] = statistics.median(vals)
    # A fault passes when every healthy rank resumed within the target (and, for
    # the killing kinds, rank 2 was excluded); an incident never passes.
    within = sum(1 for s in clean if tgt is not None and s["latency_s"] < tgt
                 and (kind not in KILLING or s.get("excluded")))
    return {
        "latency_s": lat,
        "median_s": statistics.median(lat) if lat else None,
        "min_s": min(lat) if lat else None,
        "max_s": max(lat) if lat else None,
        "n": len(lat),
        "incidents": [{k: v for k, v in s.items() if k != "timeline_ms"} for s in incidents],
        "target_s": tgt,
        "within_target": within if tgt is not None else None,
        "pass": (len(lat) == faults and not incidents and within == len(lat)) if tgt is not None else None,
        "timeline_ms": timeline,
        "fault_records": sorted({k for s in clean for k in s.get("fault_kinds", [])}),
        "jobs": jobs,
        "problems": problems,
        "wall_s": time.monotonic() - t0,
    }


def main() -> None:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=5, help="samples per fault kind (default 5)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    ap.add_argument("--time-limit", type=float, default=290.0,
                    help="seconds for the whole run: jobs that would start later are skipped (default 290)")
    ap.add_argument("--ranks-per-node", type=int, default=None,
                    help="split the 4 ranks into nodes of this many (2: two nodes, each with a node agent); "
                         "default: one node, no agent")
    ap.add_argument("--smoke", action="store_true", help="one exception fault, to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.faults = 1
        args.kinds = 'exception'
    if args.ranks_per_node is not None and not 1 <= args.ranks_per_node <= WORLD_SIZE:
        raise SystemExit(f"--ranks-per-node={args.ranks_per_node}: expected 1..{WORLD_SIZE}")
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise SystemExit(f"--kinds={args.kinds}: expected a subset of {','.join(KINDS)}")
    if args.faults < 1:
        raise SystemExit(f"--faults={args.faults}: expected >= 1")
    deadline = time.monotonic() + args.time_limit
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="inprocess-fault-latency-"))
    try:
        results = {k: run_kind(k, args.faults, tmp, deadline, args.ranks_per_node) for k in kinds}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    t = TIMEOUTS
    print(f"fault-to-resume latency, {WORLD_SIZE} ranks, gloo DDP, rank {FAULT_RANK} faults, "
          f"soft {t['soft_timeout']:g} s, hard {t['hard_timeout']:g} s, grace {t['termination_grace_time']:g} s, "
          f"watchdog interval {t['progress_watchdog_interval']:g} s (last surviving rank's first step)")
    print(f"  {'kind':10s} {'median':>10s} {'min-max':>19s} {'n':>3s} {'lost':>5s} {'target':>10s} "
          f"{'within':>7s}  result")
    for k, r in results.items():
        lost = len(r["incidents"])
        if not r["n"]:
            print(f"  {k:10s} {'n/a':>10s} {'':>19s} {0:3d} {lost:5d}  FAIL: no clean sample")
            continue
        tgt = f"< {r['target_s'] * 1e3:.0f} ms" if r["target_s"] is not None else "reference"
        within = f"{r['within_target']}/{r['n'] + lost}" if r["target_s"] is not None else ""
        verdict = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        rng = f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} ms"
        print(f"  {k:10s} {r['median_s'] * 1e3:7.1f} ms {rng:>19s} {r['n']:3d} {lost:5d} {tgt:>10s} "
              f"{within:>7s}  {verdict}")
    print("  (n: faults after which every healthy rank resumed; lost: faults after which a healthy rank did not,")
    print("   listed below; within: faults resumed within the target, incidents counted as misses)")
    for k, r in results.items():
        print(f"  fault records ({k}): {', '.join(r['fault_records']) or '-'}")
    print("timeline: ms after the fault, median over samples, rank that resumed last")
    names = [n for n in MARKS if any(n in r["timeline_ms"] for r in results.values())]
    print(f"  {'':36s}" + "".join(f"{k:>10s}" for k in results))
    for n in names:
        cells = "".join(f"{r['timeline_ms'][n]:10.1f}" if n in r["timeline_ms"] else f"{'-':>10s}"
                        for r in results.values())
        print(f"  {n:36s}{cells}")
    for k, r in results.items():
        for p in r["problems"]:
            print(f"  problem ({k}): {p}")
    print(json.dumps({
        "benchmark": "fault_latency", "world_size": WORLD_SIZE, "ranks_per_node": args.ranks_per_node,
        "faults": args.faults, "fault_rank": FAULT_RANK,
        "timeouts_s": TIMEOUTS, "kinds": results,
    }))


if __name__ == "__main__":
    main()
