"""Peer state (inprocess.ReplicatedState): what a snapshot costs a step, and what a takeover costs.

    python benchmarks/peer_state.py [--sizes-mb 10 100 1000] [--steps 400]
    python benchmarks/peer_state.py --smoke        # 10 MB, 40 steps: seconds

Two processes on 127.0.0.1 (gloo, a TCPStore of rank 0's), run once per part:

- **step tax**: a DDP job of 2 ranks trains the demo's MLP (32-64-1, SGD with
  momentum) and a wider one (3 x 1024, Adam: 4.2 M parameters, 50 MB of state),
  in blocks of 10 steps, alternately without a snapshot and with one
  (``commit`` at every 10th step, ``every=10``): the median block's time each
  way, the tax per step, and a snapshot's own time;
- **takeover**, per state size (one parameter of that many bytes, plain SGD: the
  state is the parameter): rank 0 holds a committed snapshot, rank 1 none; both
  call ``restore()``: rank 1's time and the transfer's MB/s, rank 1's peak memory
  above its model (the received snapshot: chunks, never a second copy), against
  the same state loaded by rank 1 from a ``torch.save`` file on local disk
  (written before the timing: the page cache is warm, which favours the disk).

Prints a table and one JSON line; writes only into a temporary folder it removes.
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
from typing import Any, Dict, List

import reaping  # benchmarks/reaping.py: this script's folder is first on the path


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _group(rank: int, port: int) -> Any:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # two ranks share the cores, as torchrun sets it
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    return dist


MODELS = (("demo MLP", [32, 64, 1], False), ("3 x 1024 MLP, Adam", [1024, 1024, 1024, 1024], True))


def _tax_of(dist: Any, widths: List[int], adam: bool, steps: int) -> Dict[str, float]:
    import torch

    import inprocess

    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.Adam(model.parameters()) if adam else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = inprocess.ReplicatedState(model=model, optimizer=opt, every=10, rng=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.randn(64, widths[0])

    def step() -> None:
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(20):  # warm-up, and the optimizer's state exists before the first snapshot
        step()
    plain: List[float] = []
    snapped: List[float] = []
    snapshot_ms: List[float] = []
    for block in range(max(2, steps // 20)):
        for with_snapshot in (False, True):
            t = time.perf_counter()
            for i in range(10):
                step()
                if with_snapshot:
                    c = time.perf_counter()
                    if state.commit(block * 10 + i + 1):  # every=10: the block's last step snapshots
                        snapshot_ms.append(1e3 * (time.perf_counter() - c))
            (snapped if with_snapshot else plain).append(time.perf_counter() - t)
        dist.barrier()
    p, s = statistics.median(plain), statistics.median(snapped)
    return {"step_ms": 1e3 * p / 10, "tax_pct": 100 * (s - p) / p, "snapshot_ms": statistics.median(snapshot_ms),
            "state_mb": state.nbytes / 2**20}


def role_tax(rank: int, port: int, steps: int) -> Dict[str, Any]:
    dist = _group(rank, port)
    out = {name: _tax_of(dist, widths, adam, steps) for name, widths, adam in MODELS}
    dist.destroy_process_group()
    return out


def role_takeover(rank: int, port: int, size_mb: float, folder: str) -> Dict[str, Any]:
    import torch

    import inprocess

    n = int(size_mb * 2**20) // 4
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.full((n,), 0.5) if rank else torch.randn(n))  # pages touched
    state = inprocess.ReplicatedState(model=model, rng=False)
    path = pathlib.Path(folder) / "checkpoint.pt"
    out: Dict[str, Any] = {"size_mb": size_mb}
    dist = _group(rank, port)
    if rank == 0:
        state.commit(7)
        torch.save(model.state_dict(), path)  # the storage checkpoint of the same state
    dist.barrier()
    base = _peak_rss_mb()
    t = time.perf_counter()
    step = state.restore()
    out["restore_s"] = time.perf_counter() - t
    out["step"] = step
    out["peak_above_mb"] = _peak_rss_mb() - base
    if rank == 1:
        ok = bool(torch.equal(model.weight.detach(), torch.load(path)["weight"]))
        out["equal"] = ok
        t = time.perf_counter()
        model.load_state_dict(torch.load(path))
        out["disk_s"] = time.perf_counter() - t
        out["mb_per_s"] = size_mb / out["restore_s"]
    dist.barrier()
    dist.destroy_process_group()
    return out


def run_pair(args: List[str], timeout: float) -> List[Dict[str, Any]]:
    from inprocess.launch import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, __file__, "--role", *args, "--rank", str(r), "--port", port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
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


def main() -> int:
    reaping.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100, 1000], help="takeover state sizes")
    parser.add_argument("--steps", type=int, default=400, help="steps per model in the tax part (default 400)")
    parser.add_argument("--smoke", action="store_true", help="10 MB and 40 steps: checks that it works")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if args.role[0] == "tax":
            result = role_tax(args.rank, args.port, int(args.role[1]))
        else:
            result = role_takeover(args.rank, args.port, float(args.role[1]), args.role[2])
        print(json.dumps(result), flush=True)
        return 0
    if args.smoke:
        args.sizes_mb, args.steps = [10.0], 40
    if any(s <= 0 for s in args.sizes_mb) or args.steps < 20:
        parser.error(f"--sizes-mb {args.sizes_mb} --steps {args.steps}: expected sizes > 0 and steps >= 20")
    tax = run_pair(["tax", str(args.steps)], timeout=600)[0]
    print(f"step tax of a snapshot every 10 steps (2 ranks, DDP over gloo, {os.cpu_count()} cpus, "
          f"load {os.getloadavg()[0]:.1f})")
    for name, row in tax.items():
        print(f"  {name:22s} state {row['state_mb']:6.1f} MB  step {row['step_ms']:7.2f} ms  "
              f"snapshot {row['snapshot_ms']:7.2f} ms  tax {row['tax_pct']:+6.2f} % per step")
    takeovers = []
    with tempfile.TemporaryDirectory(prefix="inprocess-peer-state-") as folder:
        for size in args.sizes_mb:
            holder, newcomer = run_pair(["takeover", str(size), folder], timeout=600)
            if newcomer["step"] != 7 or not newcomer["equal"]:
                raise RuntimeError(f"the newcomer resumed at {newcomer['step']}, equal={newcomer['equal']}")
            takeovers.append(newcomer)
    print("\ntakeover: a newcomer's state from a peer (restore) against the same state from local disk")
    print("    MB   restore s    MB/s   peak above model MB   torch.load + load_state_dict s")
    for row in takeovers:
        print(f"{row['size_mb']:6.0f}   {row['restore_s']:9.3f}  {row['mb_per_s']:6.0f}   {row['peak_above_mb']:19.0f}"
              f"   {row['disk_s']:.3f}")
    print(json.dumps({"benchmark": "peer_state", "load_average": os.getloadavg()[0], "tax": tax,
                      "takeover": takeovers}, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
