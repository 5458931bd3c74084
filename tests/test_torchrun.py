"""The wrapper nested in the real torchrun (``python -m torch.distributed.run``).

Which layer handles which fault (README, "Launchers"):
- an exception: the in-process restart; torchrun restarts nothing;
- a worker process that dies (SIGKILL, also rank 0's, or an exit status such
  as 75 or 76): torchrun stops every worker and, with ``--max-restarts``,
  starts a new incarnation of all of them, which must not trip over what the
  previous one left in torchrun's shared agent store (the keys are scoped to
  ``TORCHELASTIC_RUN_ID``/``TORCHELASTIC_RESTART_COUNT``).

Each test runs torchrun with 4 workers of ``tests/workers/ddp_worker.py``,
which writes ``rank<r>.torchrun<N>.json`` in incarnation N; a fault with
``"restart_count": N`` fires only in incarnation N.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

from inprocess.engine.trigger import EXIT_CODE_UNRELEASABLE
from inprocess.gpu.errors import EXIT_CODE_CONTEXT_LOST
from inprocess.launch import free_port

WORKER = pathlib.Path(__file__).parent / "workers" / "ddp_worker.py"
NPROC = 4

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def processes_with(marker: str) -> dict[int, str]:
    """Live processes whose environment holds ``marker`` (torchrun, its workers and
    everything they started inherit it), pid -> command line."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state != "Z":
            found[int(name)] = cmd
    return found


class TorchrunJob:
    def __init__(self, out: pathlib.Path, returncode: int, output: str, left: dict[int, str]):
        self.out, self.returncode, self.output, self.left = out, returncode, output, left

    def incarnations(self) -> set[int]:
        return {int(p.name.split(".torchrun")[1].split(".")[0]) for p in self.out.glob("rank*.torchrun*.json")}

    def rank(self, r: int, incarnation: int) -> dict[str, Any]:
        path = self.out / f"rank{r}.torchrun{incarnation}.json"
        assert path.exists(), f"rank {r} wrote nothing in incarnation {incarnation}:\n{self.output[-8000:]}"
        return dict(json.loads(path.read_text()))


def run_torchrun(tmp_path: pathlib.Path, plan: dict[str, Any], *, max_restarts: int = 0, shared_store: bool = True,
                 timeout: float = 120.0, env: dict[str, str] | None = None) -> TorchrunJob:
    """torchrun with NPROC workers (see :func:`torchrun`); every process it leads is gone when this returns."""
    out = tmp_path / "out"
    out.mkdir()
    job_env = {
        "INPROCESS_TEST_OUT": str(out),
        "INPROCESS_TEST_PLAN": json.dumps(plan),
        "INPROCESS_TEST_LOG": "WARNING",
    }
    if not shared_store:
        # torchrun's workers then get a store of their own (rank 0 serves it), not the agent's.
        job_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    job_env.update(env or {})
    returncode, output, left = torchrun(tmp_path, [str(WORKER)], env=job_env, max_restarts=max_restarts,
                                        timeout=timeout)
    return TorchrunJob(out, returncode, output, left)


def torchrun(tmp_path: pathlib.Path, script_and_args: list[str], *, env: dict[str, str] | None = None,
             max_restarts: int = 0, nproc: int = NPROC, timeout: float = 120.0) -> tuple[int, str, dict[int, str]]:
    """``python -m torch.distributed.run --nproc-per-node=NPROC script args...`` (--standalone's rendezvous
    on a chosen port) in ``tmp_path``:
    its exit status, its output (torchrun's and the workers'), and what outlived it (then killed). The
    whole process tree carries a marker in its environment, so that nothing of it is left running."""
    marker = f"INPROCESS_TORCHRUN_TEST={tmp_path}\0"  # the NUL ends the entry: no other path it prefixes
    job_env = dict(os.environ)
    job_env["LOGLEVEL"] = "INFO"  # torchrun's own log: which worker failed, with which exit status
    job_env.update(env or {})
    job_env["INPROCESS_TORCHRUN_TEST"] = str(tmp_path)
    # --standalone's rendezvous, on a port below the ephemeral range: --standalone binds port 0, and
    # MASTER_PORT + 1, where NVRx-style programs serve their own store, is then a port any outgoing
    # connection of this machine may hold (EADDRINUSE in 1 of ~50 loaded runs, as launch.free_port says).
    rendezvous = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port(2)}",
                  f"--rdzv-id={uuid.uuid4().hex}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", *script_and_args]
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=job_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=tmp_path)
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reap_marked(marker, grace=0)
            pytest.fail(f"torchrun did not finish within {timeout}s:\n{log_path.read_text()[-8000:]}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            left = reap_marked(marker)
    return returncode, log_path.read_text(), left


def reap_marked(marker: str, grace: float = 20.0) -> dict[int, str]:
    """What outlived torchrun (after ``grace``), then killed: every test leaves nothing running."""
    deadline = time.monotonic() + grace
    left = processes_with(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = processes_with(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def completed_fresh(job: TorchrunJob, incarnation: int) -> None:
    """Every worker of ``incarnation`` finished its first iteration with all NPROC ranks."""
    checksums = set()
    for r in range(NPROC):
        log = job.rank(r, incarnation)
        assert log["restart_count"] == incarnation
        assert "exception" not in log, (log, job.output[-8000:])
        assert log["result"]["iteration"] == 0, log
        assert log["iterations"][-1]["world_size"] == NPROC
        checksums.add(log["result"]["checksum"])
    assert len(checksums) == 1, checksums


def test_an_exception_is_restarted_in_process_and_torchrun_restarts_nothing(tmp_path: pathlib.Path) -> None:
    plan = {"steps": 10, "faults": [{"iteration": 0, "rank": 2, "step": 3, "kind": "exception"}]}
    job = run_torchrun(tmp_path, plan, max_restarts=1)
    assert job.returncode == 0, job.output[-8000:]
    assert not job.left, job.left
    assert job.incarnations() == {0}, "torchrun started a second incarnation of the workers"
    checksums = set()
    for r in range(NPROC):
        log = job.rank(r, 0)
        assert log["result"]["iteration"] == 1, log
        assert [f["rank"] for f in log["restarts"][0]["faults"] if f["type"] == "RuntimeError"][:1] == [2]
        assert log["restarts"][0]["terminated"] == []
        checksums.add(log["result"]["checksum"])
    assert len(checksums) == 1
    assert "will restart worker group" not in job.output


@pytest.mark.parametrize("shared_store", [True, False], ids=["agent_store", "own_store"])
# Rank 3's death (33-40 s each) runs with the slow tests: rank 0's covers the same torchrun restart
# and more (without the shared store, rank 0's process hosts the store).
@pytest.mark.parametrize("victim", [pytest.param(3, marks=pytest.mark.slow), 0], ids=["rank3", "rank0"])
def test_a_killed_worker_makes_torchrun_restart_every_worker_and_the_new_incarnation_completes(
    tmp_path: pathlib.Path, shared_store: bool, victim: int
) -> None:
    plan = {"steps": 10, "faults": [{"iteration": 0, "rank": victim, "step": 3, "kind": "sigkill",
                                     "restart_count": 0}],
            # Without the shared store, killed rank 0's store host (forked into rank 0's process group, which
            # torchrun no longer signals: it stops only the workers still running) serves on until no monitor
            # has heartbeat for heartbeat_timeout: 10 s here (60 s by default).
            "wrapper": {"heartbeat_interval": 2, "heartbeat_timeout": 10}}
    job = run_torchrun(tmp_path, plan, max_restarts=1, shared_store=shared_store)
    assert job.returncode == 0, job.output[-8000:]
    assert not job.left, job.left
    assert "exitcode: -9" in job.output
    assert job.incarnations() == {1}, "torchrun stops the survivors: only incarnation 1 writes its results"
    # The new incarnation starts afresh in torchrun's (possibly shared) store: no stale seat or barrier.
    completed_fresh(job, 1)
    assert "seat of rank" not in job.output


def test_without_max_restarts_a_killed_worker_ends_the_job_and_nothing_is_left(tmp_path: pathlib.Path) -> None:
    plan = {"steps": 10, "faults": [{"iteration": 0, "rank": 1, "step": 3, "kind": "sigkill"}]}
    start = time.monotonic()
    job = run_torchrun(tmp_path, plan, max_restarts=0)
    assert job.returncode != 0
    assert "exitcode: -9" in job.output
    assert not job.left, job.left
    assert time.monotonic() - start < 90


@pytest.mark.parametrize("status", [EXIT_CODE_CONTEXT_LOST, EXIT_CODE_UNRELEASABLE], ids=["lost_context_76",
                                                                                         "unreleasable_75"])
def test_an_exit_status_asking_for_a_new_process_is_a_torchrun_restart(tmp_path: pathlib.Path, status: int) -> None:
    plan: dict[str, Any]
    if status == EXIT_CODE_CONTEXT_LOST:
        # Rank 1's health check finds its CUDA context lost: it leaves the job with 76.
        plan = {"steps": 10, "wrapper": {"raise_in_hook": {"hook": "health_check", "rank": 1, "iteration": 0,
                                                           "kind": "context_lost", "restart_count": 0}}}
    else:
        # Rank 2 swallows the restart's interruption and stays in the function: 75 after barrier_timeout (9 s:
        # it must exceed hard_timeout + the default termination_grace_time of 5 s).
        plan = {"steps": 10, "pg_timeout": 30,
                "wrapper": {"soft_timeout": 2, "hard_timeout": 3, "barrier_timeout": 9},
                "faults": [{"iteration": 0, "rank": 2, "step": 3, "kind": "swallow_restart", "restart_count": 0},
                           # Late, so that rank 2 is in its loop before the restart comes (at once, a
                           # fast rank 1 could restart the job while rank 2 was still in step 2).
                           {"iteration": 0, "rank": 1, "step": 3, "kind": "delayed_exception:1.0",
                            "restart_count": 0}]}
    job = run_torchrun(tmp_path, plan, max_restarts=1)
    assert job.returncode == 0, job.output[-8000:]
    assert f"exitcode: {status}" in job.output, job.output[-8000:]
    assert not job.left, job.left
    completed_fresh(job, 1)
