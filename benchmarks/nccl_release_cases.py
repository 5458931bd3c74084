"""The cases of ``benchmarks/nccl_release.py``, each run in a fresh process (``--case NAME``),
each printing one JSON line last. Not a benchmark of its own.

GPU cases need a CUDA build of torch and a GPU; ``restart`` also runs on the fakes of
``tests/fakes/`` (``NR_FAKES=1``), where NCCL's teardown is a set sleep (a model, not NCCL).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")


def _timed(row: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    started = time.monotonic()
    value = fn()
    row[name] = 1e3 * (time.monotonic() - started)
    return value


def _on_a_fresh_thread(fn: Callable[[], Any]) -> Any:
    """`fn` on a thread that never set a CUDA device, as the restart trigger's."""
    out: dict[str, Any] = {}

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


def _init(store: Any, rank: int, world: int, device: int, prefix: str = "") -> Any:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.PrefixStore(prefix or "g", store), rank=rank, world_size=world,
                            device_id=torch.device("cuda", device), timeout=datetime.timedelta(seconds=60))
    return torch, dist


def _groups(n: int) -> list[Any]:
    """The world and n - 1 more groups, one all_reduce on each: their backends."""
    import torch
    import torch.distributed as dist

    groups = [dist.group.WORLD] + [dist.new_group() for _ in range(n - 1)]
    x = torch.ones(1 << 20, device="cuda")
    for g in groups:
        dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    return [g._get_backend(torch.device("cuda")) for g in groups]


def _release_ms(release: Callable[[], Any]) -> float:
    """`release` of the current groups from a fresh thread, timed to its return; then the groups destroyed."""
    import torch.distributed as dist

    started = time.monotonic()
    _on_a_fresh_thread(release)
    took = 1e3 * (time.monotonic() - started)
    dist.destroy_process_group()
    return took


def _one_rank() -> Any:
    import torch.distributed as dist

    return dist.HashStore()


def case_steps(args: dict[str, Any]) -> dict[str, Any]:
    """The library's steps one by one, the revoke included (one rank, two groups)."""
    _init(_one_rank(), 0, 1, 0)
    backends = _groups(2)
    from inprocess.gpu import libraries, nccl_abort

    def release() -> dict[str, Any]:
        row: dict[str, Any] = {}
        library, why = _timed(row, "find torch's NCCL", libraries.nccl)
        if library is None or not library.has_revoke:
            raise RuntimeError(f"no NCCL with ncclCommRevoke: {why or library.version}")
        _timed(row, "make the device current", lambda: nccl_abort._use_device(library, 0))
        comms = [_timed(row, f"read communicator {i}", lambda b=b: nccl_abort.communicator(b, 30.0))
                 for i, b in enumerate(backends)]
        pointers = [c.pointer for c in comms]
        outcome = _timed(row, "ncclCommRevoke, both grouped",
                         lambda: library.revoke(pointers, [c.blocking for c in comms], 30 * 10**9))
        row["revoke status"] = str(outcome.status)
        for i, b in enumerate(backends):
            _timed(row, f"torch abort() {i} after the revoke", b.abort)
        row["nccl"] = ".".join(map(str, libraries.version_tuple(library.version)))
        return row

    return dict(_on_a_fresh_thread(release))


def case_aborts(args: dict[str, Any]) -> dict[str, Any]:
    """``groups`` groups released by torch's serial path (each ``abort()`` after the other, as
    destroy_process_group's shutdowns) and by the library's concurrent one (``nccl_abort.Aborts``),
    fresh groups each time: the whole release, per path."""
    from inprocess.gpu import nccl_abort

    def serial(backends: list[Any]) -> None:
        for b in backends:
            b.abort()

    def concurrent(backends: list[Any]) -> None:
        nccl_abort.Aborts(backends).wait(time.monotonic() + 60)

    store = _one_rank()
    out: dict[str, list[float]] = {"serial": [], "concurrent": []}
    for sample in range(args["samples"]):
        for path, release in (("serial", serial), ("concurrent", concurrent)):
            _init(store, 0, 1, 0, prefix=f"{path}-{sample}")
            backends = _groups(args["groups"])
            out[path].append(_release_ms(lambda b=backends, r=release: r(b)))
    return out


def case_sweep(args: dict[str, Any]) -> dict[str, Any]:
    """The teardown (the library's release of one group, revoke on or off, from a fresh thread) after
    ``delay`` seconds since the group's init and all_reduce, per delay and revoke setting."""

    from inprocess.gpu import nccl_abort

    store = _one_rank()
    out: dict[str, Any] = {}
    for delay in args["delays"]:
        for revoke in args["revokes"]:
            times = []
            for sample in range(args["samples"]):
                _init(store, 0, 1, 0, prefix=f"{delay}-{revoke}-{sample}")
                backends = _groups(1)
                time.sleep(delay)
                times.append(_release_ms(lambda b=backends, r=revoke: nccl_abort.release(b, 30.0, revoke=r)))
            out[f"{delay:g}s revoke={'on' if revoke else 'off'}"] = times
    return out


def case_multi_rank(args: dict[str, Any]) -> dict[str, Any]:
    """Every rank releases its two groups at the same instant (revoke on or off); each its own time."""
    import torch.distributed as dist

    from inprocess.gpu import nccl_abort

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank % max(int(args["gpus"]), 1)
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    out: dict[str, Any] = {"rank": rank, "device": device}
    for revoke in args["revokes"]:
        times = []
        for sample in range(args["samples"]):
            key = f"{revoke}-{sample}"
            _init(store, rank, world, device, prefix=key)
            backends = _groups(2)
            if rank == 0:
                store.set(f"t0/{key}", repr(time.time() + 0.3))
            t0 = float(store.get(f"t0/{key}").decode())
            time.sleep(max(t0 - time.time(), 0.0))
            times.append(_release_ms(lambda b=backends, r=revoke: nccl_abort.release(b, 30.0, revoke=r)))
        out[f"revoke={'on' if revoke else 'off'}"] = times
    return out


# -- a wrapped job restarting: the restart's critical path ------------------------------------


def case_restart(args: dict[str, Any]) -> dict[str, Any]:
    """A wrapped job (one rank per GPU, or the fakes) whose last rank raises ``restarts`` times; the
    others are stuck in a collective the abort releases. Per restart, on this rank: the abort phase,
    finalize, health check, barrier, the wait for NCCL's teardown and the whole critical path
    (the restart trigger woke -> the function called again)."""
    import torch
    import torch.distributed as dist

    import inprocess
    from inprocess.abort import AbortTorchDistributed
    from inprocess.gpu import nccl_reaper

    fakes = args["fakes"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gates: list[Any] = []
    groups: list[Any] = []
    if fakes:
        groups_of_iteration = _fake_groups(groups)
    health = None
    if not fakes:
        from inprocess.health_check import CudaHealthCheck

        health = CudaHealthCheck()

    if fakes:
        from fakes.fake_torch_nccl import mem_get_info  # _fake_groups put tests/ on the path
        from fakes.gpu_fakes import Fakes

        paths = Fakes(json.loads(os.environ["FAKE_PATHS"]))
        nccl_reaper.device_free_bytes = lambda device: mem_get_info(paths, device)[0]  # torch.cuda.mem_get_info
    stage = args["stage"]  # "inside" the abort, "stage1" (beside the restart), "stage2" (beside the next iteration)

    def initialize(state: Any) -> None:
        last = nccl_reaper.REAPER.last
        if state.iteration > 0:
            beside = nccl_reaper.REAPER.in_flight()  # Stage 2 let the call through with the teardown running
            gates.append({"beside_next": beside} if last is None or beside else
                         {"teardown_ms": 1e3 * last.took_s, "gate_ms": 1e3 * last.waited_s, "beside_next": False})
        nccl_reaper.REAPER.last = None

    def finalize(state: Any) -> None:
        time.sleep(args["finalize_ms"] / 1e3)  # a user's finalize (a checkpoint flushed, logs written)

    @inprocess.Wrapper(
        abort=AbortTorchDistributed(nccl_timeout=datetime.timedelta(seconds=30), overlap_teardown=stage != "inside",
                                    overlap_next_iteration=stage == "stage2"),
        initialize=initialize, finalize=finalize, health_check=health,
        soft_timeout=datetime.timedelta(seconds=60), hard_timeout=datetime.timedelta(seconds=90),
        barrier_timeout=datetime.timedelta(seconds=120),
    )
    def train(call_wrapper: inprocess.CallWrapper = None) -> list[dict[str, float]]:
        assert call_wrapper is not None
        if fakes:
            dist.init_process_group("gloo", store=call_wrapper.store, rank=rank, world_size=world)
            groups_of_iteration()
        else:
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", store=call_wrapper.store, rank=rank, world_size=world,
                                    device_id=torch.device("cuda", local))
            _groups(2)
        if call_wrapper.iteration < args["restarts"]:
            if rank == world - 1:
                # The iteration trains a while first: longer than NCCL's teardown, as faults minutes
                # apart are (a fault during a Stage 2 teardown waits for it: another measurement).
                time.sleep(args["run_ms"] / 1e3)
                raise ValueError("the benchmark's fault")
            _stuck_collective(fakes, groups)
        return [_phases(r) for r in call_wrapper.restarts]

    records = train()
    for record, gate in zip(records, gates, strict=False):  # a rank that never restarted has no gate
        record.update(gate or {})
    return {"rank": rank, "stage": stage, "restarts": records}


def _phases(r: Any) -> dict[str, float]:
    ms = r.phases_ms()
    ms["critical_path"] = max(0, r.initialized_ns - r.detected_ns) / 1e6
    ms["decided_to_call"] = max(0, r.initialized_ns - r.decided_ns) / 1e6
    return ms


def _stuck_collective(fakes: bool, groups: list[Any]) -> None:
    """A collective whose peer raised: stuck until the restart's abort releases it."""
    if fakes:
        import ctypes

        groups[0]._nccl.fake_nccl_collective_wait.argtypes = [ctypes.c_void_p, ctypes.c_int]
        groups[0]._nccl.fake_nccl_collective_wait(groups[0].comm, 60000)
    else:
        import torch
        import torch.distributed as dist

        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
    time.sleep(60)  # the restart's interrupt comes first


def _fake_groups(groups: list[Any]) -> Callable[[], None]:
    """The fakes' stand-in for the iteration's NCCL groups (tests/fakes: the fake libnccl, whose
    abort takes FAKE_NCCL_TEARDOWN_MS, and torch's ProcessGroupNCCL over it), registered where
    AbortTorchDistributed looks for them."""
    sys.path.insert(0, TESTS)
    from fakes.fake_torch_nccl import FakeProcessGroupNCCL
    from fakes.gpu_fakes import Fakes
    from inprocess import abort as abort_hook
    from inprocess.gpu import libraries

    library, why = libraries.nccl()  # INPROCESS_LIBNCCL: the fake, loaded before the fake groups reach it
    if library is None:
        raise RuntimeError(f"the fake NCCL did not load: {why}")
    fakes = Fakes(json.loads(os.environ["FAKE_PATHS"]))
    abort_hook.nccl_backends = lambda torch, dist: list(groups)

    def new_groups() -> None:
        groups[:] = [FakeProcessGroupNCCL(fakes, device=0, stream=7, bound=True) for _ in range(2)]
        for pg in groups:
            pg.launch_kernel()

    return new_groups


CASES = {"steps": case_steps, "aborts": case_aborts, "sweep": case_sweep, "multi_rank": case_multi_rank,
         "restart": case_restart}


def main() -> None:
    name, arguments = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(CASES[name](arguments)), flush=True)
    os._exit(0)  # the groups were aborted: no teardown at exit that could wait on them


if __name__ == "__main__":
    main()
