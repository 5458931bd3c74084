"""NCCL's teardown off the restart's critical path (inprocess.gpu.nccl_reaper, issue 30, Stage 1)
against the fakes of torch's ProcessGroupNCCL and of NCCL (tests/fakes/): an abort whose
communicator is freed at once but whose call returns only after FAKE_NCCL_TEARDOWN_MS (NCCL's
proxy threads exit at their next 500 ms poll, nccl src/proxy.cc v2.29.7-1 lines 1663 and 1835),
and, with FAKE_NCCL_ALONE_DURING_ABORT=1, a library that ends the process on any NCCL call made
beside a running abort (a creation, a kernel, ncclCommGetAsyncError, ncclCommRevoke).

The reaper's own cases run in a fresh process each (test_nccl_release.run_case); the restarts
run as real wrapped jobs (inprocess.launch.LocalJob: real processes, a real TCPStore, gloo).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest

from fakes.gpu_fakes import Fakes, build_fakes, skip_where_torch_is_a_cuda_build
from inprocess.exits import EXIT_CODE_UNRELEASABLE
from inprocess.launch import LocalJob
from test_nccl_release import PRELUDE, RANK_DEVICE, TESTS, run_case

TEARDOWN_MS = 1500


@pytest.fixture(scope="module")
def fakes() -> Fakes:
    skip_where_torch_is_a_cuda_build()
    return build_fakes()


@pytest.mark.timeout(90)
def test_the_hand_over_returns_once_every_abort_started_and_the_gate_waits_for_them(fakes: Fakes) -> None:
    """Two groups sharing a stream, a kernel stuck on each: the hand-over returns at once, every
    kernel is released by then (the abort flag is set at the call), and the gate returns only once
    both aborts returned, after NCCL's teardown."""
    out = run_case(fakes, """
        from inprocess.gpu import nccl_reaper
        reaper = nccl_reaper.Reaper()
        a = FakeProcessGroupNCCL(fakes, device=3, stream=7, bound=True)
        b = FakeProcessGroupNCCL(fakes, device=3, stream=7, bound=True)
        a.launch_kernel(); b.launch_kernel()
        lib = ctypes.CDLL(fakes["nccl"], mode=os.RTLD_NOLOAD)
        lib.fake_nccl_collective_wait.argtypes = [ctypes.c_void_p, ctypes.c_int]
        started = time.monotonic()
        report = on_trigger_thread(lambda: reaper.hand_over([a, b], 10.0))
        handed = time.monotonic() - started
        released = [lib.fake_nccl_collective_wait(pg.comm, 1000) for pg in (a, b)]
        in_flight = reaper.in_flight()
        gate = reaper.wait()
        print(json.dumps({"handed": handed, "released": released, "in_flight": in_flight,
                          "took": gate.took_s, "waited": gate.waited_s, "aborted": gate.aborted,
                          "after": reaper.in_flight(), "pointers": report.pointers,
                          "states": [a.state(), b.state()], "again": reaper.wait() is None}))
    """, FAKE_NCCL_TEARDOWN_MS=str(TEARDOWN_MS))
    assert out["handed"] < TEARDOWN_MS / 1e3 / 2, out  # off the critical path: not the teardown's length
    assert out["released"] == [1, 1] and out["in_flight"], out
    assert out["took"] >= TEARDOWN_MS / 1e3 and out["aborted"] == 2 and not out["after"], out
    assert out["pointers"] == 0  # no revoke by default
    assert [s & 1 for s in out["states"]] == [1, 1] and out["again"], out


@pytest.mark.timeout(90)
def test_what_the_reaper_keeps_lives_until_the_gate(fakes: Fakes) -> None:
    """The groups torch forgot are kept alive until their aborts returned, then let go at the gate."""
    out = run_case(fakes, """
        import weakref
        from inprocess.gpu import nccl_reaper
        class Group:  # a process group object: ~ProcessGroupNCCL must not run before its abort returned
            pass
        reaper = nccl_reaper.Reaper()
        assert not reaper.keep([Group()])  # nothing runs: nothing kept
        pg = FakeProcessGroupNCCL(fakes, device=3, bound=True)
        reaper.hand_over([pg], 10.0)
        group = Group()
        ref = weakref.ref(group)
        kept = reaper.keep([group])
        del group
        alive_before = ref() is not None
        reaper.wait()
        print(json.dumps({"kept": kept, "alive_before": alive_before, "alive_after": ref() is not None}))
    """, FAKE_NCCL_TEARDOWN_MS="300")
    assert out == {"kept": True, "alive_before": True, "alive_after": False}


@pytest.mark.timeout(90)
def test_a_second_hand_over_waits_for_the_first_teardown_within_its_deadline(fakes: Fakes) -> None:
    """A second fault while a teardown still runs: its hand-over waits for the first one, bounded
    by that one's deadline (1 s here), raises NcclAbortTimeout past it, and starts no abort of
    its own beside the hung one."""
    out = run_case(fakes, """
        from inprocess.gpu import nccl_reaper
        reaper = nccl_reaper.Reaper()
        first = FakeProcessGroupNCCL(fakes, device=3, bound=True)
        second = FakeProcessGroupNCCL(fakes, device=3, bound=True)
        reaper.hand_over([first], 1.0)  # its ncclCommAbort never returns (FAKE_NCCL_MODE=abort_hangs)
        started = time.monotonic()
        try:
            reaper.hand_over([second], 30.0)
            outcome = "returned"
        except NcclAbortTimeout as e:
            outcome = str(e)
        print(json.dumps({"outcome": outcome, "elapsed": time.monotonic() - started,
                          "abandoned": nccl_abort.abandoned(), "second_aborts": second.aborts_started,
                          "gate_again": "raises" if reaper.in_flight() else "clear"}))
        sys.stdout.flush()
        os._exit(0)  # the hung abort holds the fake group's lock
    """, timeout=30, FAKE_NCCL_MODE="abort_hangs")
    assert "did not return by its deadline" in out["outcome"], out
    assert out["elapsed"] < 3.0 and out["abandoned"], out
    assert out["second_aborts"] == 0 and out["gate_again"] == "raises", out


# -- restarts of a wrapped job ------------------------------------------------------------------

JOB = """
import datetime
import torch.distributed as dist
import inprocess
from inprocess import abort as abort_hook
from inprocess.engine.runtime import RankRuntime
from inprocess.control.recovery_plan import Resource
from inprocess.gpu import nccl_reaper

nccl = ctypes.CDLL(fakes["nccl"], mode=os.RTLD_NOLOAD)
nccl.fake_nccl_calls_beside_abort.restype = ctypes.c_long
nccl.fake_nccl_collective_wait.argtypes = [ctypes.c_void_p, ctypes.c_int]
rank = int(os.environ["RANK"])
plan = json.loads(os.environ["REAPER_TEST_PLAN"])
if plan.get("log_info"):
    import logging
    logging.basicConfig(level=logging.INFO)

groups = []  # this iteration's NCCL groups: what AbortTorchDistributed finds registered in torch
abort_hook.nccl_backends = lambda torch, dist: list(groups)
nccl_reaper.device_free_bytes = lambda device: mem_get_info(fakes, device)[0]  # torch.cuda.mem_get_info
handed_while_tearing_down = []  # per hand-over: a teardown was still running (a fault beside Stage 2)
running_when_aborts_start = []  # NCCL aborts running when a teardown's aborts start
original_hand_over, original_aborts = nccl_reaper.REAPER.hand_over, nccl_abort.Aborts.__init__

def hand_over(*args, **kwargs):
    handed_while_tearing_down.append(nccl_reaper.REAPER.in_flight())
    return original_hand_over(*args, **kwargs)

def aborts(self, backends):
    running_when_aborts_start.append(nccl.fake_nccl_aborts_running())
    original_aborts(self, backends)

nccl_reaper.REAPER.hand_over = hand_over
nccl_abort.Aborts.__init__ = aborts
destroyed_beside_abort = []
original_destroy = dist.destroy_process_group

def destroy(group=None):  # torch's destroy calls into NCCL (shutdown): never beside an abort
    destroyed_beside_abort.append(nccl.fake_nccl_aborts_running())
    original_destroy(group)

dist.destroy_process_group = destroy
if plan.get("no_gate"):  # the gate taken out: the next iteration's NCCL meets the running aborts
    release = RankRuntime.release
    RankRuntime.release = lambda self, resources: release(self, resources - {Resource.NCCL_TEARDOWN})

def health_check(state):
    if plan.get("unhealthy_while_tearing_down") and nccl_reaper.REAPER.in_flight():
        raise RuntimeError("a second fault: the device is unhealthy")

entries = []
creation_failed = []
released_after = []  # seconds a rank stuck in a collective waited for the abort's release

@inprocess.Wrapper(
    abort=abort_hook.AbortTorchDistributed(nccl_timeout=datetime.timedelta(seconds=plan["nccl_timeout_s"]),
                                           overlap_next_iteration=plan.get("beside_next", False),
                                           overlap_memory_bytes=plan.get("memory_bytes")),
    health_check=health_check,
    soft_timeout=datetime.timedelta(seconds=20), hard_timeout=datetime.timedelta(seconds=40),
    barrier_timeout=datetime.timedelta(seconds=60),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    iteration = call_wrapper.iteration
    entries.append(nccl.fake_nccl_aborts_running())
    dist.init_process_group("gloo", store=call_wrapper.store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    # The iteration's NCCL groups (their communicators' creation is an NCCL call), a collective on each.
    try:
        groups[:] = [FakeProcessGroupNCCL(fakes, device=3, stream=7, bound=True) for _ in range(2)]
    except RuntimeError as e:  # the device's memory (FAKE_CUDA_MEMORY_BYTES)
        creation_failed.append(str(e))
        raise
    for pg in groups:
        pg.launch_kernel()
    if iteration < plan["faults"]:
        if rank == plan["faulty_rank"]:
            # Only once the others are in their collective (else, on a loaded machine, the restart
            # could interrupt them before they are stuck, and nothing would show the abort's release).
            if int(os.environ["WORLD_SIZE"]) > 1:
                call_wrapper.store.wait([f"stuck/{iteration}"], datetime.timedelta(seconds=30))
            raise ValueError(f"a fault in iteration {iteration}")
        stuck = time.monotonic()
        try:
            call_wrapper.store.set(f"stuck/{iteration}", "1")
            nccl.fake_nccl_collective_wait(groups[0].comm, 30000)  # stuck until the abort sets its flag
            time.sleep(30)  # the restart's interrupt arrives by then
        finally:
            released_after.append(time.monotonic() - stuck)
    phases = [{"abort_ms": (r.aborted_ns - r.detected_ns) / 1e6, "to_call_ms": (r.initialized_ns - r.detected_ns) / 1e6}
              for r in call_wrapper.restarts]
    return {"iteration": iteration, "phases": phases}

outcome = {}
try:
    outcome["returned"] = train()
except BaseException as e:
    outcome["raised"] = f"{type(e).__name__}: {e}"
last = nccl_reaper.REAPER.last
outcome.update(entries=entries, released_after=released_after, destroyed_beside_abort=destroyed_beside_abort,
               beside=nccl.fake_nccl_calls_beside_abort(), running=nccl.fake_nccl_aborts_running(),
               teardown=None if last is None else {"took": last.took_s, "waited": last.waited_s,
                                                    "aborted": last.aborted},
               creation_failed=creation_failed, freed_bytes=nccl_reaper.REAPER.freed_bytes,
               handed_while_tearing_down=handed_while_tearing_down,
               running_when_aborts_start=running_when_aborts_start)
print("REPORT " + json.dumps(outcome), flush=True)
"""


def run_job(fakes: Fakes, tmp_path: pathlib.Path, ranks: int, plan: dict[str, Any], timeout: float = 100,
            **env: str) -> LocalJob:
    script = tmp_path / "job.py"
    script.write_text(PRELUDE.format(tests=str(TESTS)) + JOB)
    job_env = {
        "FAKE_PATHS": json.dumps(fakes.paths), "INPROCESS_LIBNCCL": fakes["nccl"],
        "INPROCESS_LIBCUDA": fakes["cuda_contexts"], "FAKE_NCCL_LIBCUDA": fakes["cuda_contexts"],
        "FAKE_CUDA_ACTIVE_DEVICES": str(RANK_DEVICE), "FAKE_NCCL_MODE": "ok",
        "FAKE_NCCL_TEARDOWN_MS": str(TEARDOWN_MS), "FAKE_NCCL_ALONE_DURING_ABORT": "1",
        "REAPER_TEST_PLAN": json.dumps({"nccl_timeout_s": 20, "faulty_rank": ranks - 1, **plan}),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    job_env.update(env)
    with LocalJob([str(script)], ranks, env=job_env) as job:
        job.wait(timeout)
    return job


def reports(job: LocalJob) -> list[dict[str, Any]]:
    found = [json.loads(line.split("REPORT ", 1)[1]) for rp in job.ranks for line in rp.output.splitlines()
             if line.startswith("REPORT ")]
    assert len(found) == len(job.ranks), job.outputs()
    return found


@pytest.mark.timeout(150)
def test_restarts_overlap_the_teardown_and_no_nccl_call_runs_beside_an_abort(
        fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """Two ranks, two restarts: rank 1 raises, rank 0 is stuck in a collective that the abort
    releases. Every NCCL call beside an abort would end its process (the strict fake); the groups
    are forgotten, never destroyed, while their teardown runs; the function is called again only
    once every abort returned (the gate); and the abort phase of each restart is far shorter than
    the teardown: the teardown is off the critical path."""
    job = run_job(fakes, tmp_path, 2, {"faults": 2})
    out = job.outputs()
    assert [rp.returncode for rp in job.ranks] == [0, 0], out
    stuck = reports(job)[0]["released_after"]  # rank 0, iterations 0 and 1: released by the abort, not its 30 s
    assert len(stuck) == 2 and max(stuck) < 10, stuck
    for report in reports(job):
        assert report["returned"]["iteration"] == 2, report
        assert report["beside"] == 0 and report["running"] == 0, report
        assert report["entries"] == [0, 0, 0], report  # no abort still running when the function was called
        assert all(n == 0 for n in report["destroyed_beside_abort"]), report
        phases = report["returned"]["phases"]
        assert len(phases) == 2 and all(p["abort_ms"] < TEARDOWN_MS / 2 for p in phases), phases
        assert all(p["to_call_ms"] >= TEARDOWN_MS for p in phases), phases  # the gate held the call
        assert report["teardown"]["took"] >= TEARDOWN_MS / 1e3 and report["teardown"]["aborted"] == 2, report


@pytest.mark.timeout(150)
def test_without_the_gate_the_next_iteration_meets_the_running_aborts(fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """The test above can fail: with the wait before the next call taken out of the plan's release,
    the next iteration creates its communicators while the aborts still run, and the strict fake
    ends the process."""
    job = run_job(fakes, tmp_path, 1, {"faults": 1, "no_gate": True}, timeout=60, FAKE_NCCL_TEARDOWN_MS="4000")
    out = job.outputs()
    assert job.ranks[0].returncode != 0, out
    assert "a communicator's creation (ncclCommInitRankConfig) called while an abort runs" in out, out


@pytest.mark.timeout(150)
def test_a_second_fault_during_the_teardown_leaves_once_it_is_over(fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """The health check fails while the teardown still runs (a second fault): the rank leaves the
    job with the check's error, counted out, and only once the aborts returned (bounded by the
    teardown, nothing destroyed beside it)."""
    job = run_job(fakes, tmp_path, 1, {"faults": 1, "unhealthy_while_tearing_down": True}, timeout=60)
    out = job.outputs()
    assert job.ranks[0].returncode == 0, out
    (report,) = reports(job)
    assert report["raised"].startswith("HealthCheckError") and "unhealthy" in report["raised"], report
    assert report["running"] == 0 and report["beside"] == 0, report
    assert all(n == 0 for n in report["destroyed_beside_abort"]), report
    assert report["teardown"] is not None and report["teardown"]["took"] >= TEARDOWN_MS / 1e3, report


@pytest.mark.timeout(150)
def test_a_teardown_past_its_deadline_makes_the_rank_leave_with_75(fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """An abort that never returns: the gate before the next call raises at the NCCL timeout (1 s),
    the rank is counted out and exits with 75 without touching torch's groups again, as a hung
    abort did before the teardown left the critical path."""
    job = run_job(fakes, tmp_path, 1, {"faults": 1, "nccl_timeout_s": 1}, timeout=60, FAKE_NCCL_MODE="abort_hangs")
    out = job.outputs()
    assert job.ranks[0].returncode == EXIT_CODE_UNRELEASABLE, out
    assert "did not return by its deadline" in out, out
    assert f"exits (code {EXIT_CODE_UNRELEASABLE}) without touching torch's process groups" in out, out


# -- Stage 2: the teardown beside the next iteration ------------------------------------------

GIB = 1 << 30


def stage_two(fakes: Fakes, tmp_path: pathlib.Path, plan: dict[str, Any], memory_gib: int,
              timeout: float = 100, **env: str) -> LocalJob:
    """Two ranks with Stage 2 asked for, communicators of 1 GiB on a device of `memory_gib`. The fake
    counts NCCL calls beside an abort instead of ending the process: Stage 2 makes them on purpose
    (creations and kernels of the next iteration's communicators, never of one being aborted: that
    would end the process as a use of a freed communicator)."""
    return run_job(fakes, tmp_path, 2, {"beside_next": True, **plan}, timeout=timeout,
                   FAKE_NCCL_ALONE_DURING_ABORT="0", FAKE_NCCL_COMM_BYTES=str(GIB),
                   FAKE_CUDA_MEMORY_BYTES=str(memory_gib * GIB), **env)


@pytest.mark.timeout(150)
def test_stage_two_runs_the_next_iteration_beside_the_teardown_once_it_knows_the_room_it_needs(
        fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """The first restart waits for the teardown and measures what it frees (the two old communicators'
    2 GiB); the second finds that much free and calls the function at once, its new communicators
    created while the old ones' aborts still run; the call's end waits for the teardown."""
    job = stage_two(fakes, tmp_path, {"faults": 2}, memory_gib=16)
    out = job.outputs()
    assert [rp.returncode for rp in job.ranks] == [0, 0], out
    for report in reports(job):
        assert report["returned"]["iteration"] == 2, report
        assert report["freed_bytes"] == 2 * GIB, report
        assert report["entries"][:2] == [0, 0] and report["entries"][2] > 0, report  # Stage 1, then Stage 2
        assert report["beside"] > 0 and report["running"] == 0 and not report["creation_failed"], report
        first, second = report["returned"]["phases"]
        assert first["to_call_ms"] >= TEARDOWN_MS, report
        assert second["to_call_ms"] < TEARDOWN_MS, report  # the gate let the call through at once
        assert report["running_when_aborts_start"] == [0, 0], report


@pytest.mark.timeout(150)
def test_stage_two_waits_where_the_device_cannot_hold_old_and_new_communicators(
        fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """A device of 3 GiB holds the old communicators (2 GiB) or the new ones, not both: every gate
    waits (Stage 1), and no creation fails."""
    job = stage_two(fakes, tmp_path, {"faults": 2, "log_info": True}, memory_gib=3)
    out = job.outputs()
    assert [rp.returncode for rp in job.ranks] == [0, 0], out
    assert "the next iteration waits for it: cuda:3 has 1024 MiB free, the old communicators hold 2048 MiB" in out
    for report in reports(job):
        assert report["returned"]["iteration"] == 2 and report["entries"] == [0, 0, 0], report
        assert not report["creation_failed"] and report["beside"] == 0, report


@pytest.mark.timeout(150)
def test_without_the_room_check_the_next_iteration_runs_out_of_device_memory(
        fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """The test above can fail: told that no memory is needed (overlap_memory_bytes=0), the next
    iteration's creation meets the old communicators' 2 GiB on the 3 GiB device and fails."""
    job = stage_two(fakes, tmp_path, {"faults": 1, "memory_bytes": 0}, memory_gib=3)
    out = job.outputs()
    assert any("out of memory" in failure for report in reports(job) for failure in report["creation_failed"]), out


@pytest.mark.timeout(150)
def test_a_fault_during_stage_two_waits_for_the_teardown_before_its_own_aborts(
        fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """The iteration that runs beside a 3 s teardown fails at once: its hand-over finds the teardown
    running and waits for it (bounded by its deadline) before its own aborts start, which then run
    alone; the job ends normally."""
    job = stage_two(fakes, tmp_path, {"faults": 3}, memory_gib=16, FAKE_NCCL_TEARDOWN_MS="3000")
    out = job.outputs()
    assert [rp.returncode for rp in job.ranks] == [0, 0], out
    for report in reports(job):
        assert report["returned"]["iteration"] == 3, report
        assert report["handed_while_tearing_down"][:2] == [False, False], report
        assert report["handed_while_tearing_down"][2], report  # the third fault came during Stage 2
        assert report["running_when_aborts_start"] == [0, 0, 0], report  # yet no two teardowns at once


@pytest.mark.timeout(150)
def test_a_fault_beside_a_stage_two_teardown_that_never_returns_leaves_with_75(
        fakes: Fakes, tmp_path: pathlib.Path) -> None:
    """An abort that never returns, left beside the next iteration: the reaper logs its deadline (1 s),
    and the next fault's hand-over raises at once instead of starting aborts beside it: the rank
    leaves with 75."""
    job = run_job(fakes, tmp_path, 1, {"faults": 2, "beside_next": True, "memory_bytes": 0, "nccl_timeout_s": 1},
                  timeout=60, FAKE_NCCL_MODE="abort_hangs", FAKE_NCCL_ALONE_DURING_ABORT="0")
    out = job.outputs()
    assert job.ranks[0].returncode == EXIT_CODE_UNRELEASABLE, out
    assert "NCCL teardown beside the next iteration" in out and "did not return by its deadline" in out, out
