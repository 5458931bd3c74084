"""The brake on restart storms (inprocess/engine/storm.py): the same cause, restart after restart."""

from __future__ import annotations

import datetime
import json
import pathlib
import time
from typing import Any

import pytest
from torch.distributed import TCPStore

from conftest import WORKERS, leftover_processes
from inprocess.control.membership import Membership
from inprocess.control.phases import Phase
from inprocess.control.protocol import Decision, FaultRecord, RestartProtocol
from inprocess.engine.restart_record import RestartRecord
from inprocess.engine.storm import (
    ENV_VAR,
    MIN_STEPS,
    REPORTERS,
    Progress,
    StormBrake,
    StormLimits,
    message_shape,
    progress_key,
)
from inprocess.state import Mode, State

S = 1_000_000_000  # ns


def restart(iteration: int, *faults: FaultRecord) -> RestartRecord:
    return RestartRecord(iteration, list(faults), len(faults), [])


def refused(rank: int, iteration: int, port: int) -> FaultRecord:
    return FaultRecord(rank, iteration, "exception", "DistNetworkError",
                       f"connect to 127.0.0.1:{port} refused (attempt {iteration})")


def test_message_shape_drops_what_changes_between_two_occurrences():
    assert message_shape("rank process 7787 died in iteration 2") == "rank process # died in iteration #"
    assert message_shape("at 0x7f3a2c  [127.0.0.1]:4503") == message_shape("at 0x11  [127.0.0.2]:9")
    assert message_shape("bad batch") != message_shape("bad shape")


def decided(t_s: float, progress: Progress | None = None, host: str = "h") -> Decision:
    """A decision of ``host`` at ``t_s`` (its leader's clock) carrying the leader's ``progress``."""
    return Decision(1, Membership.all_active(4), [], [], 0, 0, t_ns=int(t_s * S), host=host,
                    progress=None if progress is None else progress.fields())


def state(active_rank: int | None) -> State:
    """A rank's state in an iteration: active with ``active_rank``, or a spare (None)."""
    s = State(initial_rank=0, initial_world_size=16, rank=0, world_size=16)
    s.mode, s.active_rank = (Mode.INACTIVE, None) if active_rank is None else (Mode.ACTIVE, active_rank)
    return s


def stalled(brake: StormBrake, ran_ms: int = 3, restart_ms: int = 20, steps: int = 0) -> Progress:
    """The leader's judgement of an iteration that ran ``ran_ms`` and restarted in ``restart_ms``."""
    return Progress(brake.judge_measured(0, steps, ran_ms * 1_000_000, restart_ms * 1_000_000, "h", 0).stalls,
                    0, steps, ran_ms, restart_ms)


def test_three_quick_restarts_without_progress_are_a_storm_and_the_back_off_doubles_up_to_its_limit():
    brake = StormBrake(StormLimits(repeats=3, first_backoff_s=1.0, max_backoff_s=4.0))
    brake.started(decided(0))
    t = 1.0
    verdicts = []
    for i in range(6):
        v = brake.observe(restart(i, refused(1 + i % 2, i, 40000 + i)), decided(t, stalled(brake)))
        verdicts.append(v)
        t += 0.05 + v.backoff_s  # each iteration fails 50 ms after its back-off
    assert [v.repeats for v in verdicts] == [1, 2, 3, 4, 5, 6]  # the rank may change: the cause is the same
    assert [v.stalls for v in verdicts] == [1, 2, 3, 4, 5, 6]
    assert [v.backoff_s for v in verdicts] == [0, 0, 1.0, 2.0, 4.0, 4.0]
    assert [v.log for v in verdicts] == ["usual", "usual", "storm", "quiet", "quiet", "quiet"]
    assert brake.in_storm


def test_independent_faults_with_steps_between_them_are_no_storm_whatever_their_cause():
    """P11's job: one message, a different rank each time, 60 steps of training between two faults."""
    brake = StormBrake(StormLimits())
    brake.started(decided(0))
    nccl = "NCCL error in: ProcessGroupNCCL.cpp:1968, unhandled system error, NCCL version 2.21.5"
    for i in range(6):
        judged = brake.judge_measured(0, 60, 1_500_000_000, 20_000_000, "h", int((i + 1) * 1.5 * S))
        v = brake.observe(restart(i, FaultRecord(i % 4, i, "exception", "DistBackendError", nccl)),
                          decided((i + 1) * 1.5, judged))
        assert (v.stalls, v.backoff_s, v.log) == (0, 0.0, "usual"), (i, v)
    assert v.repeats == 6  # the same cause, counted for the summary: no back-off for it
    assert not brake.in_storm


def test_an_iteration_that_ran_longer_than_its_restart_progressed_without_reporting_a_step():
    """NVRx's basic example reports no step on most ranks: how long the function ran against how long
    its restart took tells a job that trains from one that fails at once."""
    brake = StormBrake(StormLimits(run_ratio=1.0))
    ms = 1_000_000
    assert brake.judge_measured(0, 0, 250 * ms, 20 * ms, "h", 0).stalls == 0  # ran 250 ms, restart 20 ms
    assert brake.judge_measured(0, 0, 5 * ms, 20 * ms, "h", 0).stalls == 1  # failed at once
    assert brake.judge_measured(0, 0, 50 * ms, 2 * ms, "h", 0).stalls == 1  # under MIN_RUN_S: failed at once
    assert brake.judge_measured(0, 0, 300 * ms, 900 * ms, "h", 0).stalls == 1  # ran less than it restarted
    assert brake.judge_measured(0, -1, 5 * ms, 20 * ms, "h", 0).stalls == 1  # a spare leader: time alone
    assert brake.judge_measured(0, 1, 5 * ms, 20 * ms, "h", 0).stalls == 1  # one ping: no whole step yet
    assert brake.judge_measured(0, MIN_STEPS, 5 * ms, 20 * ms, "h", 0).stalls == 0
    assert brake.judge_measured(1, -1, 5 * ms, 20 * ms, "h", 0).stalls == 0  # a reporter made progress


def test_progress_ends_a_storm_and_the_next_restart_is_logged_as_usual():
    brake = StormBrake(StormLimits())
    brake.started(decided(0))
    for i in range(4):
        brake.observe(restart(i, refused(1, i, 40000)), decided((i + 1) / 10, stalled(brake)))
    assert brake.in_storm
    other = FaultRecord(2, 4, "exception", "ValueError", "bad batch")
    v = brake.observe(restart(4, other), decided(1.0, Progress(0, 1, 40, 900, 20)))
    assert (v.repeats, v.stalls, v.backoff_s, v.log) == (1, 0, 0.0, "usual")
    assert not brake.in_storm


def test_different_causes_without_progress_are_a_storm_and_the_warning_says_what_was_seen(caplog):
    brake = StormBrake(StormLimits())
    brake.started(decided(0))
    causes = [FaultRecord(1, 0, "exception", "FileNotFoundError", "data.bin"),
              FaultRecord(2, 1, "killed", "SIGKILL", "rank process died"),
              FaultRecord(3, 2, "exception", "KeyError", "'lr'")]
    for i, cause in enumerate(causes):
        record = restart(i, cause)
        v = brake.observe(record, decided((i + 1) / 10, stalled(brake, ran_ms=4, restart_ms=21)))
    assert (v.stalls, v.backoff_s, v.log) == (3, 1.0, "storm")
    text = brake.storm_warning(v)
    assert "3 restarts in a row without progress" in text
    assert "or less time than its restart took (4 ms against 21 ms, 4 ms against 21 ms" in text
    assert "different causes (on ranks 1, 2, 3), the last: rank 3 exception: KeyError" in text
    assert "fails the same way every time" not in text


def test_the_same_cause_on_one_rank_is_named_with_its_rank():
    brake = StormBrake(StormLimits())
    brake.started(decided(0))
    for i in range(3):
        v = brake.observe(restart(i, refused(1, i, 40000 + i)), decided((i + 1) / 10, stalled(brake)))
    text = brake.storm_warning(v)
    assert "the same cause each time, on rank 1 each time: rank 1 exception: DistNetworkError: connect to " \
           "127.0.0.1:40002 refused" in text, text
    assert "A store the function reaches is gone" in text  # the remedy of a recognised cause


def test_every_rank_follows_the_leaders_judgement_whatever_it_measured_itself():
    """Rank 0 reported steps, the others none (as NVRx's examples): they all take the decision's."""
    ranks = [StormBrake(StormLimits(repeats=2)) for _ in range(3)]
    for brake in ranks:
        brake.started(decided(0))
    ranks[0].phase_entered(Phase.RUNNING, state(0), None)
    for _ in range(5):
        ranks[0].step()
    for i in range(3):
        judged = Progress(i + 1, 0, 0, 3, 20)  # the leader's judgement: a stall
        verdicts = {(v.stalls, v.backoff_s, v.log) for v in
                    (b.observe(restart(i, refused(1, i, 1)), decided((i + 1) / 10, judged)) for b in ranks)}
        assert len(verdicts) == 1, verdicts


def test_a_joiner_takes_the_jobs_stall_count_from_its_admission():
    joiner = StormBrake(StormLimits(repeats=3))
    joiner.started(decided(1.0, Progress(4, 0, 0, 3, 20)))
    assert joiner.in_storm
    v = joiner.observe(restart(5, refused(1, 5, 1)), decided(1.1, Progress(5, 0, 0, 3, 20)))
    assert (v.stalls, v.log) == (5, "quiet")  # the storm was declared before it joined: no second warning


def test_the_leader_measures_its_own_iteration():
    brake = StormBrake(StormLimits())
    brake.started(decided(0))
    brake.phase_entered(Phase.RUNNING, state(0), None)
    for _ in range(3):
        brake.step()
    brake.phase_entered(Phase.ABORTING, state(0), None)
    judged = brake.judge()
    assert judged.steps == 3 and judged.stalls == 0
    brake.phase_entered(Phase.RUNNING, state(None), None)  # a spare's wait: no steps to count
    brake.phase_entered(Phase.ABORTING, state(None), None)
    assert brake.judge().steps == -1


def test_the_first_active_ranks_tell_the_leader_through_the_store_that_they_made_progress():
    """NVRx's examples: rank 0 reports steps (under atomic()), the leader (the rank that failed) none."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    p = RestartProtocol(TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)))
    brakes = {rank: StormBrake(StormLimits()) for rank in (0, 2, REPORTERS)}
    for rank, brake in brakes.items():
        brake.started(decided(0))
        brake.phase_entered(Phase.RUNNING, state(rank), p)
        if rank != 2:
            for _ in range(MIN_STEPS):
                brake.step()
        brake.phase_entered(Phase.ABORTING, state(rank), p)
        brake.phase_entered(Phase.RESTART_BARRIER, state(rank), p)
    judged = brakes[2].judge(p, 0)  # the leader failed at once, and reported no step
    assert (judged.reported, judged.steps, judged.stalls) == (1, 0, 0)  # rank REPORTERS is no reporter
    assert brakes[2].judge(p, 1).stalls == 1  # nobody reported progress in iteration 1
    p.delete_iteration(0)
    assert not p.counted.check([progress_key(p, 0)])  # deleted with the iteration's keys


def test_slow_repeats_are_counted_but_are_no_storm():
    """A function blocked past soft_timeout every iteration restarts every soft_timeout, for ever."""
    brake = StormBrake(StormLimits(within_s=60))
    brake.started(decided(0))
    records = []
    for i in range(5):
        timeout = FaultRecord(3, i, "soft_timeout", "TimeoutError",
                              f"no automatic progress for {90 + i}.0s (soft_timeout=90s)")
        records.append(restart(i, timeout))
        v = brake.observe(records[-1], decided((i + 1) * 91, stalled(brake, ran_ms=90_000)))
        assert (v.backoff_s, v.log) == (0.0, "usual")
    assert records[-1].repeats == 5
    summary = records[-1].summary(active_world_size=4, world_size=4)
    assert "the same rank (3) timed out 5 times in a row" in summary


def test_stalls_further_apart_than_within_are_no_storm():
    brake = StormBrake(StormLimits(within_s=1))
    brake.started(decided(1))
    for i in range(4):
        judged = brake.judge_measured(0, 0, 3_000_000, 20_000_000, "h", (i + 1) * 2 * S + S)
        v = brake.observe(restart(i, refused(1, i, 1)), decided((i + 1) * 2 + 1, judged))
        assert v.stalls == 0


def test_decisions_of_different_leaders_hosts_judge_progress_alone():
    """Two hosts' monotonic clocks cannot be compared: the pace is not judged, on every rank alike."""
    brake = StormBrake(StormLimits(repeats=2, within_s=1))
    brake.started(decided(5, host="a"))
    assert brake.judge_measured(0, 0, 3_000_000, 20_000_000, "b", 10_000 * S).stalls == 1


def test_a_decision_without_the_leaders_judgement_is_judged_here():
    brake = StormBrake(StormLimits(repeats=2))
    brake.started(decided(0))
    brake.phase_entered(Phase.RUNNING, state(0), None)
    brake.phase_entered(Phase.ABORTING, state(0), None)
    time.sleep(0.01)  # the restart took longer than the iteration ran
    assert brake.observe(restart(0, refused(1, 0, 1)), decided(0.1)).stalls == 1


def test_off_keeps_the_count_but_never_backs_off():
    brake = StormBrake(StormLimits.from_environment({ENV_VAR: "off"}))
    brake.started(decided(0))
    for i in range(5):
        v = brake.observe(restart(i, refused(1, i, 1)), decided((i + 1) / 10, stalled(brake)))
    assert (v.repeats, v.stalls, v.backoff_s, v.log) == (5, 5, 0.0, "usual")


def test_the_decision_carries_the_judgement_on_the_wire():
    decision = decided(1.5, Progress(2, 1, 7, 30, 12))
    again = Decision.from_json(decision.to_json().encode())
    assert Progress.from_fields(again.progress) == Progress(2, 1, 7, 30, 12)
    assert "progress" not in decided(1.5).to_json()  # barrier 0's decision is unchanged


@pytest.mark.parametrize("text, fields", [
    ("repeats=5", {"repeats": 5}),
    ("within=2m, backoff=500ms..10s, report=30s",
     {"within_s": 120.0, "first_backoff_s": 0.5, "max_backoff_s": 10.0, "report_every_s": 30.0}),
    ("backoff=2s", {"first_backoff_s": 2.0, "max_backoff_s": 2.0}),
    ("run=0.5x", {"run_ratio": 0.5}),
    ("run=2", {"run_ratio": 2.0}),
])
def test_limits_from_the_environment(text: str, fields: dict[str, Any]):
    limits = StormLimits.from_environment({ENV_VAR: text})
    for name, value in fields.items():
        assert getattr(limits, name) == value


@pytest.mark.parametrize("text, named", [
    ("repeats=1", "repeats=1"),
    ("repeats=x", "'repeats=x'"),
    ("backoff=10s..1s", "backoff=10s..1s"),
    ("within=fast", "'within=fast'"),
    ("speed=2", "'speed=2'"),
    ("run=fast", "'run=fast'"),
])
def test_a_bad_limit_is_refused_naming_it(text: str, named: str):
    with pytest.raises(ValueError, match=ENV_VAR) as e:
        StormLimits.from_environment({ENV_VAR: text})
    assert named in str(e.value)


# -- a real job: every iteration fails at once, for the same reason -------------------------------


def run_storm_job(tmp_path: pathlib.Path, seconds: float, env: dict[str, str] | None = None,
                  world_size: int = 2) -> tuple[list[dict[str, Any]], str, list[int | None]]:
    from inprocess.launch import LocalJob

    out = tmp_path / "out"
    out.mkdir()
    job_env = {"INPROCESS_TEST_OUT": str(out), "STORM_SECONDS": str(seconds), **(env or {})}
    with LocalJob([str(WORKERS / "storm_worker.py")], world_size, env=job_env) as job:
        job.wait(seconds + 60)
        left = leftover_processes({rp.popen.pid for rp in job.ranks}, grace=10.0)
        assert not left, f"processes of the job still running after every rank exited: {left}"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    return results, job.outputs(), [rp.returncode for rp in job.ranks]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_job_failing_at_once_every_iteration_backs_off_with_one_warning_and_few_lines(tmp_path):
    seconds = 12.0
    results, output, codes = run_storm_job(tmp_path, seconds)
    assert codes == [0, 0], output
    restarts = results[0]["restarts"]
    # Default limits: 3 quick restarts, then waits of 1, 2, 4, 8 s: at most 7 restarts in 12 s of storm
    # (without the brake, hundreds: benchmarks/restart_storm.py).
    assert 4 <= len(restarts) <= 7, output
    assert [r["repeats"] for r in restarts] == list(range(1, len(restarts) + 1))
    warnings = [line for line in output.splitlines() if "restart storm:" in line]
    assert len(warnings) == 1, output
    assert "rank 1 exception: RuntimeError: cannot reach the data server at 127.0.0.1:40002" in warnings[0]
    assert "RetryController(max_iterations=N)" in warnings[0] and ENV_VAR in warnings[0]
    # The usual lines for the first restarts, then nothing per restart: the whole job's output,
    # at INFO level, stays under a few lines per rank and per restart before the storm.
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("--- rank")]
    assert len(lines) <= 14, output
    assert "the same cause 2 times in a row (on rank 1 each time)" in output


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_retry_controller_still_ends_a_storm_at_its_iteration(tmp_path):
    """As in nvidia_resiliency_ext: a user's RetryController ends the job, whatever the brake does."""
    results, output, codes = run_storm_job(tmp_path, 60.0, env={"STORM_MAX_ITERATIONS": "5"})
    assert codes == [1, 1], output
    for r in results:
        # Every rank leaves at the decision the first RestartAbort causes (issue 31): the limit is met at 5.
        assert r["ended"] == "RestartAbort" and "iteration=5 reached max_iterations=5" in r["message"], r
    assert len([line for line in output.splitlines() if "restart storm:" in line]) == 1, output


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_function_blocked_past_soft_timeout_every_iteration_is_named_in_the_summary(tmp_path):
    """Restarted every soft_timeout, for ever: too slow for a storm, but the summary says it repeats."""
    results, output, codes = run_storm_job(tmp_path, 6.0, env={"STORM_MODE": "sleep", "STORM_SOFT_TIMEOUT": "1"})
    assert codes == [0, 0], output
    restarts = results[0]["restarts"]
    assert len(restarts) >= 3, output
    last = restarts[-1]["summary"]
    assert "rank 1 soft_timeout" in last, last
    assert f"the same rank (1) timed out {restarts[-1]['repeats']} times in a row" in last, last


# -- P11's job: independent faults, training between them -------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind, ping", [("nccl_error", True), ("nccl_error", False), ("sigkill", True)])
def test_independent_faults_on_different_ranks_with_training_between_them_restart_without_back_off(
        job, kind: str, ping: bool):
    """4 ranks, a fault on another rank after 60 steps (~1.5 s) of training, 4 times: every restart at once.

    With ``nccl_error`` the message is the same each time (a restart's cause that repeats). Without
    ``ping()`` the function reports no step: how long it ran against its restart says it progressed.
    SIGKILLed ranks leave (no spares): 4 ranks, then 3, then 2.
    """
    if kind == "sigkill":  # the job shrinks by one per kill: the last fault is an exception of rank 0
        faults = [{"iteration": i, "rank": r, "step": 59, "kind": kind} for i, r in enumerate((3, 1, 2))]
        faults.append({"iteration": 3, "rank": 0, "step": 59, "kind": "nccl_error"})
    else:
        faults = [{"iteration": i, "rank": (i + 1) % 4, "step": 59, "kind": kind} for i in range(4)]
    plan = {"steps": 62, "step_sleep": 0.025, "faults": faults, "no_ping": not ping}
    res = job(plan, timeout=150)
    survivors = [0] if kind == "sigkill" else [0, 1, 2, 3]
    output = res.describe()
    for r in survivors:
        assert res.returncodes[r] == 0, output
        restarts = res.rank(r)["restarts"]
        assert [x["iteration"] for x in restarts] == [0, 1, 2, 3], output
        assert [x["backoff_s"] for x in restarts] == [0.0] * 4, (r, restarts, output)
    assert "restart storm" not in output, output
    if kind == "nccl_error":
        assert "the same cause 4 times in a row" in output  # counted, named, and not braked
