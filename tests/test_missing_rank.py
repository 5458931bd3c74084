"""A rank that never arrives: every rank, rank 0 included, fails within barrier_timeout naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import WORKERS, leftover_processes
from inprocess.launch import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

BARRIER_S = 8.0


def test_three_of_four_ranks_launched(tmp_path):
    port = free_port()
    plan = {"calls": 1, "barrier_timeout": BARRIER_S, "soft_timeout": 2, "hard_timeout": 4,
            "termination_grace_time": 1}
    procs, ended = [], {}
    try:
        for rank in range(3):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       INPROCESS_TEST_OUT=str(tmp_path), INPROCESS_TEST_PLAN=json.dumps(plan))
            procs.append(subprocess.Popen([sys.executable, str(WORKERS / "sequential_worker.py")], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True))
        for rank, p in enumerate(procs):
            err = p.communicate(timeout=90)[1]
            ended[rank] = time.monotonic()
            assert p.returncode == 17, f"rank {rank}: exit {p.returncode}\n{err[-3000:]}"
        left = leftover_processes({p.pid for p in procs}, grace=5.0)
        assert not left, f"still running after every rank exited: {left}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for rank in range(3):
        exception = json.loads((tmp_path / f"rank{rank}.json").read_text())["exception"]
        expected = "BarrierTimeout: barrier 0: 3 of 4 ranks arrived; missing initial rank 3 ("
        assert exception.startswith(expected), exception
    # The ranks leave together: rank 0 does not wait a second barrier_timeout for its store host.
    assert max(ended.values()) - min(ended.values()) < BARRIER_S / 2, ended
