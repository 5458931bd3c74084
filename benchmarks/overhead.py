"""What native monitoring costs a job that never fails: step time, and ping().

    python benchmarks/overhead.py [--rounds 8] [--steps 300] [--world-size 4]

(a) Step time. A DDP training loop like examples/demo.py (a 32->64->1 MLP,
batch 64, SGD with momentum, ping() at every step and an in-memory checkpoint
committed under atomic()) runs on --world-size ranks on 127.0.0.1 (gloo) in
two ways that differ only in the wrapper:

- ``wrapped``: the loop's function decorated with inprocess.Wrapper (library
  default timeouts: soft 60 s, hard 90 s, progress_watchdog_interval 1 s),
  which brings the heartbeat page, the GIL-free watchdog thread, the
  restart-trigger thread and one monitor process per rank (and the store host
  process, where the library starts one); the process group is built on
  ``call_wrapper.store``;
- ``plain``: the same function undecorated: ``init_process_group`` on a plain
  TCPStore of its own, ping() and atomic() replaced by no-ops.

Interleaving: ONE job of --world-size rank processes alternates the two, in
--rounds rounds of one segment each (the order flips every round: W P, P W,
W P, ...), --steps timed steps per segment after --warmup untimed ones; one
more round first (P W) warms both paths up and is not counted. Every
wrapped segment is a fresh wrapped call (its own MASTER_PORT, monitors
started and stopped with it); every plain segment a fresh process group. So
both see the same processes and the same machine noise, a few seconds apart.
Each step is timed on every rank (time.perf_counter_ns around ping, forward,
backward with its allreduce, optimizer step and commit); a segment's figure is
rank 0's median step (the ranks are in lockstep through the allreduce). Also
given: CPU time per step of the rank process (time.process_time_ns over the
timed steps, all threads; median over ranks), and its split by thread
(schedstat): the main thread, gloo's threads, and the others (where the
wrapper's watchdog and restart-trigger threads are).
Reported: the median over segments of each mode, their ratio (wrapped /
plain), the per-round ratios (min-max), and a noise floor: the relative spread
(max - min) / median of the plain segments among themselves.

Both run with OMP_NUM_THREADS=1, as torchrun sets it for several ranks per
node (with torch's default of one thread per core, 4 ranks on 2 cores spin
against each other: ~40 ms per step instead of ~9 ms, all of it noise).

(b) ping(). Inside a wrapped function on a 1-rank job, batches of 1,000,000
``call_wrapper.ping()`` calls in a tight loop, median ns per call over
--batches; next to it, for scale, the same loop calling an empty Python
function, the bound native ``HeartbeatPage.ping`` directly, and the empty loop
(the four interleaved batch by batch).

Targets: no measurable step-time difference: the per-round ratios fall on
both sides of 1, or the ratio of the medians differs from 1 by no more than
the noise floor; ping() under 1 us. Prints a table and one JSON line. Every
job is reaped (LocalJob kills each rank's process group: monitors, store host)
and time-limited.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
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

HERE = pathlib.Path(__file__).resolve().parent

PING_CALLS = 1_000_000


# -- one rank (run with OVERHEAD_ROLE set) ---------------------------------------


def rank_main() -> None:
    role = os.environ["OVERHEAD_ROLE"]
    out = pathlib.Path(os.environ["OVERHEAD_OUT"])
    rank = int(os.environ["RANK"])
    if role == "ping":
        result = ping_rank()
    else:
        result = alternate_rank(int(os.environ["OVERHEAD_STEPS"]), int(os.environ["OVERHEAD_WARMUP"]))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # The figures are written: leave without interpreter finalization, where torch
    # 2.13's gloo teardown sometimes aborts ("terminate called without an active
    # exception", seen in a plain job here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def task_cpu() -> dict[str, tuple[str, int]]:
    """CPU ns of every thread of this process (/proc/self/task/*/schedstat), with its class:
    main (the main thread), gloo (gloo's loop and worker threads) or other (everything
    else: the wrapper's watchdog and trigger threads, store and torch helper threads)."""
    out = {}
    pid = os.getpid()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        cls = "main" if int(tid) == pid else "gloo" if comm.startswith(("gloo", "pt_gloo")) else "other"
        out[tid] = (cls, ns)
    return out


def train_loop(rank: int, world_size: int, steps: int, warmup: int, ping: Any, atomic: Any) -> dict[str, Any]:
    """Per-step wall times (ns) of the timed steps, and the process's CPU time per timed
    step (all its threads: the main thread, gloo's, and the wrapper's), also by class
    of thread (task_cpu)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    checkpoint = None
    times = []
    cpu0 = 0
    tasks0: dict[str, tuple[str, int]] = {}
    for step in range(warmup + steps):
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, 32, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        if step == warmup:
            cpu0 = time.process_time_ns()
            tasks0 = task_cpu()
        t0 = time.perf_counter_ns()
        ping()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        with atomic():
            checkpoint = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), float(loss.detach()))
        if step >= warmup:
            times.append(time.perf_counter_ns() - t0)
    cpu_per_step = (time.process_time_ns() - cpu0) / steps
    by_class = {"main": 0.0, "gloo": 0.0, "other": 0.0}
    for tid, (cls, ns) in task_cpu().items():
        by_class[cls] += (ns - tasks0.get(tid, (cls, 0))[1]) / steps
    del checkpoint
    return {"times_ns": times, "cpu_ns_per_step": cpu_per_step, "cpu_ns_per_step_by_thread": by_class}


def alternate_rank(steps: int, warmup: int) -> dict[str, Any]:
    """Rounds of one plain and one wrapped segment, in the order the driver gives."""
    import torch.distributed as dist

    import inprocess

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=30)
    ports = [int(x) for x in os.environ["OVERHEAD_WRAPPED_PORTS"].split(",")]
    orders = os.environ["OVERHEAD_ORDERS"].split(",")  # e.g. "WP,PW,..."
    plain_store = dist.TCPStore("127.0.0.1", int(os.environ["OVERHEAD_PLAIN_PORT"]), world_size, rank == 0,
                                timeout)

    @inprocess.Wrapper()
    def wrapped(call_wrapper: inprocess.CallWrapper = None) -> dict[str, Any]:
        me = call_wrapper.frozen_state
        dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank,
                                world_size=me.active_world_size, timeout=timeout)
        try:
            return train_loop(me.active_rank, me.active_world_size, steps, warmup, call_wrapper.ping,
                              call_wrapper.atomic)
        finally:
            dist.destroy_process_group()

    def plain(k: int) -> dict[str, Any]:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"plain/{k}", plain_store), rank=rank,
                                world_size=world_size, timeout=timeout)
        try:
            return train_loop(rank, world_size, steps, warmup, lambda: None, contextlib.nullcontext)
        finally:
            dist.destroy_process_group()

    res: dict[str, list[dict[str, Any]]] = {"wrapped": [], "plain": []}
    for k, order in enumerate(orders):
        for mode in order:
            if mode == "W":
                # A port per wrapped call: each call starts (and ends) its own store server.
                os.environ["MASTER_PORT"] = str(ports[k])
                res["wrapped"].append(wrapped())
            else:
                res["plain"].append(plain(k))
    return res


def ping_rank() -> dict[str, Any]:
    import inprocess

    batches = int(os.environ["OVERHEAD_BATCHES"])

    def empty() -> None:
        pass

    def timed(fn: Any) -> float:
        n = PING_CALLS
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        return (time.perf_counter_ns() - t0) / n

    def timed_loop() -> float:
        n = PING_CALLS
        t0 = time.perf_counter_ns()
        for _ in range(n):
            pass
        return (time.perf_counter_ns() - t0) / n

    @inprocess.Wrapper()
    def measure(call_wrapper: inprocess.CallWrapper = None) -> dict[str, list[float]]:
        native = call_wrapper._runtime.heartbeat.ping  # the binding ping() calls; private, for the breakdown only
        res: dict[str, list[float]] = {"ping": [], "empty_function": [], "native_ping": [], "empty_loop": []}
        for _ in range(batches):  # interleaved, so that all four see the same noise
            res["ping"].append(timed(call_wrapper.ping))
            res["empty_function"].append(timed(empty))
            res["native_ping"].append(timed(native))
            res["empty_loop"].append(timed_loop())
        return res

    return measure()


# -- the driver ---------------------------------------------------------------------


def run_job(role: str, world_size: int, tmp: pathlib.Path, tag: str, timeout: float, **env: str) -> list[dict]:
    """One job, always reaped: LocalJob kills each rank's process group (monitors, store host)."""
    from inprocess.launch import LocalJob

    out = tmp / tag
    out.mkdir()
    # One intra-op thread per rank, as torchrun sets for several ranks per node: with
    # torch's default (one per core) 4 ranks on 2 cores spin against each other and a
    # step takes ~40 ms instead of ~9 ms here, all of it scheduling noise.
    print(f"job {tag} ({role}) ...", file=sys.stderr, flush=True)  # progress; results on stdout
    full_env = {"OVERHEAD_ROLE": role, "OVERHEAD_OUT": str(out), "OMP_NUM_THREADS": "1", **env}
    with LocalJob([str(pathlib.Path(__file__).resolve())], world_size, env=full_env) as job:
        job.wait(timeout=timeout)
    bad = [rp for rp in job.ranks if rp.returncode != 0 or not (out / f"rank{rp.rank}.json").exists()]
    if bad:
        raise RuntimeError(f"{tag} failed:\n{job.outputs()[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def main() -> None:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    from inprocess.launch import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of one wrapped and one plain segment (default 8)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per segment (default 300)")
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps first in each segment (default 30)")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=7, help="ping batches of 1,000,000 calls (default 7)")
    ap.add_argument("--job-timeout", type=float, default=240.0, help="seconds per job (default 240)")
    ap.add_argument("--smoke", action="store_true", help="one short round and ping batch: seconds")
    args = ap.parse_args()
    if args.smoke:
        args.rounds = 1
        args.steps = 10
        args.warmup = 2
        args.batches = 1
    if min(args.rounds, args.steps, args.world_size, args.batches) < 1 or args.warmup < 0:
        raise SystemExit("--rounds, --steps, --world-size, --batches must be >= 1, --warmup >= 0")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="inprocess-overhead-"))
    t_start = time.monotonic()
    # Round "-1" warms both paths up (first process group, first wrapped call, allocator)
    # and is left out: the first segment of a process is the slowest, whichever it is.
    orders = ["PW"] + ["WP" if k % 2 == 0 else "PW" for k in range(args.rounds)]
    try:
        ranks = run_job(
            "alternate", args.world_size, tmp, "alternate", args.job_timeout,
            OVERHEAD_STEPS=str(args.steps), OVERHEAD_WARMUP=str(args.warmup), OVERHEAD_ORDERS=",".join(orders),
            OVERHEAD_PLAIN_PORT=str(free_port()),
            OVERHEAD_WRAPPED_PORTS=",".join(str(free_port()) for _ in range(len(orders))),
        )
        ping = run_job("ping", 1, tmp, "ping", args.job_timeout, OVERHEAD_BATCHES=str(args.batches))[0]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def us(seg: dict[str, Any]) -> float:
        return statistics.median(seg["times_ns"]) / 1e3

    def cpu_us(k: int, mode: str) -> float:  # median over ranks of CPU per step in segment k
        return statistics.median(r[mode][k]["cpu_ns_per_step"] for r in ranks) / 1e3

    for r in ranks:  # drop the warm-up round
        r["wrapped"], r["plain"] = r["wrapped"][1:], r["plain"][1:]
    orders = orders[1:]
    w = [us(t) for t in ranks[0]["wrapped"]]
    p = [us(t) for t in ranks[0]["plain"]]
    cw = [cpu_us(k, "wrapped") for k in range(args.rounds)]
    cp = [cpu_us(k, "plain") for k in range(args.rounds)]
    cpu_ratio = statistics.median(cw) / statistics.median(cp)

    def by_thread(mode: str, cls: str) -> float:  # median over rounds of the median over ranks, us
        return statistics.median(
            statistics.median(r[mode][k]["cpu_ns_per_step_by_thread"][cls] for r in ranks)
            for k in range(args.rounds)) / 1e3

    threads = {m: {c: by_thread(m, c) for c in ("main", "gloo", "other")} for m in ("wrapped", "plain")}
    lockstep = {m: [[round(us(t), 1) for t in r[m]] for r in ranks] for m in ("wrapped", "plain")}
    ratios = [a / b for a, b in zip(w, p, strict=True)]
    slower = sum(1 for x in ratios if x > 1)
    ratio = statistics.median(w) / statistics.median(p)
    noise = (max(p) - min(p)) / statistics.median(p)
    no_difference = min(ratios) <= 1.0 <= max(ratios) or abs(ratio - 1) <= noise
    verdict = ("PASS: no difference resolved" if no_difference else
               "FAIL: wrapped measurably slower" if ratio > 1 else
               "INCONCLUSIVE: wrapped measurably faster, so the noise is larger than these rounds show")
    ping_ns = {k: statistics.median(v) for k, v in ping.items()}

    print(f"(a) step time, {args.world_size} ranks gloo DDP (demo MLP), {args.rounds} rounds x "
          f"{args.steps} timed steps per segment, alternated in the same processes; rank 0's median step")
    print(f"  {'round':>6s} {'order':>5s} {'wrapped':>11s} {'plain':>11s} {'ratio':>7s}   "
          f"{'CPU/step: wrapped':>17s} {'plain':>9s}")
    for k in range(args.rounds):
        print(f"  {k:6d} {orders[k]:>5s} {w[k]:8.1f} us {p[k]:8.1f} us {ratios[k]:7.3f}   "
              f"{cw[k]:14.1f} us {cp[k]:6.1f} us")
    print(f"  {'median':>6s} {'':>5s} {statistics.median(w):8.1f} us {statistics.median(p):8.1f} us {ratio:7.3f}   "
          f"{statistics.median(cw):14.1f} us {statistics.median(cp):6.1f} us  (CPU ratio {cpu_ratio:.3f})")
    print(f"  per-round ratios {min(ratios):.3f}-{max(ratios):.3f}, median {statistics.median(ratios):.3f}; "
          f"wrapped slower in {slower}/{args.rounds} rounds")
    print(f"  noise floor (plain segments among themselves, (max-min)/median): {noise * 100:.1f} %; "
          f"wrapped vs plain: {(ratio - 1) * 100:+.1f} %")
    print("  CPU per step by thread (median over rounds and ranks): "
          + "; ".join(f"{c} {threads['wrapped'][c]:.1f} vs {threads['plain'][c]:.1f} us"
                      for c in ("main", "gloo", "other")) + "  (wrapped vs plain)")
    print(f"  target: no measurable difference -> {verdict}")
    print(f"(b) cost per call, median of {args.batches} batches of {PING_CALLS:,} calls (loop included)")
    for k, label in (("ping", "call_wrapper.ping()"), ("native_ping", "HeartbeatPage.ping (binding)"),
                     ("empty_function", "empty Python function"), ("empty_loop", "empty loop iteration")):
        print(f"  {label:30s} {ping_ns[k]:7.1f} ns")
    print(f"  ping() net of the loop: {ping_ns['ping'] - ping_ns['empty_loop']:.1f} ns; "
          f"target < 1000 ns -> {'PASS' if ping_ns['ping'] < 1000 else 'FAIL'}")
    print(json.dumps({
        "benchmark": "overhead", "world_size": args.world_size, "rounds": args.rounds, "steps": args.steps,
        "orders": orders, "step_median_us": {"wrapped": w, "plain": p}, "ratio_of_medians": ratio,
        "round_ratios": ratios, "rounds_wrapped_slower": slower, "plain_noise_floor": noise,
        "no_measurable_difference": no_difference,
        "cpu_us_per_step": {"wrapped": cw, "plain": cp}, "cpu_ratio_of_medians": cpu_ratio,
        "cpu_us_per_step_by_thread": threads, "verdict": verdict,
        "rank_segment_medians_us": lockstep,
        "per_call_ns_median": ping_ns, "per_call_ns_batches": ping, "wall_s": time.monotonic() - t_start,
    }))


if __name__ == "__main__":
    if os.environ.get("OVERHEAD_ROLE"):
        rank_main()
    else:
        main()
