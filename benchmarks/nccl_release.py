"""Where the time of an NCCL release goes on a real GPU: the library's steps against NCCL's own.

    python benchmarks/nccl_release.py [--restarts 20]     # needs an NVIDIA GPU and a CUDA build of torch
    python benchmarks/nccl_release.py --smoke             # 3 restarts; without a GPU it says so and exits 0

One rank on GPU 0 (world size 1: it runs on a one-GPU machine), two NCCL groups
(the world and one ``new_group``), one ``all_reduce`` on each, then the release
from a thread that never set a device (the restart thread's situation). Each
case runs in a fresh process:

- ``steps``: ``inprocess.gpu.nccl_abort``'s steps one by one: find torch's NCCL,
  make the rank's device current, read each group's communicator, read async
  errors, ``ncclCommRevoke`` of both as one NCCL group, then torch's ``abort()``
  of each group;
- ``torch abort alone``: torch's ``abort()`` of each group, no revoke first (what
  a release without ``ncclCommRevoke``, NCCL before 2.28.7, costs);
- ``restarts``: N cycles of ``init_process_group`` + ``all_reduce``, the
  library's whole ``release``, ``destroy_process_group``: p50/p99/max of each.

Prints a table and one JSON line; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List

import reaping  # benchmarks/reaping.py: this script's folder is first on the path

CASES = ("steps", "torch_abort_alone", "restarts")


def _init(port: int) -> Any:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0),
                            timeout=datetime.timedelta(seconds=60))
    return torch, dist


def _two_groups(torch: Any, dist: Any) -> List[Any]:
    second = dist.new_group()
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    dist.all_reduce(x, group=second)
    torch.cuda.synchronize()
    return [g._get_backend(torch.device("cuda")) for g in (dist.group.WORLD, second)]


def _on_a_fresh_thread(fn: Callable[[], Any]) -> Any:
    """`fn` on a thread that never set a CUDA device, as the restart thread."""
    out: Dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    thread = threading.Thread(target=run, name="restart-thread")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _timed(row: Dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    started = time.monotonic()
    value = fn()
    row[name] = 1e3 * (time.monotonic() - started)
    return value


def case_steps(port: int, restarts: int) -> Dict[str, Any]:
    torch, dist = _init(port)
    backends = _two_groups(torch, dist)
    from inprocess.gpu import libraries, nccl_abort

    def release() -> Dict[str, Any]:
        row: Dict[str, Any] = {}
        library, why = _timed(row, "find torch's NCCL", libraries.nccl)
        if library is None or not library.has_revoke:
            raise RuntimeError(f"no NCCL with ncclCommRevoke: {why or library.version}")
        _timed(row, "make the device current", lambda: nccl_abort._use_device(library, 0))
        comms = [_timed(row, f"read communicator {i}", lambda b=b: nccl_abort.communicator(b, 30.0))
                 for i, b in enumerate(backends)]
        pointers = [c.pointer for c in comms]
        _timed(row, "read async errors", lambda: library.async_errors(pointers, 10**10))
        outcome = _timed(row, "ncclCommRevoke, both grouped",
                         lambda: library.revoke(pointers, [c.blocking for c in comms], 30 * 10**9))
        row["revoke status"] = str(outcome.status)
        for i, b in enumerate(backends):
            _timed(row, f"torch abort() {i} after the revoke", b.abort)
        row["nccl"] = ".".join(map(str, libraries.version_tuple(library.version)))
        return row

    return _on_a_fresh_thread(release)


def case_torch_abort_alone(port: int, restarts: int) -> Dict[str, Any]:
    torch, dist = _init(port)
    backends = _two_groups(torch, dist)

    def release() -> Dict[str, Any]:
        row: Dict[str, Any] = {}
        for i, b in enumerate(backends):
            _timed(row, f"torch abort() {i}, no revoke", b.abort)
        return row

    return _on_a_fresh_thread(release)


def case_restarts(port: int, restarts: int) -> Dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist

    from inprocess.gpu import nccl_abort

    _init(port)  # the rendezvous variables, and NCCL loaded once before the first timed cycle
    dist.destroy_process_group()
    samples: Dict[str, List[float]] = {"init + all_reduce": [], "release": [], "destroy": []}
    revoked = 0
    for _ in range(restarts):
        row: Dict[str, float] = {}

        def init() -> None:
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
            x = torch.ones(1 << 20, device="cuda")
            dist.all_reduce(x)
            torch.cuda.synchronize()

        _timed(row, "init + all_reduce", init)
        backends = [dist.group.WORLD._get_backend(torch.device("cuda"))]
        report = _timed(row, "release", lambda b=backends: _on_a_fresh_thread(lambda: nccl_abort.release(b, 30.0)))
        revoked += bool(report.revoked)
        _timed(row, "destroy", dist.destroy_process_group)
        gc.collect()
        for name, ms in row.items():
            samples[name].append(ms)
    out: Dict[str, Any] = {"revoked": revoked}
    for name, values in samples.items():
        ordered = sorted(values)
        out[name] = {"p50": statistics.median(values), "p99": ordered[min(len(values) - 1, int(0.99 * len(values)))],
                     "max": ordered[-1]}
    return out


def run_case(case: str, port: int, restarts: int) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--case", case, "--port", str(port), "--restarts", str(restarts)],
                          capture_output=True, text=True, timeout=120 + 10 * restarts)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"case {case} ended {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> int:
    reaping.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=20, help="cycles of the restarts case (default 20)")
    parser.add_argument("--smoke", action="store_true", help="3 restarts: checks that it works")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29650, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.restarts < 1:
        parser.error(f"--restarts={args.restarts}: expected >= 1")
    if args.case:
        case = {"steps": case_steps, "torch_abort_alone": case_torch_abort_alone, "restarts": case_restarts}
        print(json.dumps(case[args.case](args.port, args.restarts)), flush=True)
        os._exit(0)  # the groups were aborted: no teardown that could wait on them
    restarts = 3 if args.smoke else args.restarts
    import torch

    if not torch.cuda.is_available():
        print(f"nccl_release: needs an NVIDIA GPU and a CUDA build of torch (torch {torch.__version__}, "
              "torch.cuda.is_available() is False): nothing measured")
        return 0
    from inprocess.launch import free_port

    results = {case: run_case(case, free_port(), restarts) for case in CASES}
    print(f"torch {torch.__version__}, NCCL {results['steps']['nccl']}, {torch.cuda.get_device_name(0)}; "
          "one rank, two groups, released from a thread with no device set\n")
    for case in ("steps", "torch_abort_alone"):
        for name, value in results[case].items():
            if isinstance(value, float):
                print(f"{case:18s} {name:36s} {value:9.1f} ms")
    print(f"\nrestarts: {restarts} cycles, {results['restarts']['revoked']} revoked   p50 / p99 / max ms")
    for name in ("init + all_reduce", "release", "destroy"):
        s = results["restarts"][name]
        print(f"  {name:18s} {s['p50']:8.1f} {s['p99']:8.1f} {s['max']:8.1f}")
    print(json.dumps({"benchmark": "nccl_release", "torch": torch.__version__, "restarts": restarts, **results},
                     separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
