"""Nothing of the wrapper outlives the call: stores, CallWrappers, threads, sockets, child processes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from inprocess.launch import free_port

pytestmark = pytest.mark.multiprocess

WORKER = pathlib.Path(__file__).parent / "workers" / "lifetime_worker.py"


@pytest.mark.parametrize(
    ("ending", "outcome"),
    [("return", "'done'"), ("restart_abort", "RestartAbort"), ("failing_hook", "ValueError")],
)
def test_nothing_of_the_wrapper_outlives_the_call(ending: str, outcome: str) -> None:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    res = subprocess.run([sys.executable, str(WORKER), ending], env=env, capture_output=True, text=True,
                         timeout=90)
    assert res.returncode == 0, res.stderr[-4000:]
    left = json.loads(res.stdout.strip().splitlines()[-1])
    assert left == {"outcome": outcome, "stores": [], "call_wrappers": 0, "threads": [], "sockets": [],
                    "children": []}, res.stderr[-4000:]
