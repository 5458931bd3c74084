"""What a job's log holds: each thing said once, in words a user knows, in one format."""

from __future__ import annotations

import logging
import re

import pytest

from conftest import WORKERS, leftover_processes
from inprocess.processes.contract import rank_log_format
from inprocess.state import State

pytestmark = pytest.mark.timeout(60)


def test_an_unavailable_gpu_check_says_so_once_per_process(caplog, monkeypatch):
    from inprocess import health_check
    from inprocess.gpu import libraries

    monkeypatch.setattr(health_check, "_said_unavailable", set())
    monkeypatch.setattr(libraries, "cuda_driver", lambda: (None, "libcuda.so.1 not found"))
    check = health_check.CudaHealthCheck()
    state = State(initial_rank=0, initial_world_size=1, rank=0, world_size=1).freeze()
    with caplog.at_level(logging.DEBUG, logger="inprocess"):
        for _ in range(3):
            assert check(state) is state
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "unavailable" in r.getMessage()]
    assert [level for level, _ in said] == [logging.INFO, logging.DEBUG, logging.DEBUG], said
    assert said[0][1] == ("CudaHealthCheck unavailable: libcuda.so.1 not found; skipped (said once: later "
                          "checks skip at DEBUG level)")


def test_a_helper_on_the_rank_s_stderr_takes_the_rank_s_format(monkeypatch):
    package = logging.getLogger("inprocess")
    monkeypatch.setattr(package, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    assert rank_log_format() == "%(message)s"  # no handler: Python shows the message alone
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    assert rank_log_format() == "%(asctime)s [%(levelname)s] %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter("{message}", style="{"))
    assert rank_log_format() == "%(message)s"


@pytest.mark.multiprocess
def test_a_migrated_job_s_log(tmp_path):
    from inprocess.launch import LocalJob

    with LocalJob([str(WORKERS / "noise_worker.py")], 3) as job:
        job.wait(50)
        assert not leftover_processes({rp.popen.pid for rp in job.ranks}, grace=10.0)
    assert [rp.returncode for rp in job.ranks] == [0, -9, 0], job.outputs()
    output = job.outputs()
    lines = [line for line in output.splitlines() if line and not line.startswith("--- rank")]
    # Said once per process, not once per health check (three per rank here).
    for rank in (0, 2):
        said = job.ranks[rank].output.count("CudaHealthCheck unavailable")
        assert said == 1, job.ranks[rank].output
    # The monitor's line on the rank's stderr, in the rank's format.
    monitor = [line for line in lines if "processes.monitor" in line]
    assert len(monitor) == 1 and re.match(r"WARNING inprocess\.processes\.monitor: rank 1: rank process \d+ died",
                                          monitor[0]), output
    # INFO lines in words: no internal names of kinds or phases.
    info = [line for line in lines if line.startswith("INFO ")]
    assert any("restarted after iteration 0" in line for line in info), output
    for word in ("after_restart", "health_check", "RESTART_BARRIER", "HEALTH_CHECK"):
        assert not [line for line in info if word in line], (word, output)
