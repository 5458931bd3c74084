"""Bad input at a job's start, as a new user meets it: named within seconds, and no C++ stack trace.

* Ranks launched with different ``WORLD_SIZE`` (or other settings every rank must share): barrier 0
  compares them (``inprocess/control/agreement.py``) and every rank ends at once, naming the values
  and the ranks, instead of waiting ``barrier_timeout`` in silence.
* A rank that never starts: the others say at INFO, every 15 s, that they wait and for whom
  (``inprocess/control/barrier_watch.py``), and after the timeout nothing prints torch's C++ stack
  trace (a write to the store host that had exited).
* ``describe_arrivals`` does not say "2 of 2 ranks arrived" about a barrier still waiting without
  saying why it can.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
from torch.distributed import TCPStore

from conftest import WORKERS, leftover_processes
from inprocess.control import agreement
from inprocess.control.barrier_watch import BarrierWatch
from inprocess.control.protocol import RestartProtocol
from inprocess.launch import free_port

STACK_TRACE = "Exception raised from"


def launch(tmp_path: pathlib.Path, world_sizes: list[int | None], barrier_timeout: float,
           timeout: float) -> tuple[list[int | None], list[str], float]:
    """ddp_worker.py as initial ranks 0..N-1, rank r with WORLD_SIZE=world_sizes[r] (None: not started):
    exit statuses, outputs, and how long the job took. The store host's idle timeout is 3 s: where the
    ranks that leave do not number the first rank's WORLD_SIZE, it exits by that timeout
    (inprocess/control/agreement.py)."""
    port = free_port(3)
    plan = {"steps": 2, "wrapper": {"barrier_timeout": barrier_timeout, "soft_timeout": 3, "hard_timeout": 6,
                                    "store_kwargs": {"host_idle_timeout_s": 3}}}
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "INPROCESS_TEST_OUT": str(tmp_path),
            "INPROCESS_TEST_PLAN": json.dumps(plan), "INPROCESS_TEST_LOG": "INFO"}
    procs = []
    start = time.monotonic()
    for rank, world_size in enumerate(world_sizes):
        if world_size is None:
            continue
        out = open(tmp_path / f"r{rank}.log", "w")
        env = {**base, "RANK": str(rank), "WORLD_SIZE": str(world_size)}
        procs.append((rank, out, subprocess.Popen([sys.executable, str(WORKERS / "ddp_worker.py")], env=env,
                                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)))
    codes: list[int | None] = [None] * len(world_sizes)
    try:
        for rank, _, proc in procs:
            codes[rank] = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    finally:
        for _, out, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            out.close()
    elapsed = time.monotonic() - start
    left = leftover_processes({proc.pid for _, _, proc in procs}, grace=10.0)
    assert not left, left
    outputs = [(tmp_path / f"r{r}.log").read_text() if (tmp_path / f"r{r}.log").exists() else ""
               for r in range(len(world_sizes))]
    return codes, outputs, elapsed


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ranks_that_disagree_on_world_size_end_at_once_naming_the_values_and_the_ranks(tmp_path):
    barrier_timeout = 90.0
    codes, outputs, elapsed = launch(tmp_path, [2, 3], barrier_timeout, timeout=130)
    both = "\n".join(outputs)
    assert codes == [17, 17], both  # the worker's status for a wrapped call that raised
    # Less than the barrier's timeout, with the start of two interpreters importing torch on a loaded machine.
    assert elapsed < barrier_timeout - 20, (elapsed, both)
    for out in outputs:
        assert "the ranks of this job disagree on WORLD_SIZE: initial rank" in out, both
        assert ("initial rank 1 has '3', initial rank 0 (the first to arrive at barrier 0) has '2'" in out
                or "initial rank 0 has '2', initial rank 1 (the first to arrive at barrier 0) has '3'" in out), out
    assert {"SettingsMismatch", "RestartAbort"} == {line.split("): ")[1].split(":")[0] for out in outputs
                                                   for line in out.splitlines() if "leaves the job" in line}, both
    assert STACK_TRACE not in both, both


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_rank_waiting_for_one_that_never_started_says_so_and_times_out_without_a_stack_trace(tmp_path):
    codes, outputs, elapsed = launch(tmp_path, [2, None], 20.0, timeout=100)
    out = outputs[0]
    assert codes[0] == 17, out
    assert ("barrier 0: 1 of 2 ranks arrived; missing initial rank 1; initial rank 0 waits (as leader), 5 s left"
            in out), out
    assert "BarrierTimeout: barrier 0: 1 of 2 ranks arrived; missing initial rank 1" in out, out
    assert "could not record its termination" not in out, out
    assert STACK_TRACE not in out, out


@pytest.fixture
def protocol():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    yield RestartProtocol(client, initial_world_size=2)
    del client, server


def test_a_barrier_counted_complete_but_undecided_says_why_it_can_be(protocol):
    protocol.arrive(0, 0, 2)
    protocol.arrive(0, 1, 3)  # expected 3: its arrival does not complete the count, nobody sets ready
    text = protocol.describe_arrivals(0, 2)
    assert text.startswith("barrier 0: 2 of 2 ranks arrived, yet it was not decided: the arrival that completes "
                           "the count sets ready, unless it expected another number of ranks (another WORLD_SIZE)")


def test_the_leaders_report_names_the_ranks_it_misses_and_the_others_say_they_wait(protocol, caplog):
    protocol.arrive(0, 0, 2)
    watch = BarrierWatch(0, lambda barrier: 2, reader=lambda: protocol, every_s=0.2)
    try:
        with caplog.at_level("INFO", logger="inprocess"):
            watch.begin("barrier 0 (leader)", 30.0)
            time.sleep(0.5)
            watch.end()
            watch.begin("barrier 1", None)
            time.sleep(0.3)
            watch.end()
            time.sleep(0.3)  # no wait: no report
    finally:
        watch.close()
    lines = caplog.messages
    assert lines[0].startswith("barrier 0: 1 of 2 ranks arrived; missing initial rank 1; initial rank 0 waits "
                               "(as leader), 30 s left"), lines
    assert "barrier 1: waiting for its decision; initial rank 0 waits" in lines, lines
    assert len(lines) <= 4, lines


def test_a_watch_reports_nothing_of_a_wait_that_is_not_a_barriers():
    watch = BarrierWatch(0, lambda barrier: 2, every_s=0.05)
    watch.begin("iteration 3 outcome", 10.0)
    time.sleep(0.2)
    watch.end()
    watch.close()
    assert watch.reports == 0


def test_the_difference_names_the_setting_the_values_and_the_ranks():
    first = {"initial_world_size": "2", "soft_timeout": "0:01:00", "function": "train.main"}
    assert agreement.difference(first, dict(first), 0, 1) is None
    why = agreement.difference(first, {**first, "soft_timeout": "0:00:30"}, 0, 3)
    assert why == ("the ranks of this job disagree on soft_timeout: initial rank 3 has '0:00:30', initial rank 0 "
                   "(the first to arrive at barrier 0) has '0:01:00'; every rank of a job must be launched with the "
                   "same soft_timeout")


def test_a_disagreeing_rank_ends_barrier_0_for_the_others(protocol):
    settings = {"initial_world_size": "2", "function": "m.f"}
    agreement.agree_at_barrier_zero(protocol, 0, settings)  # the first: nothing to compare
    agreement.agree_at_barrier_zero(protocol, 1, dict(settings))  # agrees
    with pytest.raises(agreement.SettingsMismatch, match="disagree on WORLD_SIZE: initial rank 2 has '3'"):
        agreement.agree_at_barrier_zero(protocol, 2, {**settings, "initial_world_size": "3"})
    decision = protocol.wait_decision(0, 5.0)
    assert decision.abort is not None and "disagree on WORLD_SIZE" in decision.abort
    assert decision.membership.initial_world_size == 2
    assert protocol.counted.check([protocol.key(0, "ready")])  # a leader waiting for the count wakes


def test_a_closed_watch_lets_go_of_the_rank_s_connection(protocol):
    """The protocol holds its watch, and the watch's reader the protocol: closed, the cycle is broken, so
    that the rank's connection closes when the protocol is dropped, not at a garbage collection."""
    watch = BarrierWatch.on(protocol, 0, lambda barrier: 2)
    assert protocol.counted.watch is watch
    watch.begin("barrier 0", 5.0)
    watch.end()
    watch.close()
    assert protocol.counted.watch is None and watch._reader is None
