"""Store keys scoped to the launcher's incarnation of the job (torchrun's run id and
restart count, SLURM's job and restart count)."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from inprocess.control.incarnation import INCARNATION_VARS, call_prefix, job_incarnation
from inprocess.control.protocol import RestartProtocol, done_key, monitor_heartbeat_key
from inprocess.exception import InternalError
from inprocess.processes.contract import MonitorConfig, NodeAgentConfig, StoreHostConfig

TORCHRUN_0 = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}
TORCHRUN_1 = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_the_incarnation_names_what_each_launcher_sets() -> None:
    assert job_incarnation({}) == ""
    assert job_incarnation({"PATH": "/bin"}) == ""
    assert job_incarnation(TORCHRUN_0) == "torchrun.job.0"
    assert job_incarnation({"SLURM_JOB_ID": "81", "SLURM_STEP_ID": "2", "SLURM_RESTART_COUNT": "1"}) == "slurm.81.1"
    # Requeued jobs have SLURM_RESTART_COUNT; a first run has none: still a distinct, stable name.
    assert job_incarnation({"SLURM_JOB_ID": "81", "SLURM_STEP_ID": "2"}) == "slurm.81."
    # torchrun inside an allocation: both.
    assert job_incarnation({**TORCHRUN_1, "SLURM_JOB_ID": "81"}) == "torchrun.job.1+slurm.81."


def test_a_later_step_of_the_job_shares_its_incarnation_and_a_requeue_does_not() -> None:
    # A replacement node's processes come in a step of their own (srun --jobid: SLURM_STEP_ID 1, 2, ...):
    # they join the training step's incarnation. A process of the job before its requeue does not.
    training = {"SLURM_JOB_ID": "81", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}
    assert job_incarnation({**training, "SLURM_STEP_ID": "3"}) == job_incarnation(training)
    assert job_incarnation({**training, "SLURM_RESTART_COUNT": "0"}) != job_incarnation(training)
    assert job_incarnation({"SLURM_JOB_ID": "81", "SLURM_STEP_ID": "0"}) != job_incarnation(training)


def test_every_launcher_variable_changes_the_incarnation() -> None:
    base = {name: "1" for name in INCARNATION_VARS}
    for name in INCARNATION_VARS:
        assert job_incarnation({**base, name: "2"}) != job_incarnation(base), name


def test_a_run_id_with_a_slash_adds_no_key_level() -> None:
    incarnation = job_incarnation({"TORCHELASTIC_RUN_ID": "team/exp 1", "TORCHELASTIC_RESTART_COUNT": "3"})
    assert "/" not in incarnation
    assert call_prefix(0, incarnation) == "inprocess/torchrun.team%2Fexp%201.3/0/"


def test_the_keys_of_two_incarnations_differ_and_without_one_they_stay_as_they_were() -> None:
    first, again = job_incarnation(TORCHRUN_0), job_incarnation(TORCHRUN_1)
    assert call_prefix(0) == "inprocess/0/"
    assert done_key(2) == "inprocess/2/done"
    assert monitor_heartbeat_key(0, 3) == "inprocess/0/monitors/3"
    assert done_key(0, first) != done_key(0, again)
    assert monitor_heartbeat_key(0, 3, first) != monitor_heartbeat_key(0, 3, again)
    assert done_key(0, first).startswith(call_prefix(0, first))


@pytest.mark.parametrize(("call", "incarnation", "message"), [
    (-1, "", "call=-1: expected a wrapped call index"),
    ("0", "", "call='0': expected a wrapped call index"),
    (0, "a/b", "incarnation='a/b': expected no '/'"),
])
def test_a_bad_prefix_is_refused_naming_the_value(call: object, incarnation: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call_prefix(call, incarnation)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_new_incarnation_takes_its_seats_in_a_store_its_predecessor_wrote_to() -> None:
    # torchrun's agent store outlives the workers: the killed incarnation's seats are still there.
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timeout)
    old = RestartProtocol(client, 0, incarnation=job_incarnation(TORCHRUN_0))
    assert old.take_seat(0, 3)
    assert old.take_seat(1, 3)
    # Without the incarnation the same store would refuse the seat (the bug this scoping removes).
    unscoped = RestartProtocol(client, 0)
    assert unscoped.take_seat(0, 3) and unscoped.take_seat(1, 3)
    with pytest.raises(InternalError, match=r"barrier 0: seat of rank 3 holds '1', expected ''"):
        RestartProtocol(client, 0).take_seat(0, 3)
    new = RestartProtocol(client, 0, incarnation=job_incarnation(TORCHRUN_1))
    assert new.take_seat(0, 3)
    assert new.read_seat(3) == "0" and old.read_seat(3) == "1"


def test_the_helpers_are_told_the_incarnation_on_their_command_line() -> None:
    incarnation = job_incarnation(TORCHRUN_1)
    monitor = MonitorConfig(store_host="127.0.0.1", store_port=29500, call=0, incarnation=incarnation, rank=1,
                            heartbeat_fd=3, pid=1234, grace_s=1.0, store_timeout_s=5.0, barrier_timeout_s=5.0)
    assert f"--incarnation={incarnation}" in monitor.to_argv()
    assert MonitorConfig.from_argv(monitor.to_argv()).incarnation == incarnation
    agent = NodeAgentConfig(store_host="h", store_port=1, call=0, incarnation=incarnation, node="0", slots=2,
                            store_timeout_s=5.0, connect_timeout_s=5.0)
    assert NodeAgentConfig.from_argv(agent.to_argv()).incarnation == incarnation
    host = StoreHostConfig(port=0, world_size=2, idle_timeout_s=5.0)
    assert host.incarnation == "" and StoreHostConfig.from_argv(host.to_argv()).incarnation == ""
