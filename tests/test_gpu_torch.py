"""GPU tests with torch on a real device. They skip without a GPU (CI has
none); none of them has run yet (no GPU was available when they were
written): see README "GPU".

Each starts its work in a fresh process, so that a hung collective or a lost
context cannot take the test session with it; the child is reaped on timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fakes.gpu_fakes import run_python

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    ),
]

NCCL_GROUP = """
import datetime, os, time, threading
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
"""


@pytest.mark.timeout(300)
def test_real_nccl_group_found_and_revoked_or_aborted() -> None:
    code = NCCL_GROUP + """
from inprocess.gpu import libraries, nccl_abort
x = torch.ones(4, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
lib, reason = libraries.nccl()
assert lib is not None, reason                      # torch's own libnccl, found loaded
backend = dist.group.WORLD._get_backend(torch.device("cuda"))
report = nccl_abort.release([backend], 30.0)
print("released", report.pointers, report.revoked, report.torch_aborted, lib.version, lib.has_revoke)
"""
    result = run_python(code, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "released" in result.stdout


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL before 2.30 refuses two ranks on "
                    "one device (src/init.cc, v2.28.3-1 line 808: 'Duplicate GPU detected', ncclInvalidUsage)")
def test_a_collective_that_cannot_complete_is_released_by_the_abort() -> None:
    # Two ranks, one GPU each; rank 1 never joins the all_reduce, so rank 0's
    # collective cannot complete until the abort releases it.
    code = """
import os, sys, time, threading, datetime
import torch, torch.distributed as dist
rank = int(sys.argv[1]) if len(sys.argv) > 1 else 0
"""
    script = code + """
store = dist.TCPStore("127.0.0.1", 29534, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
torch.cuda.set_device(rank)
dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=torch.device("cuda", rank))
x = torch.ones(1 << 20, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
if rank == 1:
    time.sleep(60); os._exit(0)
from inprocess.abort import AbortTorchDistributed
from inprocess.state import FrozenState
def later():
    time.sleep(2.0)
    t = time.monotonic(); AbortTorchDistributed(nccl_timeout=datetime.timedelta(seconds=20))(FrozenState(0, 2, 0, 2))
    print("abort took", time.monotonic() - t, flush=True)
threading.Thread(target=later, daemon=True).start()
t = time.monotonic()
try:
    dist.all_reduce(x); torch.cuda.synchronize()
    print("collective returned", flush=True)
except Exception as e:
    print("collective raised", type(e).__name__, flush=True)
print("released after", time.monotonic() - t, flush=True)
os._exit(0)
"""
    env = dict(os.environ, TORCH_NCCL_ASYNC_ERROR_HANDLING="2")  # README "GPU": the watchdog must not kill rank 0
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=200)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "released after" in out, err[-4000:]
    released_after = float(out.split("released after")[1].split()[0])
    assert released_after < 2.0 + 25.0  # the abort starts after 2 s and has a 20 s deadline


@pytest.mark.timeout(300)
def test_cuda_health_check_times_out_on_a_kernel_that_outlasts_it() -> None:
    code = """
import datetime, time, torch
from inprocess import health_check
from inprocess.exception import TimeoutError
torch.cuda.set_device(0); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
torch.cuda._sleep(int(5e9))                     # ~seconds of GPU time, longer than the check's timeout
t = time.monotonic()
try:
    health_check.CudaHealthCheck(timeout=datetime.timedelta(seconds=0.5))(None)
    print("no timeout")
except TimeoutError as e:
    print("timed out after", round(time.monotonic() - t, 3))
torch.cuda.synchronize()
health_check.CudaHealthCheck(timeout=datetime.timedelta(seconds=30))(None)   # healthy once the kernel ends
print("healthy")
"""
    result = run_python(code, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("timed out after") and float(lines[0].split()[-1]) < 1.5
    assert lines[-1] == "healthy"


@pytest.mark.timeout(600)
def test_twenty_restarts_keep_device_memory_and_one_context() -> None:
    code = NCCL_GROUP + """
import gc
from inprocess.gpu import nccl_abort
from inprocess import health_check
import ctypes
cuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)  # torch's copy
def current_context():
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value
dist.destroy_process_group()
first = None
contexts = {current_context()}
for i in range(20):
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda"); dist.all_reduce(x); torch.cuda.synchronize()
    nccl_abort.release([dist.group.WORLD._get_backend(torch.device("cuda"))], 30.0)
    dist.destroy_process_group(); del x; gc.collect(); torch.cuda.empty_cache()
    health_check.CudaHealthCheck()(None)
    free, total = torch.cuda.mem_get_info()
    used = total - free
    first = used if first is None else first
    print(i, used)
    contexts.add(current_context())
print("contexts", len(contexts))
print("growth", used - first)
"""
    result = run_python(code, timeout=540)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[-2] == "contexts 1"  # the same (primary) context before and after every restart
    assert int(lines[-1].split()[1]) <= 64 << 20  # back to its first level, within allocator slack


@pytest.mark.timeout(300)
def test_a_wrapped_nccl_job_restarts_with_the_teardown_beside_the_restart() -> None:
    """Issue 30, Stage 1 on the real torch and NCCL: one rank, two NCCL groups, three restarts. The
    abort hands the groups' aborts to the reaper and returns at once; torch's registries are cleared
    instead of destroyed while the aborts run; the next init_process_group works on the forgotten
    state, and the function is called again only once NCCL's teardown is over."""
    code = """
import datetime, json, os, time
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
import inprocess
from inprocess.gpu import nccl_reaper
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
seen = []

def initialize(state):
    last = nccl_reaper.REAPER.last
    seen.append({"registered": len(c10d._world.pg_map), "in_flight": nccl_reaper.REAPER.in_flight(),
                 "teardown_s": None if last is None else last.took_s})

@inprocess.Wrapper(initialize=initialize, soft_timeout=datetime.timedelta(seconds=60),
                   hard_timeout=datetime.timedelta(seconds=90), barrier_timeout=datetime.timedelta(seconds=120))
def train(call_wrapper: inprocess.CallWrapper = None):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=call_wrapper.store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    second = dist.new_group()
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x); dist.all_reduce(x, group=second); torch.cuda.synchronize()
    if call_wrapper.iteration < 3:
        raise ValueError("a fault")
    return [(r.aborted_ns - r.detected_ns) / 1e6 for r in call_wrapper.restarts]

abort_ms = train()
print("RESULT " + json.dumps({"abort_ms": abort_ms, "seen": seen}), flush=True)
os._exit(0)
"""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}
    result = run_python(code, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.split("RESULT ", 1)[1])
    assert len(out["abort_ms"]) == 3, out
    seen = out["seen"]
    assert all(s["registered"] == 0 and not s["in_flight"] for s in seen), out  # forgotten, teardown over
    teardowns = [s["teardown_s"] for s in seen[1:]]
    assert all(t is not None for t in teardowns), out
    # The abort phase no longer holds NCCL's teardown (about a second for one rank, measured on an H200).
    assert all(a < 1e3 * t for a, t in zip(out["abort_ms"], teardowns, strict=True)), out
