"""The brake on restart storms (inprocess/engine/storm.py): the same cause, restart after restart."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Optional

import pytest

from conftest import WORKERS, leftover_processes
from inprocess.control.protocol import FaultRecord
from inprocess.engine.restart_record import RestartRecord
from inprocess.engine.storm import ENV_VAR, StormBrake, StormLimits, message_shape

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


def test_three_quick_restarts_with_one_cause_are_a_storm_and_the_back_off_doubles_up_to_its_limit():
    brake = StormBrake(StormLimits(repeats=3, first_backoff_s=1.0, max_backoff_s=4.0))
    brake.started("h", 0)
    t = 1 * S
    verdicts = []
    for i in range(6):
        v = brake.observe(restart(i, refused(1 + i % 2, i, 40000 + i)), "h", t)
        verdicts.append(v)
        t += int((0.05 + v.backoff_s) * S)  # each iteration fails 50 ms after its back-off
    assert [v.repeats for v in verdicts] == [1, 2, 3, 4, 5, 6]  # the rank may change: the cause is the same
    assert [v.backoff_s for v in verdicts] == [0, 0, 1.0, 2.0, 4.0, 4.0]
    assert [v.log for v in verdicts] == ["usual", "usual", "storm", "quiet", "quiet", "quiet"]
    assert brake.in_storm


def test_another_cause_ends_the_storm_and_is_logged_as_usual():
    brake = StormBrake(StormLimits())
    brake.started("h", 0)
    for i in range(4):
        brake.observe(restart(i, refused(1, i, 40000)), "h", (i + 1) * S // 10)
    assert brake.in_storm
    other = FaultRecord(2, 4, "exception", "ValueError", "bad batch")
    v = brake.observe(restart(4, other), "h", S)
    assert (v.repeats, v.backoff_s, v.log) == (1, 0.0, "usual")
    assert not brake.in_storm


def test_slow_repeats_are_counted_but_are_no_storm():
    """A function blocked past soft_timeout every iteration restarts every soft_timeout, for ever."""
    brake = StormBrake(StormLimits(within_s=60))
    brake.started("h", 0)
    records = []
    for i in range(5):
        timeout = FaultRecord(3, i, "soft_timeout", "TimeoutError",
                              f"no automatic progress for {90 + i}.0s (soft_timeout=90s)")
        records.append(restart(i, timeout))
        v = brake.observe(records[-1], "h", (i + 1) * 91 * S)
        assert (v.backoff_s, v.log) == (0.0, "usual")
    assert records[-1].repeats == 5
    summary = records[-1].summary(active_world_size=4, world_size=4)
    assert "the same rank (3) timed out 5 times in a row" in summary


def test_decisions_of_different_leaders_hosts_count_as_quick():
    """Two hosts' monotonic clocks cannot be compared: the repeat alone counts, on every rank alike."""
    brake = StormBrake(StormLimits(repeats=2))
    brake.started("a", 5 * S)
    brake.observe(restart(0, refused(1, 0, 1)), "b", 1)
    assert brake.observe(restart(1, refused(1, 1, 2)), "a", 10_000 * S).backoff_s == 1.0


def test_off_keeps_the_count_but_never_backs_off():
    brake = StormBrake(StormLimits.from_environment({ENV_VAR: "off"}))
    brake.started("h", 0)
    for i in range(5):
        v = brake.observe(restart(i, refused(1, i, 1)), "h", i + 1)
    assert (v.repeats, v.backoff_s, v.log) == (5, 0.0, "usual")


@pytest.mark.parametrize("text, fields", [
    ("repeats=5", {"repeats": 5}),
    ("within=2m, backoff=500ms..10s, report=30s",
     {"within_s": 120.0, "first_backoff_s": 0.5, "max_backoff_s": 10.0, "report_every_s": 30.0}),
    ("backoff=2s", {"first_backoff_s": 2.0, "max_backoff_s": 2.0}),
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
])
def test_a_bad_limit_is_refused_naming_it(text: str, named: str):
    with pytest.raises(ValueError, match=ENV_VAR) as e:
        StormLimits.from_environment({ENV_VAR: text})
    assert named in str(e.value)


# -- a real job: every iteration fails at once, for the same reason -------------------------------


def run_storm_job(tmp_path: pathlib.Path, seconds: float, env: Optional[dict[str, str]] = None,
                  world_size: int = 2) -> tuple[list[dict[str, Any]], str, list[Optional[int]]]:
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
        # A rank that leaves at iteration 5 first restarts the other, which may then meet the limit at 6.
        assert r["ended"] == "RestartAbort" and "reached max_iterations=5" in r["message"], r
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
