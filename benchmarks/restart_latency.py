"""Fault-to-resume latency: in-process restart vs. torchrun restarting the processes.

    python benchmarks/restart_latency.py [--faults 5] [--skip-torchrun]

The same 4-rank gloo DDP workload (benchmarks/latency_worker.py) runs twice in
one invocation: under inprocess.Wrapper, and as a plain script under
``torchrun --max-restarts``. Rank 2 raises at step 5 of each of the first
--faults attempts. Latency = from the moment the fault is raised to the moment
the LAST rank starts the first step of the next attempt (so it includes gloo
re-initialisation and DDP construction: the user's own re-init). Both clocks
are CLOCK_MONOTONIC of this host. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import reaping  # benchmarks/reaping.py: this script's folder is first on the path

# Faults injected back to back, each a restart to time: the storm brake (inprocess/engine/storm.py)
# would back off from the third of the same shape on, and this would time its back-off instead.
os.environ.setdefault("INPROCESS_RESTART_STORM", "off")

HERE = pathlib.Path(__file__).resolve().parent


def read(out: pathlib.Path, world_size: int) -> list[list[dict]]:
    ranks = []
    for r in range(world_size):
        path = out / f"rank{r}.jsonl"
        ranks.append([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])
    return ranks


def latencies(ranks: list[list[dict]], faults: int) -> list[float]:
    fault_t = {e["iteration"]: e["t_ns"] for rank in ranks for e in rank if e["event"] == "fault"}
    out = []
    for i in range(faults):
        starts = [e["t_ns"] for rank in ranks for e in rank if e["event"] == "first_step" and e["iteration"] == i + 1]
        if i in fault_t and len(starts) == len(ranks):
            out.append((max(starts) - fault_t[i]) / 1e9)
    return out


def breakdown(ranks: list[list[dict]], faults: int) -> dict[str, float]:
    """Median over faults of each phase, taking for each fault the rank that resumed last."""
    phases: dict[str, list[float]] = {}
    fault_t = {e["iteration"]: e["t_ns"] for rank in ranks for e in rank if e["event"] == "fault"}
    for i in range(faults):
        rows = []
        for rank in ranks:
            rec = next((e for e in rank if e["event"] == "restart" and e["iteration"] == i), None)
            first = next((e for e in rank if e["event"] == "first_step" and e["iteration"] == i + 1), None)
            if rec and first:
                rows.append((first["t_ns"], rec, first))
        if not rows or i not in fault_t:
            continue
        _, rec, first = max(rows, key=lambda row: row[0])
        f = fault_t[i]
        marks = [
            ("detect (fault -> trigger woke)", f, rec["detected_ns"]),
            ("abort (release collectives)", rec["detected_ns"], rec["aborted_ns"]),
            ("finalize (+ destroy groups)", max(rec["aborted_ns"], rec["detected_ns"]), rec["finalized_ns"]),
            ("health check", rec["finalized_ns"], rec["health_checked_ns"]),
            ("barrier + reassignment", rec["health_checked_ns"], rec["decided_ns"]),
            ("initialize hook + call", rec["decided_ns"], rec["initialized_ns"]),
            ("user re-init (gloo PG + DDP)", rec["initialized_ns"], first["t_ns"]),
        ]
        for name, a, b in marks:
            phases.setdefault(name, []).append(max(0, b - a) / 1e9)
        phases.setdefault("  of which rank assignment (leader)", []).append(rec["assignment_ns"] / 1e9)
    return {k: statistics.median(v) for k, v in phases.items()}


def run_inprocess(faults: int, tmp: pathlib.Path) -> list[list[dict]]:
    from inprocess.launch import LocalJob

    out = tmp / "inprocess"
    out.mkdir()
    env = {"MODE": "inprocess", "OUT": str(out), "FAULTS": str(faults)}
    print(f"inprocess: 4 ranks, {faults} faults ...", flush=True)
    with LocalJob([str(HERE / "latency_worker.py")], 4, env=env) as job:  # kills every rank on any exit
        job.wait(timeout=120 + 10 * faults)
    bad = [rp for rp in job.ranks if rp.returncode != 0]
    if bad:
        raise SystemExit(f"in-process run failed:\n{job.outputs()[-4000:]}")
    return read(out, 4)


def run_torchrun(faults: int, tmp: pathlib.Path) -> list[list[dict]]:
    from inprocess.launch import free_port

    out = tmp / "torchrun"
    out.mkdir()
    marker = f"INPROCESS_BENCH_RUN={tmp}"  # inherited by torchrun's workers: found and stopped at the end
    env = dict(os.environ, MODE="torchrun", OUT=str(out), FAULTS=str(faults), INPROCESS_BENCH_RUN=str(tmp),
               # torch 2.13 restarts a gloo job only with the c10d rendezvous and an unshared store
               # (otherwise restarted ranks read the previous attempt's addresses: pytorch/pytorch#135712).
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
           # Spare restarts: a restarted torchrun worker sometimes dies of SIGABRT in torch's
           # teardown ("terminate called without an active exception"), which costs one.
           f"--max-restarts={faults + 3}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--monitor-interval=0.1", str(HERE / "latency_worker.py")]
    print(f"torchrun: 4 workers, {faults} faults, --max-restarts={faults + 3} ...", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=60 + 30 * faults)
    finally:
        reaping.stop(proc, marker)  # also on Ctrl-C: torchrun's workers run in sessions of their own
    if proc.returncode != 0:
        # Keep what was measured: the restarts that did happen are still valid samples.
        crashes = output.count("terminate called")
        print(f"torchrun run ended with rc={proc.returncode} ({crashes} worker crash(es) in torch's teardown); "
              "reporting the restarts it completed", file=sys.stderr)
    return read(out, 4)


def fmt(v: list[float]) -> str:
    if not v:
        return "n/a"
    spread = f"range {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f} ms"
    return f"median {statistics.median(v) * 1e3:8.1f} ms   {spread}   (n={len(v)})"


def main() -> None:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=5)
    ap.add_argument("--skip-torchrun", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one fault, in-process only, to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.faults = 1
        args.skip_torchrun = True
    if args.faults < 1:
        raise SystemExit(f"--faults={args.faults}: expected >= 1")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="inprocess-bench-"))
    try:
        t0 = time.monotonic()
        ranks_ip = run_inprocess(args.faults, tmp)
        wall_ip = time.monotonic() - t0
        ip = latencies(ranks_ip, args.faults)
        phases = breakdown(ranks_ip, args.faults)
        tr: list[float] = []
        if not args.skip_torchrun:
            tr = latencies(run_torchrun(args.faults, tmp), args.faults)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"fault-to-resume latency, 4 ranks, gloo DDP, {args.faults} faults "
          "(last rank's first step of the next attempt)")
    print(f"  inprocess : {fmt(ip)}")
    if tr:
        print(f"  torchrun  : {fmt(tr)}")
        print(f"  ratio (torchrun / inprocess, medians): {statistics.median(tr) / statistics.median(ip):.0f}x")
    print("in-process breakdown (median over faults, rank that resumed last):")
    for name, v in phases.items():
        print(f"  {name:38s} {v * 1e3:8.2f} ms")
    print(json.dumps({
        "benchmark": "restart_latency", "faults": args.faults, "world_size": 4,
        "inprocess_s": ip, "torchrun_s": tr,
        "inprocess_median_s": statistics.median(ip) if ip else None,
        "torchrun_median_s": statistics.median(tr) if tr else None,
        "ratio": (statistics.median(tr) / statistics.median(ip)) if ip and tr else None,
        "phases_median_s": phases, "inprocess_wall_s": wall_ip,
    }))


if __name__ == "__main__":
    main()
