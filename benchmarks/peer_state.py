"""Peer state: what a takeover's transfer reaches against the link, for 1 and 8 newcomers, and
what a snapshot costs a step.

    python benchmarks/peer_state.py [--sizes-mb 10 100 1000] [--newcomers 1 8] [--repeats 3] [--steps 200]
        [--parts transfer tax] [--link-mbit 400]
    python benchmarks/peer_state.py --smoke        # 10 MB, 1 and 2 newcomers, 40 steps: seconds

Every part runs its own processes on 127.0.0.1 (gloo, a TCPStore of rank 0's), each rank with
``torch.set_num_threads(1)``:

- **transfer**, per state size (one parameter of that many bytes, plain SGD: the state is the
  parameter, built and touched by every rank before the timing, as a newcomer's model is):
  rank 0 holds a committed snapshot, ranks 1..n none (``n`` newcomers); all call
  ``ReplicatedState.restore()``; the newcomers' slowest time, against **the link**: the same
  bytes sent by torch.distributed's point-to-point calls, as the transport sends them (chunks
  of ``chunk_bytes``, every send posted at once, every receive posted at once) from rank 0's
  snapshot into rank 1's parameter, in the same job. Link and restore alternate ``--repeats``
  times; medians. Peak memory: a newcomer's high-water mark (VmHWM) above its model, and the
  holder's, during the first restore. For 1 newcomer, the same state loaded by rank 1 from a
  ``torch.save`` file written just before (warm page cache: the disk's best case).
- **step tax**: a 2-rank DDP job trains the 36 MB Adam MLP (3 x 1024) in blocks of 10 steps,
  rotating through: no snapshot, a snapshot every 10th step, every step (``commit`` copies on the
  training thread), every step with ``snapshots="background"`` (the optimizer's tensors copied
  on a thread of its own while the next step's forward and backward run), every step with
  ``snapshots="live"`` (not copied: the snapshot refers to them until the next optimizer step):
  the median block each way, the tax per step against no snapshot, and the commit's own time on
  the training thread.

Prints tables and one JSON line; writes only into a temporary folder it removes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

from typing_extensions import Self

import reaping  # benchmarks/reaping.py: this script's folder is first on the path


def _high_water_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _group(rank: int, world: int, port: int) -> Any:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # host 0's address with --link-mbit
    store = dist.TCPStore(host, port, world, rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    return dist


def _bytes_of(t: Any) -> Any:
    """A CPU tensor's memory as a buffer (no copy; torch's CPU wheel has no numpy)."""
    import ctypes

    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def _link(dist: Any, rank: int, data: Any, chunk: int) -> float:
    """Rank 0's `data` into rank 1's (same size), as the transport moves bytes to one receiver
    (its chunks): seconds."""
    from inprocess.peer_state import ProcessGroupTransport

    pieces = ProcessGroupTransport(None, chunk).chunks(data, 1)
    dist.barrier()
    started = time.perf_counter()
    if rank == 0:
        works = [dist.isend(p, 1) for p in pieces]
    elif rank == 1:
        works = [dist.irecv(p, 0) for p in pieces]
    else:
        works = []
    for w in works:
        w.wait()
    seconds = time.perf_counter() - started
    dist.barrier()
    return seconds


def role_transfer(rank: int, world: int, port: int, size_mb: float, repeats: int, folder: str) -> dict[str, Any]:
    import torch

    import inprocess

    n = int(size_mb * 2**20) // 4
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(n) if rank == 0 else torch.full((n,), 0.5))  # pages touched
    flat = model.weight.detach().view(torch.uint8)
    dist = _group(rank, world, port)
    state = inprocess.ReplicatedState(model=model, rng=False)
    if rank == 0:
        state.commit(7)
    base = _high_water_mb()
    out: dict[str, Any] = {"rank": rank, "size_mb": size_mb, "link_s": [], "restore_s": []}
    for trial in range(repeats):
        if rank > 0:  # a newcomer again: a state without snapshots
            state = inprocess.ReplicatedState(model=model, rng=False)
        dist.barrier()
        started = time.perf_counter()
        step = state.restore()
        out["restore_s"].append(time.perf_counter() - started)
        if trial == 0:
            out["peak_above_model_mb"] = _high_water_mb() - base
        assert step == 7, step
        if rank == 0:
            held = state._own[0]  # the snapshot the restore sent, as the link's source
            assert held is not None
            source = held.tensors[0].view(torch.uint8)
        out["link_s"].append(_link(dist, rank, source if rank == 0 else flat, state.chunk_bytes))
    crc = torch.tensor([zlib.crc32(_bytes_of(flat))], dtype=torch.int64)
    crcs = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(crcs, crc)  # every rank's parameter, by its CRC-32: no second copy of it in memory
    out["equal"] = len({int(c) for c in crcs}) == 1
    if rank == 1 and world == 2:
        path = pathlib.Path(folder) / "checkpoint.pt"
        torch.save({"weight": model.weight.detach()}, path)
        started = time.perf_counter()
        model.load_state_dict(torch.load(path))
        out["disk_s"] = time.perf_counter() - started
    dist.destroy_process_group()
    return out


MODES = (("none", 0, "copy"), ("every 10", 10, "copy"), ("every 1", 1, "copy"),
         ("every 1, background", 1, "background"), ("every 1, live", 1, "live"))


def role_tax(rank: int, port: int, steps: int) -> dict[str, Any]:
    import torch

    import inprocess

    dist = _group(rank, 2, port)
    torch.manual_seed(0)
    widths = [1024, 1024, 1024, 1024]
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    optimizer = torch.optim.Adam(model.parameters())
    states = {name: inprocess.ReplicatedState(model=model, optimizer=optimizer, every=every, rng=False,
                                              snapshots=snapshots)
              for name, every, snapshots in MODES if every}
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.randn(64, widths[0])
    blocks: dict[str, list[float]] = {name: [] for name, _, _ in MODES}
    snapshot_ms: dict[str, list[float]] = {name: [] for name, _, _ in MODES}
    step = 0
    for block in range(-2, max(2, steps // (10 * len(MODES)))):  # two blocks of each to warm up
        for name, _, _ in MODES:
            started = time.perf_counter()
            for _ in range(10):
                loss = ddp(x).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                if name in states:
                    c = time.perf_counter()
                    if states[name].commit(step):
                        snapshot_ms[name].append(1e3 * (time.perf_counter() - c))
            for state in states.values():
                state.wait_copy()  # a background copy ends in its own block
            if block >= 0:
                blocks[name].append(time.perf_counter() - started)
            dist.barrier()
    plain = statistics.median(blocks["none"])
    out = {"state_mb": next(iter(states.values())).nbytes / 2**20, "step_ms": 1e3 * plain / 10}
    for name, _, _ in MODES[1:]:
        out[name] = {"tax_pct": 100 * (statistics.median(blocks[name]) - plain) / plain,
                     "commit_ms": statistics.median(snapshot_ms[name]) if snapshot_ms[name] else 0.0}
    dist.destroy_process_group()
    return out


class ShapedHosts:
    """One network namespace per rank ("a host"), each with a veth link to a bridge in a switch
    namespace, shaped both ways (tc tbf) to `mbit`: a host's link, not the machine's CPU,
    bounds what it sends and receives, as a node's network card does. Needs root and iproute2."""

    def __init__(self, hosts: int, mbit: int) -> None:
        tag = f"ps{os.getpid() % 100000}"
        self.switch, self.names = f"{tag}sw", [f"{tag}h{i}" for i in range(hosts)]
        self.addresses = [f"10.214.{i // 200}.{i % 200 + 1}" for i in range(hosts)]
        self.mbit = mbit

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def __enter__(self) -> Self:
        shape = ["root", "tbf", "rate", f"{self.mbit}mbit", "burst", "1mb", "latency", "200ms"]
        self._ip("netns", "add", self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            port = f"p{i}"
            self._ip("netns", "add", name)
            self._ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", port)
            self._ip("-n", name, "link", "set", port, "netns", self.switch)
            self._ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            self._ip("-n", name, "addr", "add", f"{self.addresses[i]}/16", "dev", "eth0")
            for ns, dev in ((name, "eth0"), (name, "lo"), (self.switch, port)):
                self._ip("-n", ns, "link", "set", dev, "up")
            for ns, dev in ((name, "eth0"), (self.switch, port)):
                done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, *shape],
                                      capture_output=True, text=True, timeout=30)
                if done.returncode != 0:
                    raise RuntimeError(f"tc on {ns}/{dev}: {done.stderr.strip()}")
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def command(self, rank: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[rank], *argv]

    def environment(self) -> dict[str, str]:
        return dict(os.environ, MASTER_ADDR=self.addresses[0], GLOO_SOCKET_IFNAME="eth0")


HOSTS: list[ShapedHosts] = []  # --link-mbit: the hosts of the job running now


def run_ranks(args: list[str], world: int, timeout: float) -> list[dict[str, Any]]:
    from inprocess.launch import free_port

    port = str(free_port())
    argv = [[sys.executable, __file__, "--role", *args, "--rank", str(r), "--world", str(world), "--port", port]
            for r in range(world)]
    hosts = HOSTS[-1] if HOSTS else None
    procs = [subprocess.Popen(hosts.command(r, a) if hosts else a, env=hosts.environment() if hosts else None,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, a in enumerate(argv)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, stderr) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a rank ended {p.returncode}: {stderr[-3000:]}")
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outs]


def transfer(size: float, newcomers: int, repeats: int, folder: str, mbit: int) -> dict[str, Any]:
    if mbit:
        with ShapedHosts(newcomers + 1, mbit) as hosts:
            HOSTS.append(hosts)
            try:
                ranks = run_ranks(["transfer", str(size), str(repeats), folder], newcomers + 1, timeout=1800)
            finally:
                HOSTS.pop()
    else:
        ranks = run_ranks(["transfer", str(size), str(repeats), folder], newcomers + 1, timeout=900)
    if not all(r["equal"] for r in ranks):
        raise RuntimeError(f"a newcomer's state differs from the holder's ({size} MB, {newcomers} newcomers)")
    slowest = [max(r["restore_s"][t] for r in ranks[1:]) for t in range(repeats)]
    link = statistics.median(ranks[1]["link_s"])
    restore = statistics.median(slowest)
    row = {"size_mb": size, "newcomers": newcomers, "link_s": link, "restore_s": restore,
           "link_mb_s": size / link, "restore_mb_s": size / restore, "of_link_pct": 100 * link / restore,
           "newcomer_peak_mb": max(r["peak_above_model_mb"] for r in ranks[1:]),
           "holder_peak_mb": ranks[0]["peak_above_model_mb"], "restore_all_s": slowest}
    if "disk_s" in ranks[1]:
        row["disk_s"] = ranks[1]["disk_s"]
    return row


def main() -> int:
    reaping.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100, 1000], help="state sizes")
    parser.add_argument("--newcomers", type=int, nargs="+", default=[1, 8], help="newcomers per restore")
    parser.add_argument("--repeats", type=int, default=3, help="link and restore trials per job (medians)")
    parser.add_argument("--steps", type=int, default=200, help="steps in the tax part, all modes together")
    parser.add_argument("--link-mbit", type=int, default=0,
                        help="transfer part only, each rank a host of its own with a link of this rate (netns, tc: "
                             "needs root); default: every rank on 127.0.0.1")
    parser.add_argument("--parts", nargs="+", choices=["transfer", "tax"], default=["transfer", "tax"],
                        help="which parts to run (default both)")
    parser.add_argument("--smoke", action="store_true", help="10 MB, 1 and 2 newcomers, 40 steps: checks that it works")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if args.role[0] == "tax":
            result = role_tax(args.rank, args.port, int(args.role[1]))
        else:
            result = role_transfer(args.rank, args.world, args.port, float(args.role[1]), int(args.role[2]),
                                   args.role[3])
        print(json.dumps(result), flush=True)
        return 0
    if args.smoke:
        args.sizes_mb, args.newcomers, args.steps, args.repeats = [10.0], [1, 2], 40, 2
    if any(s <= 0 for s in args.sizes_mb) or args.steps < 40 or min(args.newcomers) < 1 or args.repeats < 1:
        parser.error(f"--sizes-mb {args.sizes_mb} --newcomers {args.newcomers} --steps {args.steps} --repeats "
                     f"{args.repeats}: expected sizes > 0, newcomers >= 1, steps >= 40, repeats >= 1")
    load = [os.getloadavg()[0]]
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="inprocess-peer-state-") as folder:
        for size in args.sizes_mb if "transfer" in args.parts else []:
            for newcomers in args.newcomers:
                need = (newcomers + 2) * size * 1.3 + 4096  # and room left for the machine's other users
                if need > _available_mb():
                    skipped.append(f"{size:g} MB x {newcomers} newcomers: needs ~{need:.0f} MB, "
                                   f"{_available_mb():.0f} MB available")
                    continue
                rows.append(transfer(size, newcomers, args.repeats, folder, args.link_mbit))
    tax = run_ranks(["tax", str(args.steps)], 2, timeout=1200)[0] if "tax" in args.parts else None
    load.append(os.getloadavg()[0])
    where = f"each rank a host, links of {args.link_mbit} Mbit/s each way" if args.link_mbit else "127.0.0.1"
    print(f"transfer: rank 0 holds the state, n newcomers restore it (gloo, {where}, {os.cpu_count()} cpus, load "
          f"average {load[0]:.1f} before, {load[1]:.1f} after); medians of {args.repeats}")
    print("     MB  newcomers   link s   restore s   link MB/s   restore MB/s   of link   newcomer peak MB   "
          "holder peak MB   disk s")
    for r in rows:
        disk = f"{r['disk_s']:.3f}" if "disk_s" in r else "-"
        print(f"{r['size_mb']:7.0f}  {r['newcomers']:9d}  {r['link_s']:7.3f}  {r['restore_s']:10.3f}  "
              f"{r['link_mb_s']:10.0f}  {r['restore_mb_s']:13.0f}  {r['of_link_pct']:7.0f} %  "
              f"{r['newcomer_peak_mb']:17.0f}  {r['holder_peak_mb']:15.0f}   {disk}")
    for size in args.sizes_mb:
        by = {r["newcomers"]: r["restore_s"] for r in rows if r["size_mb"] == size}
        if 1 in by and len(by) > 1:
            print(f"  {size:g} MB: " + ", ".join(f"{n} newcomers {t / by[1]:.2f} x one" for n, t in by.items()
                                                   if n != 1))
    for line in skipped:
        print(f"  skipped: {line}")
    if tax is not None:
        _print_tax(tax)
    print(json.dumps({"benchmark": "peer_state", "load_average": load, "link_mbit": args.link_mbit, "transfer": rows,
                      "tax": tax, "skipped": skipped}, separators=(",", ":")), flush=True)
    return 0


def _print_tax(tax: dict[str, Any]) -> None:
    print(f"\nstep tax, 2 ranks DDP, {tax['state_mb']:.0f} MB Adam MLP, step {tax['step_ms']:.1f} ms without snapshots")
    for name, _, _ in MODES[1:]:
        print(f"  {name:20s} tax {tax[name]['tax_pct']:+6.2f} %   commit on the training thread "
              f"{tax[name]['commit_ms']:6.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
