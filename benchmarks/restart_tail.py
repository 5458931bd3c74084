"""The distribution of in-process restart latency over many faults in ONE job (the gloo tail).

    python benchmarks/restart_tail.py [--faults 200] [--gloo-timeout 30] [--stacks-after 5]
                                      [--private-hosts] [--keep DIR]

Workload: benchmarks/latency_worker.py, 4 ranks on 127.0.0.1 started by
inprocess.launch.LocalJob, a gloo process group and a 64->128->1 MLP under DDP
(--hidden sets the width: 4096 gives 1 MB of gradients, 16384 4 MB);
rank 2 raises a RuntimeError at step 5 of iterations 0..faults-1, so one job
restarts --faults times in a row. Latency = from the fault (rank 2 stamps
CLOCK_MONOTONIC just before it raises) to the moment the LAST rank starts the
first step of the next iteration (the user's re-init included: a new gloo
process group and DDP).

Progress goes to stdout as the job runs: a line every 10 restarts with the
distribution so far, and one line for every restart slower than 150 ms with
the phase where its last rank lost the time. A restart that took at least
90 % of --gloo-timeout is counted "at gloo's timeout": a rank was released by
gloo's own timeout, not by the abort. At the end: p50/p90/p99/max, the count
at gloo's timeout, the slow restarts by phase, and one JSON line.

--stacks-after S: a restart still pending after S seconds gets every rank's
native stacks (gdb; GDB_EXTRA=script adds a gdb script) and sockets, under
--keep (printed when --keep is not given).

--private-hosts: runs the job in a mount namespace of its own whose /etc/hosts
also names ::ffff:127.0.0.1 (root and unshare(1) needed). torch's TCPStore
server reverse-resolves every new client's address; without such an entry the
lookup goes to the network's resolver, which on some machines stalls for
seconds (issue 12, item 1). The option isolates the gloo release from that
stall; the machine's own /etc/hosts is not touched.

Every process is reaped on every path (Ctrl-C and SIGTERM too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# Faults injected back to back, each a restart to time: the storm brake (inprocess/engine/storm.py)
# would back off from the third of the same shape on, and this would time its back-off instead.
os.environ.setdefault("INPROCESS_RESTART_STORM", "off")

HERE = pathlib.Path(__file__).resolve().parent

WORLD_SIZE = 4
SLOW_S = 0.150
IN_NAMESPACE = "_INPROCESS_BENCH_PRIVATE_HOSTS"


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        raise ValueError("percentile of no samples")
    k = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[k - 1]


class Records:
    """The ranks' JSON lines, read incrementally while they are being written."""

    def __init__(self, out: pathlib.Path, world_size: int):
        self.world_size = world_size
        self.paths = [out / f"rank{r}.jsonl" for r in range(world_size)]
        self.offsets = [0] * world_size
        self.fault_ns: dict[int, int] = {}
        # event -> iteration -> rank -> record
        self.events: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}

    def poll(self) -> None:
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[rank])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self.offsets[rank] += end
            for line in data[:end].splitlines():
                e = json.loads(line)
                if e["event"] == "fault":
                    self.fault_ns[e["iteration"]] = e["t_ns"]
                self.events.setdefault(e["event"], {}).setdefault(e["iteration"], {})[rank] = e

    def get(self, event: str, iteration: int) -> dict[int, dict[str, Any]]:
        return self.events.get(event, {}).get(iteration, {})

    def latency(self, fault_iteration: int) -> float | None:
        """Seconds from fault i to the last rank's first step of iteration i+1, once known."""
        starts = self.get("first_step", fault_iteration + 1)
        if fault_iteration not in self.fault_ns or len(starts) < self.world_size:
            return None
        return (max(e["t_ns"] for e in starts.values()) - self.fault_ns[fault_iteration]) / 1e9

    def phases(self, fault_iteration: int) -> tuple[int, dict[str, float]]:
        """(rank, seconds per phase) of the rank that resumed last after fault i."""
        first = self.get("first_step", fault_iteration + 1)
        rank = max(first, key=lambda r: first[r]["t_ns"])
        rec = self.get("restart", fault_iteration).get(rank)
        pg = self.get("pg_ready", fault_iteration + 1).get(rank)
        if rec is None or pg is None:
            return rank, {}
        marks = [
            ("abort", self.fault_ns[fault_iteration], rec["aborted_ns"]),
            ("finalize", rec["aborted_ns"], rec["finalized_ns"]),
            ("health check + barrier", rec["finalized_ns"], rec["decided_ns"]),
            ("initialize + store", rec["decided_ns"], rec["initialized_ns"]),
            ("process group", rec["initialized_ns"], pg["t_ns"]),
            ("DDP + first step", pg["t_ns"], first[rank]["t_ns"]),
        ]
        return rank, {name: max(0, b - a) / 1e9 for name, a, b in marks}


def summary(samples: list[float], gloo_timeout: float) -> dict[str, Any]:
    v = sorted(samples)
    return {
        "n": len(v),
        "p50_ms": round(percentile(v, 50) * 1e3, 1),
        "p90_ms": round(percentile(v, 90) * 1e3, 1),
        "p99_ms": round(percentile(v, 99) * 1e3, 1),
        "max_ms": round(v[-1] * 1e3, 1),
        "mean_ms": round(statistics.fmean(v) * 1e3, 1),
        "over_150ms": sum(1 for x in v if x > 0.150),
        "over_500ms": sum(1 for x in v if x > 0.500),
        "at_gloo_timeout": sum(1 for x in v if x >= 0.9 * gloo_timeout),
    }


def fmt(s: dict[str, Any]) -> str:
    return (f"n={s['n']:4d}  p50 {s['p50_ms']:7.1f} ms  p90 {s['p90_ms']:7.1f} ms  p99 {s['p99_ms']:8.1f} ms  "
            f"max {s['max_ms']:8.1f} ms  >150ms {s['over_150ms']}  >500ms {s['over_500ms']}  "
            f"at gloo's timeout {s['at_gloo_timeout']}")


def dump_stacks(pids: list[int], where: pathlib.Path | None, label: str) -> None:
    """Every rank's native stacks and sockets (gdb attaches for a moment; nothing is changed)."""
    extra = ["-x", os.environ["GDB_EXTRA"]] if os.environ.get("GDB_EXTRA") else []
    for rank, pid in enumerate(pids):
        try:
            out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt", *extra],
                                 capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            out = f"gdb failed: {e}"
        try:
            fds = {}
            for name in os.listdir(f"/proc/{pid}/fd"):
                try:
                    fds[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
                except OSError:
                    pass
            out += "\n--- descriptors\n" + "\n".join(f"{fd} {t}" for fd, t in sorted(fds.items()))
            out += "\n--- tcp\n" + subprocess.run(["ss", "-tnpie"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            out += f"\nsockets: {e}"
        if where is None:
            print(f"--- {label}: rank {rank} (pid {pid})\n{out}", flush=True)
        else:
            path = where / f"stacks-{label}-rank{rank}.txt"
            path.write_text(out)
            print(f"    stacks of rank {rank} -> {path}", flush=True)


def run(args: argparse.Namespace,
        out: pathlib.Path) -> tuple[list[float], dict[str, int], dict[str, float], list[int]]:
    from inprocess.launch import LocalJob

    env = {
        "MODE": "inprocess", "OUT": str(out), "FAULTS": str(args.faults), "FAULT_KIND": "exception",
        "GLOO_TIMEOUT": str(args.gloo_timeout), "LOG_FILE": str(out / "rank.log"), "HIDDEN": str(args.hidden),
        # One intra-op thread per rank, as torchrun sets it: 4 ranks on 2 cores.
        "OMP_NUM_THREADS": "1",
    }
    if args.log_level:
        env["INPROCESS_TEST_LOG"] = args.log_level
    records = Records(out, WORLD_SIZE)
    samples: list[float] = []
    slow_by_phase: dict[str, int] = {}
    all_phases: dict[str, list[float]] = {}
    dumped: set[int] = set()
    deadline = time.monotonic() + args.deadline
    with LocalJob([str(HERE / "latency_worker.py")], WORLD_SIZE, env=env, capture=False) as job:
        pids = [rp.popen.pid for rp in job.ranks]
        while True:
            records.poll()
            while len(samples) < args.faults:
                lat = records.latency(len(samples))
                if lat is None:
                    break
                samples.append(lat)
                n = len(samples)
                rank, phases = records.phases(n - 1)
                for k, v in phases.items():
                    all_phases.setdefault(k, []).append(v)
                if lat > SLOW_S:
                    worst = max(phases, key=lambda k: phases[k]) if phases else "?"
                    slow_by_phase[worst] = slow_by_phase.get(worst, 0) + 1
                    detail = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items())
                    print(f"  restart {n - 1}: {lat * 1e3:.1f} ms, last rank {rank}: {detail} ms", flush=True)
                if n % 10 == 0 or n == args.faults:
                    print(f"  after {n:4d} restarts: {fmt(summary(samples, args.gloo_timeout))}", flush=True)
            pending = len(samples)
            if (args.stacks_after is not None and pending < args.faults and pending not in dumped
                    and pending in records.fault_ns
                    and time.monotonic_ns() - records.fault_ns[pending] > args.stacks_after * 1e9):
                dumped.add(pending)
                print(f"  restart {pending} still pending after {args.stacks_after:g} s: dumping stacks", flush=True)
                dump_stacks(pids, out if args.keep else None, f"restart{pending}")
            if all(rp.popen.poll() is not None for rp in job.ranks):
                break
            if time.monotonic() > deadline:
                print(f"deadline of {args.deadline:g} s reached: stopping the job", file=sys.stderr)
                break
            time.sleep(0.2)
        codes = [rp.popen.poll() for rp in job.ranks]
    medians = {k: statistics.median(v) for k, v in all_phases.items()}
    return samples, slow_by_phase, medians, [c if c is not None else -9 for c in codes]


def reexec_with_private_hosts() -> None:
    """Run this same command again in a mount namespace whose /etc/hosts names ::ffff:127.0.0.1."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise SystemExit("--private-hosts needs root and unshare(1)")
    hosts = pathlib.Path(tempfile.mkdtemp(prefix="inprocess-hosts-")) / "hosts"
    hosts.write_text(pathlib.Path("/etc/hosts").read_text() + "\n::ffff:127.0.0.1 localhost\n")
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(hosts),
            sys.executable, *sys.argv]
    os.environ[IN_NAMESPACE] = str(hosts)
    os.execvp(argv[0], argv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--gloo-timeout", type=float, default=30.0, help="the gloo process group's timeout, seconds")
    ap.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP (gradient size)")
    ap.add_argument("--stacks-after", type=float, default=None,
                    help="dump every rank's native stacks when a restart is pending this long (seconds)")
    ap.add_argument("--keep", type=pathlib.Path, default=None,
                    help="directory for the ranks' records, logs and stacks (kept); default: a temporary one")
    ap.add_argument("--log-level", default="", help="the ranks' inprocess log level (e.g. DEBUG), to their logs")
    ap.add_argument("--deadline", type=float, default=None, help="stop the job after this many seconds")
    ap.add_argument("--private-hosts", action="store_true",
                    help="name ::ffff:127.0.0.1 in a private /etc/hosts (see above)")
    ap.add_argument("--smoke", action="store_true", help="3 faults, to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.faults = 3
    if args.faults < 1:
        raise SystemExit(f"--faults={args.faults}: expected >= 1")
    if args.gloo_timeout <= 0:
        raise SystemExit(f"--gloo-timeout={args.gloo_timeout}: expected > 0")
    if args.hidden < 1:
        raise SystemExit(f"--hidden={args.hidden}: expected >= 1")
    if args.private_hosts and not os.environ.get(IN_NAMESPACE):
        reexec_with_private_hosts()
    if args.deadline is None:
        args.deadline = 120 + args.faults * 3.0 + 5 * args.gloo_timeout
    # SIGTERM unwinds like Ctrl-C, so the job is reaped by LocalJob's exit either way.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        out = args.keep
    else:
        out = pathlib.Path(tempfile.mkdtemp(prefix="inprocess-tail-"))
    hosts = " (private /etc/hosts naming ::ffff:127.0.0.1)" if args.private_hosts else ""
    print(f"{args.faults} exception faults, {WORLD_SIZE} ranks, gloo DDP (hidden {args.hidden}), "
          f"gloo timeout {args.gloo_timeout:g} s{hosts}; records in {out}", flush=True)
    t0 = time.monotonic()
    try:
        samples, slow_by_phase, medians, codes = run(args, out)
    except KeyboardInterrupt:
        print("interrupted: every rank was stopped", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        if os.environ.get(IN_NAMESPACE):
            shutil.rmtree(pathlib.Path(os.environ[IN_NAMESPACE]).parent, ignore_errors=True)
    wall = time.monotonic() - t0
    if not samples:
        raise SystemExit(f"no restart completed (exit codes {codes})")
    s = summary(samples, args.gloo_timeout)
    print(f"restart latency over {s['n']} faults (fault -> last rank's first step), {wall:.0f} s wall:")
    print(f"  {fmt(s)}")
    print("  median per phase of the rank that resumed last: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in medians.items()))
    if slow_by_phase:
        print("  restarts over 150 ms by the phase where the last rank lost most time: "
              + ", ".join(f"{k} {v}" for k, v in sorted(slow_by_phase.items(), key=lambda kv: -kv[1])))
    incomplete = any(c != 0 for c in codes) or len(samples) < args.faults
    if incomplete:
        print(f"  incomplete: {len(samples)} of {args.faults} restarts measured, exit codes {codes}", file=sys.stderr)
    print(json.dumps({"bench": "restart_tail", "faults": args.faults, "hidden": args.hidden,
                      "gloo_timeout_s": args.gloo_timeout, "private_hosts": args.private_hosts,
                      "wall_s": round(wall, 1), "exit_codes": codes, **s, "slow_by_phase": slow_by_phase,
                      "median_phase_ms": {k: round(v * 1e3, 1) for k, v in medians.items()}}))
    if incomplete:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
