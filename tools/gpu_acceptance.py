"""``python tools/gpu_acceptance.py``, from a checkout: the first command to run on a
machine with NVIDIA GPUs.

It runs what has never met a GPU where the project was written:

- the tests of the GPU layer on its fake libraries (no GPU needed: this part
  runs everywhere, CI included);
- with a GPU: the GPU tests (``tests/test_gpu_torch.py`` and the ``gpu``
  cases of ``tests/test_faults.py``), from the checked-out tests;
- with a GPU, checks on the real torch, NCCL and driver, each a small job of
  its own: the abort from the restart thread on every local rank, with no
  context on another device; a collective stuck in one group while all are
  aborted; a sticky CUDA error ending the rank with exit status 76 under the
  README's settings; the abort of non-blocking communicators bounded; the
  release time of a hung all_reduce (the real-NCCL row of the abort
  benchmark); 20 restarts with device memory back to its first level (in
  ``tests/test_gpu_torch.py``).

It writes ``report.json`` and ``report.md`` (pass, fail or skip per check,
and why; the versions of driver, CUDA, NCCL, torch; the GPU model) into
``--out``, prints the Markdown, and exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from typing import Any

# This file, and the checkout it belongs to (its tests). It is no part of the installed package: it runs the
# checkout's tests and starts jobs of its own, which import the package this interpreter has installed
# (`pip install .` or `pip install -e .`: the extension is built only by an install).
THIS = pathlib.Path(__file__).resolve()
CHECKOUT = THIS.parents[1]
# The tests of the GPU layer on its fakes (the no-GPU part).
FAKE_TESTS = (
    "tests/test_cuda_driver.py",
    "tests/test_nvml_check.py",
    "tests/test_nccl_abort.py",
    "tests/test_nccl_release.py",
    "tests/test_flight_recorder.py",
    "tests/test_gpu_settings.py",
    "tests/test_gpu_abi.py",
)
# The tests that need a GPU, run with ``-m gpu``.
GPU_TESTS = ("tests/test_gpu_torch.py", "tests/test_faults.py")
# The environment the README's GPU section gives for a safe abort.
README_SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
NEEDS_A_GPU = "needs an NVIDIA GPU"
CHECK_TIMEOUT_S = 300


@dataclasses.dataclass
class Result:
    name: str
    status: str  # "pass", "fail" or "skip"
    detail: str = ""
    seconds: float = 0.0


# -- what the machine has ------------------------------------------------------


def _nvidia_smi(query: str) -> list[list[str]]:
    """Rows of ``nvidia-smi --query-<query> --format=csv,noheader``; [] without it."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [[field.strip() for field in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def environment() -> dict[str, Any]:
    """Versions and devices, without creating a CUDA context in this process."""
    found: dict[str, Any] = {"python": sys.version.split()[0], "host": socket.gethostname()}
    try:
        import torch

        found["torch"] = torch.__version__
        found["torch_cuda"] = torch.version.cuda
        found["gpus"] = torch.cuda.device_count() if torch.version.cuda else 0
        try:
            found["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as e:  # a CPU build has no NCCL
            found["nccl"] = f"none ({type(e).__name__})"
    except ImportError:
        found["torch"] = "not installed"
        found["gpus"] = 0
    from inprocess.gpu import libraries

    driver, reason = libraries.cuda_driver()
    if driver is None:
        found["cuda_driver"] = f"unavailable: {reason}"
    else:
        init = driver.init(10 * 1_000_000_000)
        found["cuda_driver"] = (f"CUDA {init.value // 1000}.{init.value % 1000 // 10}" if init.value
                                else f"{init.step}: {init.error_name}")
    gpus = _nvidia_smi("gpu=index,name,driver_version,uuid,pci.bus_id")
    found["devices"] = [{"index": g[0], "name": g[1], "driver": g[2], "uuid": g[3], "pci": g[4]}
                        for g in gpus if len(g) >= 5]
    return found


# -- pytest --------------------------------------------------------------------


def _checkout(tests: str | None) -> pathlib.Path | None:
    """The folder holding ``tests/``: `tests`'s parent, else the checkout this
    package is imported from, else the current directory when it is a
    checkout (a package installed with ``pip install .`` carries no tests,
    and is run from the checkout it was installed from)."""
    if tests:
        folder = pathlib.Path(tests).resolve()
        return folder.parent if (folder / "conftest.py").exists() else None
    for root in (CHECKOUT, pathlib.Path.cwd()):
        if (root / "tests" / "conftest.py").exists():
            return root
    return None


def run_pytest(label: str, root: pathlib.Path, targets: Sequence[str], marker: str, out: pathlib.Path,
               timeout: float) -> list[Result]:
    """The tests in `targets` (relative to `root`), one Result per test case,
    from pytest's JUnit XML."""
    xml = out / f"pytest-{label}.xml"
    cmd = [sys.executable, "-m", "pytest", *targets, "-q", "-p", "no:cacheprovider", "-m", marker,
           f"--junitxml={xml}"]
    env = dict(os.environ)
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
        (out / f"pytest-{label}.log").write_text(done.stdout + done.stderr)
    except subprocess.TimeoutExpired:
        return [Result(f"{label}: pytest", "fail", f"did not finish within {timeout:g}s", time.monotonic() - started)]
    if not xml.exists():
        tail = (done.stdout + done.stderr)[-2000:]
        return [Result(f"{label}: pytest", "fail", f"pytest exited {done.returncode} without a report:\n{tail}")]
    results = []
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        name = f"{label}: {case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        seconds = float(case.get("time", 0.0))
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            results.append(Result(name, "fail", (failure.get("message") or "")[:500], seconds))
        elif skipped is not None:
            results.append(Result(name, "skip", (skipped.get("message") or "")[:500], seconds))
        else:
            results.append(Result(name, "pass", "", seconds))
    if not results:
        results.append(Result(f"{label}: pytest", "fail", f"no test collected from {list(targets)}"))
    return results


# -- the checks on a real GPU, each a job of its own -----------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(check: str, nproc: int, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", str(THIS), "--worker", check]
    full = dict(os.environ, **env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)


def _reports(output: str) -> list[dict[str, Any]]:
    """The ``ACCEPTANCE {json}`` lines the workers print, one per rank."""
    return [json.loads(line.split("ACCEPTANCE ", 1)[1]) for line in output.splitlines() if "ACCEPTANCE {" in line]


def _job_check(name: str, check: str, nproc: int, env: dict[str, str], judge: Any) -> Result:
    started = time.monotonic()
    try:
        done = _torchrun(check, nproc, env, CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Result(name, "fail", f"the job did not end within {CHECK_TIMEOUT_S}s", time.monotonic() - started)
    reports = _reports(done.stdout)
    try:
        ok, detail = judge(reports, done)
    except Exception as e:  # a report without the expected fields
        ok, detail = False, f"{type(e).__name__}: {e}"
    if not ok:
        detail += f"\n(exit {done.returncode}; last output: {(done.stdout + done.stderr)[-1500:]})"
    return Result(name, "pass" if ok else "fail", detail, time.monotonic() - started)


def _judge_own_device(reports: list[dict[str, Any]], done: subprocess.CompletedProcess) -> Any:
    bad = [r for r in reports if r["devices_with_context"] != [r["own_device"]] or r["pointers"] < 1]
    hint = ""
    if reports and all(not r["devices_with_context"] for r in reports):
        hint = " (nvidia-smi lists no process of these PIDs: in a container it shows the host's PIDs; " \
               "count the contexts with nvidia-smi on the host)"
    detail = "; ".join(f"rank {r['rank']}: {r['pointers']} communicator pointers, revoked={r['revoked']}, "
                       f"contexts on {len(r['devices_with_context'])} device(s), abort {r['abort_s']:.3f}s"
                       for r in reports) + hint
    return bool(reports) and not bad and done.returncode == 0, detail


def _judge_released(limit_s: float) -> Any:
    def judge(reports: list[dict[str, Any]], done: subprocess.CompletedProcess) -> Any:
        times = [r["released_s"] for r in reports if "released_s" in r]
        detail = f"released after {', '.join(f'{t:.3f}' for t in times)} s (limit {limit_s:g}s)"
        return bool(times) and max(times) < limit_s and done.returncode == 0, detail
    return judge


# The latency row's targets. The kernel stops when the abort sets its flag: tens of milliseconds at
# most. The teardown (the abort's return) waits for NCCL's proxy threads, which look at the flag only
# between polls of 500 ms (NCCL 2.29.7 src/proxy.cc lines 1663 and 1835): with peers their closing
# connections should end the first poll, and two polls are the most the source allows.
RELEASE_TARGET_MS = 50.0
TEARDOWN_TARGET_MS = 1100.0


def _judge_latency(reports: list[dict[str, Any]], done: subprocess.CompletedProcess) -> Any:
    times = sorted(t for r in reports for t in r.get("release_ms", []))
    teardowns = sorted(t for r in reports for t in r.get("teardown_ms", []))
    if not times or len(teardowns) != len(times):
        return False, f"{len(times)} release times and {len(teardowns)} teardown times reported"
    p50, teardown_p50 = times[len(times) // 2], teardowns[len(teardowns) // 2]
    ok = done.returncode == 0 and p50 < RELEASE_TARGET_MS and teardowns[-1] <= TEARDOWN_TARGET_MS
    return ok, (f"hung all_reduce released by the abort: p50 {p50:.1f} ms, max {times[-1]:.1f} ms "
                f"(target p50 < {RELEASE_TARGET_MS:.0f} ms); the abort returned (NCCL's teardown): p50 "
                f"{teardown_p50:.1f} ms, max {teardowns[-1]:.1f} ms (target max <= {TEARDOWN_TARGET_MS:.0f} ms); "
                f"over {len(times)} runs")


def sticky_error_check() -> Result:
    """One rank, the README's settings, a device-side assert: exit 76."""
    started = time.monotonic()
    env = dict(os.environ, **README_SETTINGS, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    try:
        done = subprocess.run([sys.executable, str(THIS), "--worker", "sticky"],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return Result("sticky CUDA error ends the rank with 76", "fail", "did not end", time.monotonic() - started)
    from inprocess.exits import EXIT_CODE_CONTEXT_LOST

    ok = done.returncode == EXIT_CODE_CONTEXT_LOST
    detail = f"exit status {done.returncode} (expected {EXIT_CODE_CONTEXT_LOST})"
    if not ok:
        detail += f"; last output: {(done.stdout + done.stderr)[-1500:]}"
    return Result("sticky CUDA error ends the rank with 76", "pass" if ok else "fail", detail,
                  time.monotonic() - started)


def gpu_checks(gpus: int) -> list[Result]:
    results = []
    if gpus >= 1:
        own = _job_check("revoke and abort from the restart thread on every local rank, no stray context",
                         "own_device", gpus, dict(README_SETTINGS), _judge_own_device)
        if gpus == 1:
            own.detail += " (its stray-context half cannot fail on one GPU: there is no other device)"
        results.append(own)
        results.append(sticky_error_check())
    many = "needs 2 or more GPUs (one rank per GPU; NCCL refuses two ranks on one device)"
    if gpus >= 2:
        results.append(_job_check("a collective stuck in one group while every group is aborted", "stuck_group",
                                  gpus, dict(README_SETTINGS), _judge_released(2.0 + 25.0)))
        results.append(_job_check("_comm_ptr() and the abort on non-blocking communicators bounded", "nonblocking",
                                  2, dict(README_SETTINGS, TORCH_NCCL_USE_COMM_NONBLOCKING="1"),
                                  _judge_released(2.0 + 15.0)))
        results.append(_job_check("abort benchmark, real NCCL row: a hung all_reduce released, the teardown timed",
                                  "latency", 2,
                                  dict(README_SETTINGS), _judge_latency))
    else:
        for name in ("a collective stuck in one group while every group is aborted",
                     "_comm_ptr() and the abort on non-blocking communicators bounded",
                     "abort benchmark, real NCCL row: a hung all_reduce released, the teardown timed"):
            results.append(Result(name, "skip", many))
    return results


# -- the workers (run by torchrun, one per GPU) -----------------------------------


def _emit(**fields: Any) -> None:
    print("ACCEPTANCE " + json.dumps(fields), flush=True)


def _setup(nonblocking: bool = False) -> Any:
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    options = None
    if nonblocking:
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = 0
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), pg_options=options,
                            timeout=datetime.timedelta(seconds=120))
    return torch, dist, local


def _abort_from_a_fresh_thread(seconds: float) -> float:
    """AbortTorchDistributed on a thread that never set a device (the
    restart trigger's thread); how long it took."""
    from inprocess.abort import AbortTorchDistributed
    from inprocess.state import FrozenState

    took: list[float] = []

    def run() -> None:
        t = time.monotonic()
        AbortTorchDistributed(nccl_timeout=datetime.timedelta(seconds=seconds))(FrozenState())
        took.append(time.monotonic() - t)

    thread = threading.Thread(target=run, name="restart-thread")
    thread.start()
    thread.join()
    return took[0] if took else float("nan")


def _bus_id(text: str) -> str:
    """A PCI bus id as nvidia-smi ("00000000:3B:00.0") and cuDeviceGetPCIBusId
    ("0000:3b:00.0") both write it, in one form."""
    domain, _, rest = text.strip().partition(":")
    try:
        return f"{int(domain, 16):x}:{rest.lower()}"
    except ValueError:
        return text.strip().lower()


def _worker_own_device() -> None:
    torch, dist, local = _setup()
    from inprocess.gpu import nccl_abort

    second = dist.new_group()
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    dist.all_reduce(x, group=second)
    torch.cuda.synchronize()
    backends = [g._get_backend(torch.device("cuda")) for g in (dist.group.WORLD, second)]
    seen: dict[str, Any] = {}

    def release() -> None:
        report = nccl_abort.release(backends, 30.0, revoke=True)  # the revoke's own path, opt-in
        seen.update(pointers=report.pointers, revoked=bool(report.revoked))

    t = time.monotonic()
    thread = threading.Thread(target=release, name="restart-thread")  # no device set on it
    thread.start()
    thread.join()
    abort_s = time.monotonic() - t
    time.sleep(2.0)  # every rank has aborted before anyone looks
    pid = str(os.getpid())
    # By PCI bus id: nvidia-smi numbers the GPUs its own way, whatever
    # CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say.
    devices = sorted({_bus_id(row[1]) for row in _nvidia_smi("compute-apps=pid,gpu_bus_id") if row and row[0] == pid})
    from inprocess.gpu import libraries

    driver, reason = libraries.cuda_driver()
    own = driver.pci_bus_id(local, 10 * 1_000_000_000).text if driver is not None else f"? ({reason})"
    _emit(rank=int(os.environ["RANK"]), pointers=seen.get("pointers", 0), revoked=seen.get("revoked", False),
          devices_with_context=devices, own_device=_bus_id(own), abort_s=abort_s)
    os._exit(0)  # the groups were aborted: no teardown that could wait on them


def _worker_stuck(nonblocking: bool) -> None:
    torch, dist, local = _setup(nonblocking)
    rank = dist.get_rank()
    other = dist.new_group()
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    dist.all_reduce(x, group=other)
    torch.cuda.synchronize()
    if rank == 0:
        time.sleep(60)  # never joins: every other rank's collectives in `other` cannot complete
        os._exit(0)
    dist.all_reduce(x, group=other)  # stuck on the device
    dist.all_reduce(x)  # queued behind it on the same stream, in the other group
    timer = threading.Timer(2.0, _abort_from_a_fresh_thread, args=(20.0 if not nonblocking else 10.0,))
    timer.start()
    t = time.monotonic()
    try:
        torch.cuda.synchronize()
    except Exception:  # the aborted collectives may raise: released all the same
        pass
    _emit(rank=rank, released_s=time.monotonic() - t)
    os._exit(0)


def _abort_later(nccl_abort: Any, backend: Any, aborted_at: list[float], returned_at: list[float]) -> None:
    time.sleep(1.0)
    aborted_at.append(time.monotonic())
    nccl_abort.release([backend], 20.0)
    returned_at.append(time.monotonic())


def _worker_latency() -> None:
    torch, dist, local = _setup()
    rank = dist.get_rank()
    x = torch.ones(1 << 10, device="cuda")
    times: list[float] = []
    teardowns: list[float] = []
    for _ in range(5):
        group = dist.new_group()
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        if rank != 0:
            dist.barrier()  # the world group: rank 0 reaches it after aborting `group`
            continue
        dist.all_reduce(x, group=group)  # the others never join: hung
        from inprocess.gpu import nccl_abort

        backend = group._get_backend(torch.device("cuda"))
        aborted_at: list[float] = []
        returned_at: list[float] = []
        aborting = threading.Thread(target=_abort_later, args=(nccl_abort, backend, aborted_at, returned_at))
        aborting.start()
        try:
            torch.cuda.synchronize()
        except Exception:  # an aborted collective may raise: released all the same
            pass
        times.append((time.monotonic() - aborted_at[0]) * 1000.0)
        aborting.join(30.0)
        if returned_at:
            teardowns.append((returned_at[0] - aborted_at[0]) * 1000.0)
        dist.barrier()
    if rank == 0:
        _emit(rank=rank, release_ms=times, teardown_ms=teardowns)
    os._exit(0)


def _worker_sticky() -> None:
    import torch
    import torch.distributed as dist

    from inprocess.call_wrapper import CallWrapper
    from inprocess.health_check import CudaHealthCheck
    from inprocess.wrap import Wrapper

    @Wrapper(health_check=CudaHealthCheck(), soft_timeout=datetime.timedelta(seconds=30),
             hard_timeout=datetime.timedelta(seconds=60), barrier_timeout=datetime.timedelta(seconds=90))
    def train(call_wrapper: CallWrapper | None = None) -> None:
        assert call_wrapper is not None
        state = call_wrapper.frozen_state
        torch.cuda.set_device(0)
        # The wrapper's own store: MASTER_PORT is taken by it.
        dist.init_process_group("nccl", store=call_wrapper.store, rank=state.active_rank or 0,
                                world_size=state.active_world_size or 1, device_id=torch.device("cuda", 0))
        x = torch.ones(16, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        index = torch.tensor([1 << 30], device="cuda")
        x[index] = 1.0  # out of bounds: a device-side assert, CUDA_ERROR_ASSERT (710), sticky
        torch.cuda.synchronize()
        print("the device-side assert did not happen", flush=True)

    train()


WORKERS = {
    "own_device": _worker_own_device,
    "stuck_group": lambda: _worker_stuck(False),
    "nonblocking": lambda: _worker_stuck(True),
    "latency": _worker_latency,
    "sticky": _worker_sticky,
}


# -- the report ----------------------------------------------------------------


def markdown(env: dict[str, Any], results: list[Result], notes: list[str]) -> str:
    counts = {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "skip")}
    lines = ["# inprocess GPU acceptance", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {env.get('host')}: "
             f"**{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped**", ""]
    lines += [f"- {note}" for note in notes] + [""]
    lines += ["| | |", "|---|---|"]
    for key in ("torch", "torch_cuda", "nccl", "cuda_driver", "gpus", "python"):
        lines.append(f"| {key} | {env.get(key)} |")
    for d in env.get("devices", []):
        lines.append(f"| GPU {d['index']} | {d['name']}, driver {d['driver']}, {d['pci']} |")
    lines += ["", "| check | result | seconds | detail |", "|---|---|---|---|"]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")[:400]
        lines.append(f"| {r.name} | {r.status.upper()} | {r.seconds:.1f} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/gpu_acceptance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for report.json and report.md "
                        "(default: ./inprocess-acceptance-<UTC time>)")
    parser.add_argument("--tests", default=None, help="the checkout's tests/ folder (default: the one beside "
                        "this package when it is imported from a checkout, else ./tests)")
    parser.add_argument("--fakes", nargs="*", default=None, help="pytest targets for the no-GPU part, "
                        "relative to the checkout (default: every test file of the GPU layer's fakes)")
    parser.add_argument("--no-gpu", action="store_true", help="run the no-GPU part only, even with a GPU")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        WORKERS[args.worker]()
        return 0

    out = pathlib.Path(args.out or f"inprocess-acceptance-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    gpus = int(env.get("gpus") or 0)
    results: list[Result] = []
    notes: list[str] = []
    root = _checkout(args.tests)
    if root is None:
        notes.append("the tests were not found (an installed package carries none): pass --tests "
                     "path/to/checkout/tests; the fakes' tests and the GPU tests were skipped")
        results.append(Result("tests of the GPU layer on its fakes", "skip", "tests not found"))
    else:
        results += run_pytest("fakes", root, args.fakes or FAKE_TESTS, "not slow", out, 1800)
    if gpus == 0 or args.no_gpu:
        why = "--no-gpu" if args.no_gpu else f"no CUDA device here ({env.get('cuda_driver')})"
        notes.append(f"The GPU part was not run ({why}): it {NEEDS_A_GPU}. Run this command on a GPU machine.")
        results.append(Result(f"GPU tests ({', '.join(GPU_TESTS)}, -m gpu)", "skip", f"{NEEDS_A_GPU}: {why}"))
        for r in gpu_checks(0):
            r.detail = f"{NEEDS_A_GPU}: {why}"
            results.append(r)
        for name in ("revoke and abort from the restart thread on every local rank, no stray context",
                     "sticky CUDA error ends the rank with 76",
                     "20 restarts with device memory back to its first level (tests/test_gpu_torch.py)"):
            results.append(Result(name, "skip", f"{NEEDS_A_GPU}: {why}"))
    else:
        notes.append(f"{gpus} GPU(s): every check ran with one rank per GPU.")
        if root is not None:
            results += run_pytest("gpu", root, GPU_TESTS, "gpu", out, 3600)
        results += gpu_checks(gpus)
    payload = {"environment": env, "notes": notes, "results": [dataclasses.asdict(r) for r in results]}
    (out / "report.json").write_text(json.dumps(payload, indent=2) + "\n")
    text = markdown(env, results, notes)
    (out / "report.md").write_text(text)
    print(text)
    print(f"written: {out / 'report.json'} and {out / 'report.md'}")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
