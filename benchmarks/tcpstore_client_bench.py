"""Torch-free TCPStore client vs. torch's client: per-op latency and process memory.

Both clients talk to the same torch TCPStore server (in this process, on
127.0.0.1), for each server backend. Operations are timed one by one, the two
clients alternating in blocks so that both see the same machine noise; the
table gives the median per op and the ratio ours / torch's. Then the memory of
a fresh process that imports a client and opens one connection: ours, torch's
(``import torch.distributed``), and a bare interpreter for reference; RSS and
USS (memory unique to the process) by psutil, median of a few processes.

Run: ``python benchmarks/tcpstore_client_bench.py [--ops 2000] [--procs 3]``

Figures (2-core shared gVisor VM, torch 2.13.0+cpu, Python 3.11.7, default
arguments), two runs one after the other; medians in microseconds:

                    run 1                          run 2
    backend  op     ours_us  torch_us  ratio         ours_us  torch_us  ratio
    libuv    set        6.2       4.8   1.30                  7.1       5.5   1.29
    libuv    get       44.7      38.9   1.15                139.7     128.3   1.09
    libuv    add       20.0      17.4   1.15                 76.6      65.7   1.17
    libuv    check     20.5      17.4   1.18                 69.5      59.7   1.16
    legacy   set        3.1       1.7   1.81                  3.1       1.7   1.81
    legacy   get      142.5     122.1   1.17                 44.6      37.1   1.20
    legacy   add       75.3      66.9   1.13                 21.0      18.1   1.16
    legacy   check     82.0      72.9   1.13                 21.4      18.1   1.18

The round trip itself swings between ~20 and ~70 us from one server to the
next on this machine (both clients alike); the ratio does not: ours costs
10-20 % more per round trip, and 1.3-1.8x on ``set`` (no reply, so pure
client CPU: ~1.5 us of Python per request). ``get`` is two round trips in
both clients (WAIT, then GET).

Memory of a fresh process with one open connection (MB, median of 3):

                 rss     uss
    bare        15.5     8.6   (python + psutil, no client)
    ours        18.6    11.6   torch not loaded
    torch      219.5   143.7   import torch.distributed + dist.TCPStore client
    ours / torch: rss 0.085, uss 0.080
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path

HOST = "127.0.0.1"

_CHILD = r"""
import json, sys, psutil
kind, port = sys.argv[1], int(sys.argv[2])
if kind == "ours":
    from inprocess.control.tcpstore_client import TCPStoreClient
    client = TCPStoreClient("127.0.0.1", port, timeout=60)
    client.set("mem/ours", "1")
elif kind == "torch":
    from datetime import timedelta
    import torch.distributed as dist
    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    client.set("mem/torch", "1")
info = psutil.Process().memory_full_info()
print(json.dumps({"rss": info.rss, "uss": info.uss, "torch_loaded": "torch" in sys.modules}))
"""


def time_ops(fn: Callable[[int], Any], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn(i)
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def bench_latency(port: int, n_ops: int, block: int = 100) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from inprocess.control.tcpstore_client import TCPStoreClient

    ours = TCPStoreClient(HOST, port, timeout=timedelta(seconds=60))
    theirs = dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    value = b"x" * 64
    for client, tag in ((ours, "o"), (theirs, "t")):
        client.set(f"bench/{tag}/get", value)
    ops: dict[str, dict[str, Callable[[int], Any]]] = {
        "set": {
            "ours": lambda i: ours.set(f"bench/o/set/{i % 64}", value),
            "torch": lambda i: theirs.set(f"bench/t/set/{i % 64}", value),
        },
        "get": {
            "ours": lambda i: ours.get("bench/o/get"),
            "torch": lambda i: theirs.get("bench/t/get"),
        },
        "add": {
            "ours": lambda i: ours.add("bench/o/add", 1),
            "torch": lambda i: theirs.add("bench/t/add", 1),
        },
        "check": {
            "ours": lambda i: ours.check(["bench/o/get"]),
            "torch": lambda i: theirs.check(["bench/t/get"]),
        },
    }
    rows = []
    for op, fns in ops.items():
        samples: dict[str, list[float]] = {"ours": [], "torch": []}
        for fn in fns.values():  # warm up
            time_ops(fn, 50)
        done = 0
        while done < n_ops:
            k = min(block, n_ops - done)
            for name, fn in fns.items():
                samples[name] += time_ops(fn, k)
            done += k
        med = {name: statistics.median(s) for name, s in samples.items()}
        rows.append({"op": op, "ours_us": med["ours"], "torch_us": med["torch"], "ratio": med["ours"] / med["torch"]})
    ours.close()
    ops.clear()  # the closures hold torch's client: it goes with them, and its connection closes
    return rows


def bench_memory(port: int, procs: int) -> dict[str, dict[str, float]]:
    # The children import the package this process imports (the installed one, or PYTHONPATH's): a source
    # tree put first on their path has no compiled _native unless it was built in place.
    env = dict(os.environ)
    out: dict[str, dict[str, float]] = {}
    for kind in ("bare", "ours", "torch"):
        runs = []
        for _ in range(procs):
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, kind, str(port)], capture_output=True, text=True, timeout=300, env=env
            )
            if done.returncode != 0:
                raise RuntimeError(f"{kind} child failed: {done.stderr[-2000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        out[kind] = {
            "rss_mb": statistics.median(r["rss"] for r in runs) / 2**20,
            "uss_mb": statistics.median(r["uss"] for r in runs) / 2**20,
            "torch_loaded": any(r["torch_loaded"] for r in runs),
        }
    return out


def main() -> None:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="timed operations per op kind and client")
    parser.add_argument("--procs", type=int, default=3, help="processes per memory figure")
    parser.add_argument("--smoke", action="store_true", help="few ops, one process: runs in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.ops = 50
        args.procs = 1

    import torch
    import torch.distributed as dist

    result: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "ops": args.ops,
        "latency": {},
    }
    print(f"torch {torch.__version__}, python {result['python']}, {result['cpus']} cpus, {args.ops} ops per cell\n")
    print(f"{'backend':8} {'op':6} {'ours_us':>8} {'torch_us':>9} {'ratio':>6}")
    for use_libuv in (True, False):
        backend = "libuv" if use_libuv else "legacy"
        server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=use_libuv,
                               timeout=timedelta(seconds=60))
        rows = bench_latency(server.port, args.ops)
        result["latency"][backend] = rows
        for row in rows:
            print(f"{backend:8} {row['op']:6} {row['ours_us']:8.1f} {row['torch_us']:9.1f} {row['ratio']:6.2f}")
        if use_libuv:
            memory = bench_memory(server.port, args.procs)
            result["memory"] = memory
        del server
    print(f"\nmemory of a process with one open connection (median of {args.procs}), MB:")
    print(f"{'':8} {'rss':>7} {'uss':>7}  torch loaded")
    for kind, m in result["memory"].items():
        print(f"{kind:8} {m['rss_mb']:7.1f} {m['uss_mb']:7.1f}  {m['torch_loaded']}")
    ours, torchs = result["memory"]["ours"], result["memory"]["torch"]
    print(f"ours / torch: rss {ours['rss_mb'] / torchs['rss_mb']:.3f}, uss {ours['uss_mb'] / torchs['uss_mb']:.3f}")
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
