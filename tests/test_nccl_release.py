"""The NCCL release (inprocess.gpu.nccl_abort) against fakes that behave like
torch 2.13's ProcessGroupNCCL (tests/fakes/fake_torch_nccl.py, fake_c10d.c),
NCCL 2.30.7 (tests/fakes/fake_nccl.c) and the CUDA driver's contexts
(tests/fakes/fake_cuda_contexts.c). The upstream file and line each fake
follows is cited there; each test names the one it depends on.

Every case runs in a fresh process: it loads its own fake libcuda and libnccl,
and a failure of the code under test is a hang while holding the GIL, or the
fake library aborting the process on a freed communicator.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from fakes.gpu_fakes import Fakes, build_fakes, run_python, skip_where_torchs_import_loads_nccl

TESTS = pathlib.Path(__file__).resolve().parent
RANK_DEVICE = 3

PRELUDE = """
import ctypes, json, os, sys, threading, time
sys.path.insert(0, {tests!r})
from fakes.gpu_fakes import Fakes
from fakes.fake_torch_nccl import FakeProcessGroupNCCL, mem_get_info
from inprocess import _native
from inprocess.gpu import NcclAbortTimeout, libraries, nccl_abort
fakes = Fakes(json.loads(os.environ["FAKE_PATHS"]))
library, why = libraries.nccl() if os.environ["INPROCESS_LIBNCCL"] else (None, "")
assert library is not None or not os.environ["INPROCESS_LIBNCCL"], why
cuda = ctypes.CDLL(fakes["cuda_contexts"])  # the driver torch loaded

def on_trigger_thread(fn):
    '''`fn()` on a fresh thread, as the restart trigger runs the abort: no device set.'''
    box = {{}}
    def run():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    if "error" in box:
        raise box["error"]
    return box.get("value")

def created():
    return {{d: cuda.fake_cuda_contexts_created(d) for d in range(8)}}
"""


@pytest.fixture(scope="module")
def fakes() -> Fakes:
    return build_fakes()


def run_case(fakes: Fakes, body: str, timeout: float = 30, variant: str = "nccl", **env: str) -> dict[str, Any]:
    """Runs PRELUDE + `body` in a fresh interpreter; `body` prints one JSON line last."""
    full_env = dict(os.environ)
    full_env.update({
        "FAKE_PATHS": json.dumps(fakes.paths),
        "INPROCESS_LIBNCCL": fakes[variant],
        "INPROCESS_LIBCUDA": fakes["cuda_contexts"],
        "FAKE_NCCL_LIBCUDA": fakes["cuda_contexts"],
        "FAKE_CUDA_ACTIVE_DEVICES": str(RANK_DEVICE),  # torch made the rank's context, no other
        "LOCAL_RANK": str(RANK_DEVICE),
        "FAKE_NCCL_MODE": "ok",
    })
    full_env.update(env)
    code = PRELUDE.format(tests=str(TESTS)) + textwrap.dedent(body)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)
    assert result.returncode == 0, f"rc={result.returncode}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(90)
def test_revoke_on_the_ranks_own_device(fakes: Fakes) -> None:
    """Item 1: getCommPtr() looks the communicator up by the calling thread's
    current device (ProcessGroupNCCL.cpp, getCommPtr, cyyever/pytorch@0b10febc).
    The abort runs on a thread with no device (cudaGetDevice: 0); the rank's
    communicator is on device 3 and must still be revoked."""
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=3)
        pg.launch_kernel()
        report = on_trigger_thread(lambda: nccl_abort.release([pg], 5.0, revoke=True))
        print(json.dumps({"pointers": report.pointers, "revoked": report.revoked, "device": report.device,
                          "skipped": report.skipped, "state": pg.state(), "aborted": report.torch_aborted}))
    """)
    assert out["device"] == RANK_DEVICE and out["skipped"] == []
    assert out["pointers"] == 1 and out["revoked"], out
    assert out["state"] & 1 and out["aborted"] == 1  # then torch's abort freed it


@pytest.mark.timeout(90)
def test_the_device_comes_from_the_bound_group_first(fakes: Fakes) -> None:
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=5, bound=True)
        report = on_trigger_thread(lambda: nccl_abort.release([pg], 5.0, revoke=True))
        print(json.dumps({"pointers": report.pointers, "device": report.device, "created": created()}))
    """, FAKE_CUDA_ACTIVE_DEVICES="5")
    assert out["device"] == 5 and out["pointers"] == 1
    assert set(out["created"].values()) == {0}


@pytest.mark.timeout(90)
def test_no_context_is_created_on_another_gpu(fakes: Fakes) -> None:
    """Item 6: NCCL's blocking group end saves and restores the calling thread's
    device (nccl src/group.cc lines 859-863, v2.30.7-1); on a thread with no
    device that is 0, and cudaSetDevice(0) creates GPU 0's primary context.
    After the whole release (revoke on our worker, torch's abort on its own
    thread), no device other than the rank's has a context it did not have."""
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=3)
        pg.launch_kernel()
        report = on_trigger_thread(lambda: nccl_abort.release([pg], 5.0, revoke=True))
        print(json.dumps({"revoked": report.revoked, "created": created(), "device_message": report.device_message}))
    """)
    assert out["revoked"] and out["device_message"] == ""
    assert out["created"] == {str(d): 0 for d in range(8)}, out


@pytest.mark.timeout(90)
def test_no_device_is_made_current_where_its_context_does_not_exist(fakes: Fakes) -> None:
    """The binding retains a primary context only where it is active:
    cuDevicePrimaryCtxRetain would create it (CUDA driver API reference)."""
    out = run_case(fakes, """
        driver, why = libraries.current_device()
        assert driver is not None, why
        message = on_trigger_thread(lambda: driver.bind(2))
        print(json.dumps({"message": message, "created": created()}))
    """)
    assert "no active primary context" in out["message"]
    assert set(out["created"].values()) == {0}


@pytest.mark.timeout(90)
def test_a_held_group_mutex_does_not_hang_the_release(fakes: Fakes) -> None:
    """Item 2: init.cpp binds _comm_ptr without a call_guard (it holds the GIL,
    cyyever/pytorch@03a5d6de) and getCommPtr takes the group's mutex, which a
    hung abortComms() holds. The release must end by its deadline instead of
    blocking every Python thread."""
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=3, timeout_s=600)
        pg.hold_mutex()  # a previous abort of this group is stuck inside NCCL
        started = time.monotonic()
        try:
            on_trigger_thread(lambda: nccl_abort.release([pg], 1.0, revoke=True))
            outcome = "returned"
        except NcclAbortTimeout as e:
            outcome = "timeout"
        print(json.dumps({"outcome": outcome, "elapsed": time.monotonic() - started,
                          "abandoned": nccl_abort.abandoned()}))
    """, timeout=20)
    assert out["outcome"] == "timeout" and out["elapsed"] < 3.0 and out["abandoned"]


@pytest.mark.timeout(90)
def test_a_non_blocking_communicator_is_left_to_torch(fakes: Fakes) -> None:
    """Item 2, non-blocking: getNcclComm() waits while the communicator is in
    progress (NCCLUtils.cpp, NCCLComm::getNcclComm/waitReady,
    cyyever/pytorch@18ddaae4), for up to TORCH_NCCL_NONBLOCKING_TIMEOUT, with
    the GIL held; and completing its revoke takes ncclCommGetAsyncError calls,
    which on a non-blocking communicator complete and free its group job
    (issue 30, item 4). Ready or not, it is left to torch's abort: no pointer read."""
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=3, blocking=False, ready=False)
        report = on_trigger_thread(lambda: nccl_abort.release([pg], 2.0, revoke=True))
        print(json.dumps({"pointers": report.pointers, "skipped": report.skipped, "aborted": report.torch_aborted}))
    """, timeout=20)
    assert out["pointers"] == 0 and "non-blocking" in out["skipped"][0] and out["aborted"] == 1


@pytest.mark.timeout(90)
def test_revokes_of_groups_sharing_a_stream_are_grouped(fakes: Fakes) -> None:
    """Item 3: ncclCommRevoke sets the abort flag at the call and its job waits
    for the streams (nccl src/init.cc lines 2933-2963, 2965-3022); one by one,
    group A's revoke waits for group B's stuck kernel, whose flag is not set.
    As one NCCL group both flags are set before either waits."""
    out = run_case(fakes, """
        a = FakeProcessGroupNCCL(fakes, device=3, stream=7)
        b = FakeProcessGroupNCCL(fakes, device=3, stream=7)
        b.launch_kernel()  # B's collective, stuck ahead of A's work on the shared stream
        library.use_device(None, -1)
        one_by_one = library.revoke([a.comm], [True], 300_000_000)
        lib_b = _native.NcclLibrary.open(fakes["nccl"])  # a fresh worker: the first is stuck
        grouped = lib_b.revoke([a.comm, b.comm], [True, True], 2_000_000_000)
        print(json.dumps({"one_by_one": one_by_one.status.name, "grouped": grouped.status.name,
                          "states": [a.state(), b.state()]}))
        ctypes.CDLL(fakes["nccl"], mode=os.RTLD_NOLOAD).fake_nccl_release_streams()
    """, timeout=20)
    assert out["one_by_one"] == "TIMED_OUT"
    assert out["grouped"] == "DONE" and [s & 2 for s in out["states"]] == [2, 2]


@pytest.mark.timeout(90)
def test_blocking_and_non_blocking_communicators_are_revoked_in_two_groups(fakes: Fakes) -> None:
    """NCCL refuses a group mixing blocking and non-blocking communicators
    (nccl src/group.cc lines 54-62): the native revoke gives each kind its own group."""
    out = run_case(fakes, """
        a = FakeProcessGroupNCCL(fakes, device=3, stream=7)
        b = FakeProcessGroupNCCL(fakes, device=3, stream=7, blocking=False)
        a.launch_kernel(); b.launch_kernel()
        library.use_device(None, -1)
        outcome = library.revoke([a.comm, b.comm], [True, False], 2_000_000_000)
        print(json.dumps({"status": outcome.status.name, "message": outcome.message,
                          "states": [a.state(), b.state()]}))
    """, timeout=20)
    assert out["status"] == "DONE", out
    assert [s & 2 for s in out["states"]] == [2, 2]


@pytest.mark.timeout(90)
def test_torch_aborts_of_every_group_run_at_once(fakes: Fakes) -> None:
    """Item 3 without revoke (an NCCL before 2.28.7): torch 2.13's abort() runs
    abortComms() on a std::async thread (ProcessGroupNCCL.cpp, abort,
    cyyever/pytorch@0b10febc), so a group started on the caller's thread
    (_abort_process_group's _group_start) does not cover it: NCCL's group
    depth is per thread (nccl src/group.cc line 27). One after another, A's
    abort waits for B's stuck kernel; all started at once, every flag is set."""
    out = run_case(fakes, """
        assert not library.has_revoke
        a = FakeProcessGroupNCCL(fakes, device=3, stream=7, nccl=fakes["nccl_no_revoke"])
        b = FakeProcessGroupNCCL(fakes, device=3, stream=7, nccl=fakes["nccl_no_revoke"])
        b.launch_kernel()
        report = on_trigger_thread(lambda: nccl_abort.release([a, b], 3.0))
        print(json.dumps({"aborted": report.torch_aborted, "elapsed": report.elapsed_s,
                          "states": [a.state(), b.state()]}))
    """, timeout=20, variant="nccl_no_revoke")
    assert out["aborted"] == 2 and out["elapsed"] < 2.0 and [s & 1 for s in out["states"]] == [1, 1]


@pytest.mark.timeout(90)
def test_a_communicator_torchs_watchdog_frees_is_never_touched(fakes: Fakes) -> None:
    """Item 4: with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the watchdog, after an
    error, aborts (frees) the communicators itself (ProcessGroupNCCL.cpp,
    Watchdog::runLoop, SHOULD_CLEAN_UP, cyyever/pytorch@0b10febc). Here it
    frees it the moment _comm_ptr() returns; the fake library aborts the
    process on any later use. get_error() tells the release to keep away."""
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=3, async_error_handling=2)
        pg.fail(6, free_right_after_comm_ptr=True)
        assert pg.wait_error_seen()
        report = on_trigger_thread(lambda: nccl_abort.release([pg], 3.0, revoke=True))
        print(json.dumps({"pointers": report.pointers, "skipped": report.skipped, "aborted": report.torch_aborted}))
    """, timeout=20)
    assert out["pointers"] == 0 and "COMM_ERROR" in out["skipped"][0] and out["aborted"] == 1


@pytest.mark.timeout(90)
def test_the_fake_fails_loudly_on_a_freed_communicator(fakes: Fakes) -> None:
    """The check of the test above can fail: a freed communicator used again
    ends the process (where real NCCL would read freed memory)."""
    with pytest.raises(AssertionError, match="use of a freed communicator"):
        run_case(fakes, """
            pg = FakeProcessGroupNCCL(fakes, device=3, async_error_handling=2)
            pg.fail(6)
            assert pg.watchdog_freed.wait(5)
            library.async_errors([pg.comm], 1_000_000_000)
            print(json.dumps({}))
        """, timeout=20)


@pytest.mark.timeout(90)
def test_torchs_own_nccl_is_found_before_another_libnccl(fakes: Fakes) -> None:
    """Item 9: another package's libnccl.so.2 is loaded first, and torch has
    NCCL linked into libtorch_cuda.so. dlsym on libtorch_cuda.so's handle
    finds torch's; its version must be what torch.cuda.nccl.version() says."""
    skip_where_torchs_import_loads_nccl()  # the case imports torch: a CUDA build's own NCCL is found first
    out = run_case(fakes, """
        import torch
        other = ctypes.CDLL(fakes["nccl"], mode=os.RTLD_GLOBAL)  # loaded first (cupy, vLLM, nccl4py)
        torch_cuda = ctypes.CDLL(fakes["torch_cuda_static_nccl"])
        found = _native.NcclLibrary.find_loaded()
        libraries.forget()
        torch.cuda.nccl.version = lambda: (2, 29, 3)
        same, why_same = libraries.nccl()
        libraries.forget()
        torch.cuda.nccl.version = lambda: (2, 28, 7)
        other_version, why_other = libraries.nccl()
        print(json.dumps({"path": found.path, "version": found.version, "same": same is not None,
                          "why_other": why_other, "other": other_version is not None}))
    """, INPROCESS_LIBNCCL="")
    assert out["path"].endswith("libtorch_cuda.so") and out["version"] == 22903
    assert out["same"] and not out["other"] and "is not torch's (2.28.7)" in out["why_other"]


@pytest.mark.timeout(90)
def test_a_cuda_build_of_torch_has_its_own_nccl_found() -> None:
    """Item 9 on the real thing: where torch is a CUDA build, the NCCL found is
    the one torch's import loaded, at the version torch reports. (First run on
    an H200 with torch 2.11.0+cu130: libtorch_cuda.so links the pip
    nvidia-nccl-cu13 libnccl.so.2 dynamically, 2.28.9.)"""
    result = run_python("""
import json, torch
from inprocess import _native
from inprocess.gpu import libraries
loaded = _native.NcclLibrary.find_loaded()
library, why = libraries.nccl()
print(json.dumps({"loaded": loaded.path if loaded else None, "found": library.path if library else None,
                  "version": libraries.version_tuple(library.version) if library else None,
                  "torch": list(torch.cuda.nccl.version()) if loaded else None,
                  "why": why}))
""", timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    if out["loaded"] is None:
        pytest.skip("a CPU build of torch loads no NCCL (this case needs a CUDA build of torch)")
    assert out["found"] == out["loaded"], out
    assert list(out["version"]) == out["torch"], out


@pytest.mark.timeout(120)
def test_a_rank_whose_abort_was_abandoned_exits_without_touching_torchs_groups(fakes: Fakes) -> None:
    """Item 10: a 1-rank wrapped job whose NCCL abort times out. The abandoned
    abort holds the group's mutex (abortComms holds mutex_ for its aborts);
    destroying the group takes it too (ProcessGroupNCCL::shutdown, under
    mutex_, cyyever/pytorch@0b10febc). The rank must leave (exit 75, counted
    out) without destroying torch's groups, instead of waiting on that mutex
    until the monitor's hard timeout (20 s here)."""
    from inprocess.launch import free_port

    body = """
        import datetime
        import torch.distributed as dist
        import inprocess
        from inprocess.abort import Abort

        pg = FakeProcessGroupNCCL(fakes, device=3, timeout_s=600)
        pg.hold_mutex()  # the communicator's abort will hang inside torch
        destroyed = []
        original_destroy = dist.destroy_process_group

        def destroy(group=None):
            destroyed.append(time.monotonic())
            print("destroying torch's groups", flush=True)
            pg._abort_comms()  # shutdown(): the group's mutex, held by the abandoned abort
            original_destroy(group)

        dist.destroy_process_group = destroy

        class ReleaseNccl(Abort):
            def __call__(self, state):
                nccl_abort.release([pg], 1.0)
                return state

        @inprocess.Wrapper(
            abort=ReleaseNccl(),
            soft_timeout=datetime.timedelta(seconds=10),
            hard_timeout=datetime.timedelta(seconds=20),
            barrier_timeout=datetime.timedelta(seconds=40),
        )
        def train(call_wrapper: inprocess.CallWrapper = None):
            dist.init_process_group("gloo", store=call_wrapper.store, rank=0, world_size=1)
            print(f"fault at {time.time()!r}", flush=True)
            raise ValueError("a fault: the restart aborts NCCL")

        print(json.dumps({"returned": repr(train())}))
    """
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with pytest.raises(AssertionError) as failed:  # rc != 0: the rank left the process
        run_case(fakes, body, timeout=60, **env)  # without the fix: still waiting at 60 s
    exited = time.time()
    message = str(failed.value)
    assert message.startswith("rc=75"), message
    assert "exits (code 75) without touching torch's process groups" in message
    assert "destroying torch's groups" not in message
    fault = float(re.search(r"fault at ([0-9.]+)", message).group(1))  # type: ignore[union-attr]
    assert exited - fault < 10, message  # the abort's 1 s deadline, then the way out


@pytest.mark.timeout(90)
def test_the_restart_thread_can_be_bound_before_the_release(fakes: Fakes) -> None:
    """For the restart thread's other GPU work before the release (a flight
    recorder dump): bind_rank_device() makes the rank's device current there."""
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=3)
        def trigger():
            before = cuda.fake_cuda_thread_device()
            message = nccl_abort.bind_rank_device([pg])
            return before, message, cuda.fake_cuda_thread_device()
        before, message, after = on_trigger_thread(trigger)
        print(json.dumps({"before": before, "message": message, "after": after, "created": created()}))
    """)
    assert out["before"] == -1 and out["message"] == "" and out["after"] == RANK_DEVICE
    assert set(out["created"].values()) == {0}


# -- issue 30, items 3 and 4: what the release does not do by default ---------------------------


@pytest.mark.timeout(90)
def test_the_default_release_reads_no_pointer(fakes: Fakes) -> None:
    """Issue 30, item 4 (F2): ``_comm_ptr()`` holds the GIL and takes the group's mutex (init.cpp
    binds it without a call_guard, cyyever/pytorch@03a5d6de), and torch's watchdog may take that
    mutex right after ``_is_initialized()`` said it was free: nothing could then end the call. The
    default release (no revoke) reads no pointer at all; torch's abort releases the group."""
    out = run_case(fakes, """
        pg = FakeProcessGroupNCCL(fakes, device=3, bound=True)
        pg.take_mutex_after_check()
        report = on_trigger_thread(lambda: nccl_abort.release([pg], 3.0))
        print(json.dumps({"pointers": report.pointers, "aborted": report.torch_aborted, "state": pg.state()}))
    """, timeout=20)
    assert out["pointers"] == 0 and out["aborted"] == 1 and out["state"] & 1, out


@pytest.mark.timeout(90)
def test_with_revoke_the_pointers_read_can_block_every_thread(fakes: Fakes) -> None:
    """The case above with ``revoke=True``, where the pointer is read: the process stops running
    Python (the deadline's thread included) and is killed at the test's limit. This is why revoke
    is off by default (docs/gpu.md); a revoking rank is bounded only by its hard timeout."""
    with pytest.raises(subprocess.TimeoutExpired):
        run_case(fakes, """
            pg = FakeProcessGroupNCCL(fakes, device=3, bound=True)
            pg.take_mutex_after_check()
            on_trigger_thread(lambda: nccl_abort.release([pg], 3.0, revoke=True))
            print(json.dumps({}))
        """, timeout=8)


@pytest.mark.timeout(90)
def test_no_ncclCommGetAsyncError_is_made_outside_torchs_lock(fakes: Fakes) -> None:
    """Issue 30, item 4 (F4): torch reads ``ncclCommGetAsyncError`` under the communicator's
    mutex (NCCLComm::checkForNcclError); on a non-blocking communicator the call completes and
    frees the group job linked to it (nccl src/init.cc v2.29.7-1 lines 3107-3110), so two callers
    without that mutex can both free it. The release makes none: not by default, not with revoke
    (the non-blocking group is left to torch's abort, and with it every group)."""
    out = run_case(fakes, """
        lib = ctypes.CDLL(fakes["nccl"], mode=os.RTLD_NOLOAD)
        lib.fake_nccl_async_error_calls.argtypes = [ctypes.c_void_p]
        lib.fake_nccl_async_error_calls.restype = ctypes.c_long
        a = FakeProcessGroupNCCL(fakes, device=3, stream=7, bound=True)
        b = FakeProcessGroupNCCL(fakes, device=3, stream=7, blocking=False, bound=True)
        revoking = on_trigger_thread(lambda: nccl_abort.release([a, b], 3.0, revoke=True))
        c = FakeProcessGroupNCCL(fakes, device=3, bound=True)
        default = on_trigger_thread(lambda: nccl_abort.release([c], 3.0))
        print(json.dumps({"calls": [lib.fake_nccl_async_error_calls(pg.comm) for pg in (a, b, c)],
                          "aborted": revoking.torch_aborted + default.torch_aborted, "revoked": revoking.revoked}))
    """, timeout=20)
    assert out == {"calls": [0, 0, 0], "aborted": 3, "revoked": False}


P2P_HAZARD = """
    pg = FakeProcessGroupNCCL(fakes, device=3, stream=7, bound=True)
    p2p = pg.add_p2p(stream=7)
    pg.launch_p2p_kernel()  # a send whose recv never comes, ahead on the stream
    pg.launch_kernel()  # the collective queued behind it
    try:
        report = on_trigger_thread(lambda: nccl_abort.release([pg], 1.5{revoke}))
        outcome = f"released: {{report.torch_aborted}} aborted"
    except NcclAbortTimeout as e:
        outcome = f"timeout: {{e}}"
    print(json.dumps({{"outcome": outcome, "states": [pg.state(), pg._nccl.fake_nccl_comm_state(p2p)]}}))
    sys.stdout.flush()
    os._exit(0)  # a revoke still waits for the stream on a native thread
"""


@pytest.mark.timeout(90)
def test_a_p2p_kernel_ahead_on_the_stream_holds_a_revoke_not_torchs_abort(fakes: Fakes) -> None:
    """Issue 30, item 3: torch's send/recv use a point-to-point communicator that ``_comm_ptr()``
    does not return (getKeySendRecv beside getKeyFromDevice); its kernel, stuck ahead of a
    collective on the same stream, holds the revoke's wait for the stream (ncclCommRevoke's job
    synchronizes the streams, nccl src/init.cc v2.29.7-1 lines 2608-2620) until the deadline:
    exit 75. torch's abort alone aborts the P2P communicator too and releases both: the default."""
    default = run_case(fakes, P2P_HAZARD.format(revoke=""), timeout=20)
    assert default["outcome"] == "released: 1 aborted" and [s & 1 for s in default["states"]] == [1, 1], default
    revoking = run_case(fakes, P2P_HAZARD.format(revoke=", revoke=True"), timeout=20)
    assert revoking["outcome"].startswith("timeout: ncclCommRevoke of 1 communicators"), revoking
