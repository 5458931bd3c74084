"""The nested-restarter log contract: what an outer restarter reads on standard output."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from inprocess.launch import free_port
from inprocess.nested_restarter import NestedRestarterCallback, status_line

pytestmark = pytest.mark.multiprocess

# A one-rank job that fails once, restarts, and then completes or is aborted.
PROGRAM = """
import datetime, sys
import inprocess
from inprocess.nested_restarter import (NestedRestarterAborted, NestedRestarterFinalized,
    NestedRestarterHandlingCompleted, NestedRestarterHandlingStarting)

aborted = sys.argv[1] == "abort"
initialize = NestedRestarterHandlingCompleted()
if aborted:
    # Compose runs its last member first: the controller aborts before the status line is written.
    initialize = inprocess.Compose(initialize, inprocess.initialize.RetryController(max_iterations=1))

@inprocess.Wrapper(
    initialize=initialize,
    abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), NestedRestarterHandlingStarting()),
    completion=NestedRestarterFinalized(),
    terminate=NestedRestarterAborted(),
    soft_timeout=datetime.timedelta(seconds=5), hard_timeout=datetime.timedelta(seconds=10),
    barrier_timeout=datetime.timedelta(seconds=20),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    print("iteration", call_wrapper.iteration, flush=True)
    if call_wrapper.iteration == 0:
        raise RuntimeError("first attempt fails")
    return "done"

try:
    print("result", train(), flush=True)
except inprocess.RestartAbort as e:
    print("aborted", e, flush=True)
"""

LINE = re.compile(
    r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[ALWAYS\] \[InprocessRestarter\.Restarter\] "
    r"\[NestedRestarter\] name=\[InProcess\] (state=\w+(?: stage=\w+)?)$"
)


def run(outcome: str) -> list[str]:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    res = subprocess.run([sys.executable, "-c", PROGRAM, outcome], env=env, capture_output=True, text=True,
                         timeout=90)
    assert res.returncode == 0, res.stderr
    events = []
    for line in res.stdout.splitlines():
        m = LINE.match(line)
        if m:
            events.append(m.group(1))
        else:
            assert "NestedRestarter" not in line, f"malformed contract line: {line!r}"
            events.append(line)
    return events


def test_a_restart_then_completion_writes_the_contract_in_order() -> None:
    assert run("complete") == [
        "state=initialize",
        "iteration 0",
        "state=handling stage=starting",
        "state=handling stage=completed",
        "iteration 1",
        "state=finalized",
        "result done",
    ]


def test_a_rank_that_leaves_writes_aborted() -> None:
    events = run("abort")
    assert events[:3] == ["state=initialize", "iteration 0", "state=handling stage=starting"]
    assert events[3] == "state=aborted"
    assert events[4].startswith("aborted iteration=1 reached max_iterations=1")


def test_only_the_special_rank_writes() -> None:
    import logging

    from inprocess.nested_restarter import restarter_logger
    from inprocess.state import FrozenState

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    collect = Collect()
    restarter_logger().addHandler(collect)
    try:
        hook = NestedRestarterCallback("finalized", special_rank=1)
        for rank in (0, 1, 2):
            hook(FrozenState(initial_rank=rank, initial_world_size=3, rank=rank, world_size=3))
    finally:
        restarter_logger().removeHandler(collect)
    assert seen == [status_line("finalized")] == ["[NestedRestarter] name=[InProcess] state=finalized"]
    with pytest.raises(ValueError, match="special_rank=-1"):
        NestedRestarterCallback("finalized", special_rank=-1)
