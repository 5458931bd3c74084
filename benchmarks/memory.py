"""Resident memory that native monitoring adds, per rank and per node.

    python benchmarks/memory.py [--jobs 2] [--world-size 4]

A 4-rank gloo job on 127.0.0.1 trains the DDP MLP of examples/demo.py for a
few steps, then every rank parks (a loop that sleeps 20 ms and pings) while
this script reads, with psutil ``memory_full_info()`` (from /proc/<pid>/smaps):

- RSS: resident pages, shared ones (libtorch, libpython) counted in full;
- USS: pages unique to the process (what its exit would give back);
- PSS: shared pages divided among the processes sharing them (the per-node
  figures add up PSS, which counts each shared page once per node).

Processes read:

- each rank process, in a wrapped job (inprocess.Wrapper, default timeouts)
  and in the same job unwrapped (plain init_process_group, no inprocess
  import); wrapped minus plain is what the wrapper adds inside the rank
  (the inprocess modules and native extension, the heartbeat page, the
  watchdog and restart-trigger threads, the extra store connections);
- each rank's monitor process (``python -m inprocess.processes.monitor``, a child of
  the rank process), and the store host, where the library starts one, once per job:
  a child of rank 0 forked without exec, named ``inprocess-store`` (its command line
  is the rank's), or ``python -m inprocess.processes.store_host`` where it is started so;
- for comparison, a process that imports torch (``python -c "import torch"``,
  what a monitor that imported torch would weigh at least) and a bare
  interpreter (``python -c ...``), both parked on stdin. Their RSS is the
  stable figure: their USS and PSS depend on which other processes of the
  machine map the same libraries at that moment (torch processes of other
  jobs on a shared machine make them smaller).

The jobs alternate wrapped, plain, wrapped, plain (--jobs of each); figures
are medians over ranks and jobs. In-rank additions: wrapped minus plain rank,
by USS (a rank's PSS shifts with how many processes share its libraries, and
the wrapper's children share them). Per node: the sum over all the job's
processes, wrapped minus plain, by PSS (which counts each shared page once). The heartbeat page is also read directly
from the rank's memory map (``memfd:inprocess-heartbeat``), and the thread
counts of wrapped and plain ranks are given. Prints a table and one JSON line.
Every child is reaped (process groups killed) and every wait is time-limited.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path

HERE = pathlib.Path(__file__).resolve().parent

MB = 1024 * 1024
PARK_LIMIT_S = 120.0  # a parked rank gives up after this long, released or not


# -- one rank (run with MEMORY_ROLE set) -------------------------------------------


def train_and_park(rank: int, world_size: int, out: pathlib.Path, ping: Any) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step in range(20):
        ping()
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, 32, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), torch.sin(x.sum(dim=1, keepdim=True))).backward()
        opt.step()
    (out / f"ready{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + PARK_LIMIT_S
    while not (out / "release").exists() and time.monotonic() < deadline:
        ping()
        time.sleep(0.02)


def rank_main() -> None:
    import torch.distributed as dist

    role = os.environ["MEMORY_ROLE"]
    out = pathlib.Path(os.environ["MEMORY_OUT"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=30)
    if role == "plain":
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
        train_and_park(rank, world_size, out, lambda: None)
        dist.destroy_process_group()
    else:
        import inprocess

        @inprocess.Wrapper()
        def wrapped(call_wrapper: inprocess.CallWrapper = None) -> None:
            me = call_wrapper.frozen_state
            dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank,
                                    world_size=me.active_world_size, timeout=timeout)
            train_and_park(me.active_rank, me.active_world_size, out, call_wrapper.ping)
            dist.destroy_process_group()

        wrapped()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's teardown, which sometimes aborts in gloo (not what is measured)


# -- measuring -------------------------------------------------------------------------


def mem(proc: Any) -> dict[str, float]:
    m = proc.memory_full_info()
    return {"rss": m.rss / MB, "uss": m.uss / MB, "pss": m.pss / MB}


def heartbeat_mapping(proc: Any) -> dict[str, float] | None:
    """The heartbeat memfd in the rank's memory map: how many mappings, their size and RSS."""
    maps = [m for m in proc.memory_maps(grouped=False) if "inprocess-heartbeat" in m.path]
    if not maps:
        return None
    return {"mappings": len(maps), "rss_kb": sum(m.rss for m in maps) / 1024,
            "size_kb": sum(int(m.addr.split("-")[1], 16) - int(m.addr.split("-")[0], 16) for m in maps) / 1024}


# The store host is forked from the rank without exec (inprocess/processes/forked.py): its command
# line is the rank's, only its name (comm, what ``ps -o comm`` shows) tells it apart.
STORE_HOST_COMM = "inprocess-store"


def role_of(proc: Any) -> str | None:
    cmd = " ".join(proc.cmdline())
    if "inprocess.processes.monitor" in cmd:
        return "monitor"
    if "inprocess.processes.store_host" in cmd or process_comm(proc.pid) == STORE_HOST_COMM:
        return "store_host"  # started with exec (store_host's own main), or forked
    return None


def process_comm(pid: int) -> str:
    """The kernel's name of the process (/proc/<pid>/comm), not psutil's, which may substitute the command's."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def measure_job(mode: str, world_size: int, tmp: pathlib.Path, tag: str, timeout: float) -> dict[str, Any]:
    """Start a job, wait until every rank is parked, read its processes, release it; always reaped."""
    import psutil

    from inprocess.launch import LocalJob

    out = tmp / tag
    out.mkdir()
    env = {"MEMORY_ROLE": mode, "MEMORY_OUT": str(out), "OMP_NUM_THREADS": "1"}
    res: dict[str, Any] = {"ranks": [], "monitors": [], "store_hosts": [], "other_children": []}
    with LocalJob([str(pathlib.Path(__file__).resolve())], world_size, env=env) as job:
        deadline = time.monotonic() + timeout
        while not all((out / f"ready{r}").exists() for r in range(world_size)):
            dead = [rp.rank for rp in job.ranks if rp.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                job.kill()
                raise RuntimeError(f"{tag}: ranks not parked (dead: {dead}):\n{job.outputs()[-4000:]}")
            time.sleep(0.1)
        time.sleep(1.0)  # let the monitors settle (they are started before the first barrier)
        try:
            for rp in job.ranks:
                p = psutil.Process(rp.popen.pid)
                entry = {"rank": rp.rank, **mem(p), "threads": p.num_threads()}
                hb = heartbeat_mapping(p)
                if hb is not None:
                    entry["heartbeat_page"] = hb
                res["ranks"].append(entry)
                for child in p.children(recursive=True):
                    role = role_of(child)
                    row = {"rank": rp.rank, "pid": child.pid, **mem(child), "threads": child.num_threads()}
                    if role == "monitor":
                        res["monitors"].append(row)
                    elif role == "store_host":
                        res["store_hosts"].append(row)
                    else:
                        res["other_children"].append({**row, "cmd": " ".join(child.cmdline())[:120]})
        finally:
            (out / "release").write_text("")
        try:
            job.wait(timeout=60)
        except TimeoutError:
            res["note"] = "did not finish after release (killed)"
    return res


def parked_python(code: str, timeout: float) -> dict[str, float]:
    """Memory of ``python -c code`` once it printed 'ready' and waits on stdin; always reaped."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        import select

        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready or proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError(f"python -c {code!r} did not get ready within {timeout:g} s")
        return mem(psutil.Process(proc.pid))
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows]
    return statistics.median(vals) if vals else None


def main() -> None:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="jobs of each mode, alternated (default 2)")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--job-timeout", type=float, default=90.0, help="seconds for a job's ranks to park (default 90)")
    ap.add_argument("--smoke", action="store_true", help="one job of each mode, to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.jobs = 1
    if args.jobs < 1 or args.world_size < 1:
        raise SystemExit("--jobs and --world-size must be >= 1")
    t_start = time.monotonic()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="inprocess-memory-"))
    jobs: dict[str, list[dict]] = {"wrapped": [], "plain": []}
    try:
        for k in range(args.jobs):
            for mode in ("wrapped", "plain"):
                print(f"{mode} job {k + 1}/{args.jobs} ...", file=sys.stderr, flush=True)  # progress; results on stdout
                jobs[mode].append(measure_job(mode, args.world_size, tmp, f"{mode}-{k}", args.job_timeout))
        torch_proc = parked_python("import sys, torch; print('ready', flush=True); sys.stdin.read()", 60)
        torch_dist = parked_python(
            "import sys, torch, torch.distributed; print('ready', flush=True); sys.stdin.read()", 60)
        bare = parked_python("import sys; print('ready', flush=True); sys.stdin.read()", 60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ranks_w = [r for j in jobs["wrapped"] for r in j["ranks"]]
    ranks_p = [r for j in jobs["plain"] for r in j["ranks"]]
    monitors = [m for j in jobs["wrapped"] for m in j["monitors"]]
    hosts = [h for j in jobs["wrapped"] for h in j["store_hosts"]]
    pages = [r["heartbeat_page"] for r in ranks_w if "heartbeat_page" in r]
    n_monitors = [len(j["monitors"]) for j in jobs["wrapped"]]
    keys = ("rss", "uss", "pss")
    rank_w = {k: med(ranks_w, k) for k in keys}
    rank_p = {k: med(ranks_p, k) for k in keys}
    added = {k: rank_w[k] - rank_p[k] for k in keys}  # type: ignore[operator]
    mon = {k: med(monitors, k) for k in keys}
    host = {k: med(hosts, k) for k in keys} if hosts else None
    ws = args.world_size

    def total(job: dict, k: str) -> float:
        return sum(r[k] for r in job["ranks"] + job["monitors"] + job["store_hosts"] + job["other_children"])

    # Per node (this job's processes all run on this one): the sum over every process of
    # the job. PSS sums count each shared page once in all; USS sums are a lower bound (pages
    # shared by two processes of the job count in neither); RSS sums count shared pages
    # once per process.
    node_w = {k: statistics.median(total(j, k) for j in jobs["wrapped"]) for k in keys}
    node_p = {k: statistics.median(total(j, k) for j in jobs["plain"]) for k in keys}
    node = {k: node_w[k] - node_p[k] for k in keys}

    def row(name: str, d: dict[str, Any] | None, note: str = "") -> None:
        if d is None:
            print(f"  {name:44s} {'-':>8s} {'-':>8s} {'-':>8s}  {note}")
            return
        print(f"  {name:44s} {d['rss']:8.1f} {d['uss']:8.1f} {d['pss']:8.1f}  {note}")

    print(f"resident memory, {ws}-rank gloo DDP job, MB (median over {len(ranks_w)} wrapped / {len(ranks_p)} plain "
          f"ranks, {len(monitors)} monitors, {args.jobs} jobs of each; MB = MiB)")
    print(f"  {'process':44s} {'RSS':>8s} {'USS':>8s} {'PSS':>8s}")
    row("rank, wrapped", rank_w, f"threads {med(ranks_w, 'threads'):.0f}")
    row("rank, plain (no inprocess)", rank_p, f"threads {med(ranks_p, 'threads'):.0f}")
    row("  in-rank additions (wrapped - plain)", added, "USS is the meaningful column (PSS shifts with sharing)")
    row("monitor process (per rank)", mon, f"monitors found per job: {n_monitors}")
    row("store host (once per job)", host, "" if hosts else "none started by this library version")
    row(f"node total, wrapped (all {ws} ranks + children)", node_w)
    row(f"node total, plain ({ws} ranks)", node_p)
    row("  added per node (wrapped - plain)", node, "PSS is the meaningful column")
    row("python -c 'import torch' (parked)", torch_proc)
    row("python -c 'import torch, torch.distributed'", torch_dist)
    row("python -c '' (bare interpreter, parked)", bare)
    if pages:
        print(f"  heartbeat page in the rank: {statistics.median(p['mappings'] for p in pages):.0f} mapping(s) of "
              f"the same memfd, {statistics.median(p['size_kb'] for p in pages):.0f} kB mapped, "
              f"{statistics.median(p['rss_kb'] for p in pages):.0f} kB resident (RSS counts each mapping)")
    print(f"  monitor / torch-importing process: RSS {mon['rss'] / torch_proc['rss']:.3f}, "  # type: ignore[operator]
          f"USS {mon['uss'] / torch_proc['uss']:.3f}, PSS {mon['pss'] / torch_proc['pss']:.3f}; "  # type: ignore[operator]
          f"a torch-importing monitor would add ~{torch_proc['rss'] - mon['rss']:.0f} MB RSS per rank more")  # type: ignore[operator]
    others = [c for j in jobs["wrapped"] + jobs["plain"] for c in j["other_children"]]
    for c in others:
        print(f"  other child of rank {c['rank']}: {c['cmd']} (RSS {c['rss']:.1f} MB)")
    print(json.dumps({
        "benchmark": "memory", "world_size": ws, "jobs": args.jobs, "unit": "MiB",
        "rank_wrapped": rank_w, "rank_plain": rank_p, "in_rank_added": added, "monitor": mon,
        "store_host": host, "node_wrapped": node_w, "node_plain": node_p, "per_node_added": node,
        "import_torch": torch_proc, "import_torch_distributed": torch_dist,
        "bare_python": bare, "heartbeat_page": pages[0] if pages else None,
        "threads": {"wrapped": med(ranks_w, "threads"), "plain": med(ranks_p, "threads")},
        "raw": jobs, "wall_s": time.monotonic() - t_start,
    }))


if __name__ == "__main__":
    if os.environ.get("MEMORY_ROLE"):
        rank_main()
    else:
        main()
