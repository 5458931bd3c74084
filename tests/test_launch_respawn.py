"""``python -m inprocess.launch --respawn N``: a rank's process that must be replaced is started again.

The ranks here are stand-ins (STANDIN, a plain script without the wrapper): each life of a rank appends
what it saw (its environment, its pid, the time) to ``rank<r>.jsonl`` and then does what its plan says for
that life. What the launcher must do, each asserted on real processes: replace a process killed by a
signal or ended with 75/76 with the seat's environment plus INPROCESS_JOIN=1 and INPROCESS_RESPAWN_COUNT=k;
at most N times per seat, each after a doubling back-off; never a process that finished or left with its
own failure, never once the job is ending; and leave nothing running when interrupted or timed out.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from conftest import leftover_processes
from inprocess.launch import JOIN_VAR
from inprocess.respawn import (
    REPLACE_ME_STATUSES,
    RESPAWN_BACKOFF_CAP_S,
    RESPAWN_COUNT_VAR,
    RespawnPolicy,
    replacement_reason,
)

pytestmark = pytest.mark.multiprocess

# PLAN maps a rank to what each of its lives does, the last entry for every later life:
#   "sigkill"      SIGKILL itself;           "exit:N"  exit with status N;
#   "sleep"        sleep (until killed);     "ok"      exit 0;
#   "after:E"      exit 0 once the event file E exists in the output directory;
#   "zombie:R"     once rank R's first process has exited and 0.5 s more, write its /proc state ("Z" for a
#                  zombie, "" when reaped) to the event file "zombie", and exit 0.
#   "gone:R:sigkill", "gone:R:ok"   once rank R's first process has exited (not even a zombie left) and the
#                  launcher has seen it, SIGKILL itself or exit 0.
# Each life writes the event "rank<r>.life<k>" (k = 0 for the first process) when it starts.
STANDIN = r"""
import json, os, signal, sys, time
out = os.environ["RESPAWN_TEST_OUT"]
rank = int(os.environ["RANK"])
life = int(os.environ.get("INPROCESS_RESPAWN_COUNT", "0"))
plan = json.loads(os.environ["RESPAWN_TEST_PLAN"]).get(str(rank), ["ok"])
action = plan[min(life, len(plan) - 1)]
base = json.loads(os.environ["RESPAWN_TEST_BASE_ENV"])
seen = {k: v for k, v in os.environ.items() if base.get(k) != v and k != "RESPAWN_TEST_BASE_ENV"}
with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
    f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "env": seen, "argv": sys.argv[1:]}) + "\n")
open(os.path.join(out, f"rank{rank}.life{life}"), "w").close()

def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def wait_until(ready):
    deadline = time.monotonic() + 60  # a stand-in never outlives its test
    while not ready():
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.02)

name, _, arg = action.partition(":")
if name == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
elif name == "exit":
    sys.exit(int(arg))
elif name == "sleep":
    time.sleep(600)
elif name == "after":
    wait_until(lambda: os.path.exists(os.path.join(out, arg)))
elif name == "zombie":
    path = os.path.join(out, f"rank{arg}.jsonl")
    wait_until(lambda: os.path.exists(path) and os.path.getsize(path) > 0)
    with open(path) as f:
        pid = json.loads(f.readline())["pid"]
    wait_until(lambda: not running(pid))
    time.sleep(0.5)  # ten polls of the launcher
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = ""
    with open(os.path.join(out, "zombie"), "w") as f:
        f.write(state)
elif name == "gone":
    arg, then = arg.split(":")
    path = os.path.join(out, f"rank{arg}.jsonl")
    wait_until(lambda: os.path.exists(path) and os.path.getsize(path) > 0)
    with open(path) as f:
        pid = json.loads(f.readline())["pid"]
    wait_until(lambda: not running(pid))
    time.sleep(0.5)  # the launcher polls every 50 ms: it has seen that exit
    if then == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
"""


def write_standin(tmp_path: pathlib.Path) -> pathlib.Path:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    out = tmp_path / "out"
    out.mkdir()
    return script


def launcher_env(tmp_path: pathlib.Path, plan: dict[int, list[str]]) -> dict[str, str]:
    env = dict(os.environ, RESPAWN_TEST_OUT=str(tmp_path / "out"),
               RESPAWN_TEST_PLAN=json.dumps({str(r): p for r, p in plan.items()}))
    for name in ("OMP_NUM_THREADS", "INPROCESS_EVENTS_DIR", JOIN_VAR, RESPAWN_COUNT_VAR):
        env.pop(name, None)
    env["RESPAWN_TEST_BASE_ENV"] = json.dumps(env)
    return env


def lives(tmp_path: pathlib.Path, rank: int) -> list[dict[str, Any]]:
    """What each process of ``rank`` saw, oldest first."""
    path = tmp_path / "out" / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def every_pid(tmp_path: pathlib.Path) -> set[int]:
    """The pid of every rank process of the job: each leads its own process group (its session)."""
    return {life["pid"] for path in (tmp_path / "out").glob("rank*.jsonl") for life in lives(tmp_path, int(
        path.name[4:-6]))}


def launch(tmp_path: pathlib.Path, nproc: int, plan: dict[int, list[str]], *args: str,
           timeout: float = 90) -> subprocess.CompletedProcess[str]:
    script = write_standin(tmp_path)
    cmd = [sys.executable, "-m", "inprocess.launch", "--nproc", str(nproc), *args, str(script), "a1"]
    try:
        return subprocess.run(cmd, env=launcher_env(tmp_path, plan), capture_output=True, text=True,
                              timeout=timeout)
    finally:
        assert not leftover_processes(every_pid(tmp_path), grace=5.0)


def summary(res: subprocess.CompletedProcess[str]) -> str:
    return res.stderr.splitlines()[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("death", "reason"), [
    ("sigkill", "killed by SIGKILL"),
    ("exit:75", "exited with status 75 (the main thread could not be released after the abort)"),
    ("exit:76", "exited with status 76 (the CUDA context is lost)"),
])
def test_a_process_that_must_be_replaced_is_respawned_into_its_seat_as_a_joiner(
        tmp_path: pathlib.Path, death: str, reason: str) -> None:
    # Ranks 0 and 2 run until rank 1's replacement has started; rank 1 dies once, then finishes.
    plan = {0: ["after:rank1.life1"], 1: [death, "ok"], 2: ["after:rank1.life1"]}
    res = launch(tmp_path, 3, plan, "--ranks-per-node", "2", "--respawn", "2", "--respawn-backoff", "0.1")
    assert res.returncode == 0, res.stderr
    assert f"inprocess.launch: respawning rank 1 (attempt 1 of 2) in 0.1s: {reason}\n" in res.stderr
    status = "killed by SIGKILL" if death == "sigkill" else f"exited with status {death[5:]}"
    assert summary(res) == ("inprocess.launch: job finished: 3 of 3 seats finished; restarts unknown (no rank "
                            f"wrote events); 1 respawn; rank 1 {status} (respawned); exit status 0")
    first, second = lives(tmp_path, 1)
    assert first["pid"] != second["pid"]
    # The replacement has its seat's environment, variable for variable, and the two of a joiner.
    assert (JOIN_VAR not in first["env"]) and (RESPAWN_COUNT_VAR not in first["env"])
    assert second["env"] == {**first["env"], JOIN_VAR: "1", RESPAWN_COUNT_VAR: "1"}
    assert (second["env"]["RANK"], second["env"]["LOCAL_RANK"], second["env"]["GROUP_RANK"]) == ("1", "1", "0")
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "OMP_NUM_THREADS", "INPROCESS_EVENTS_DIR"):
        assert second["env"][name] == lives(tmp_path, 0)[0]["env"][name], name  # the same job, incarnation
    assert second["argv"] == ["a1"]
    assert [len(lives(tmp_path, r)) for r in (0, 2)] == [1, 1]  # nobody else was restarted


@pytest.mark.timeout(120)
def test_a_process_that_always_dies_at_once_is_respawned_n_times_with_a_growing_back_off_then_its_seat_stays_empty(
        tmp_path: pathlib.Path) -> None:
    # Rank 1 dies at once in every life: the bound and the back-off are all that stop a storm. Rank 0
    # runs until the third replacement started, and 2 s more, so that the job still runs at its death.
    plan = {0: ["after:rank1.life3"], 1: ["sigkill"]}
    start = time.monotonic()
    res = launch(tmp_path, 2, plan, "--respawn", "3", "--respawn-backoff", "0.3")
    elapsed = time.monotonic() - start
    assert res.returncode == 137, res.stderr  # no events: the seat left empty fails the job, with its status
    seen = lives(tmp_path, 1)
    assert [life["env"].get(RESPAWN_COUNT_VAR) for life in seen] == [None, "1", "2", "3"]  # exactly 3 respawns
    for attempt, delay in ((1, "0.3"), (2, "0.6"), (3, "1.2")):
        assert (f"inprocess.launch: respawning rank 1 (attempt {attempt} of 3) in {delay}s: killed by SIGKILL\n"
                in res.stderr)
    assert "inprocess.launch: rank 1 killed by SIGKILL; no respawn left: 3 of 3 used; the seat stays empty\n" in (
        res.stderr)
    assert summary(res) == (
        "inprocess.launch: job failed: 1 of 2 seats finished; restarts unknown (no rank wrote events); 3 respawns; "
        + "rank 1 killed by SIGKILL (respawned); " * 3
        + "rank 1 killed by SIGKILL (no respawn left: 3 of 3 used; the seat stays empty); exit status 137")
    # Each life starts at least its back-off after the one before it died (at its start: it kills itself).
    gaps = [later["t"] - earlier["t"] for earlier, later in zip(seen[:-1], seen[1:], strict=True)]
    for gap, delay in zip(gaps, (0.3, 0.6, 1.2), strict=True):
        assert gap >= delay, gaps
    assert elapsed < 60


@pytest.mark.timeout(120)
@pytest.mark.parametrize("respawn", ["0", "2"])
def test_a_dead_rank_stays_a_zombie_until_the_job_ends_so_that_its_monitor_reads_its_status(
        tmp_path: pathlib.Path, respawn: str) -> None:
    # processes/monitor.py reads a dead rank's exit status from /proc while it is a zombie: the launcher
    # sees the exit (waitid WNOWAIT) without reaping it. Rank 1's replacement (if any) finishes at once.
    res = launch(tmp_path, 2, {0: ["zombie:1"], 1: ["sigkill", "ok"]}, "--respawn", respawn,
                 "--respawn-backoff", "0.1")
    assert (tmp_path / "out" / "zombie").read_text() == "Z", res.stderr
    assert res.returncode == (0 if respawn == "2" else 137), res.stderr


def test_the_back_off_doubles_up_to_its_cap_and_bad_settings_are_refused() -> None:
    policy = RespawnPolicy(5, 1.0)
    assert [policy.delay(k) for k in range(1, 8)] == [1, 2, 4, 8, 16, RESPAWN_BACKOFF_CAP_S, RESPAWN_BACKOFF_CAP_S]
    assert RespawnPolicy(1, 45.0).delay(3) == 45.0  # a base above the cap is the cap
    assert RespawnPolicy(1, 0.1).delay(10_000) == RESPAWN_BACKOFF_CAP_S  # no overflow
    with pytest.raises(ValueError, match=r"max_per_seat=-1: expected a number of respawns >= 0"):
        RespawnPolicy(-1, 1.0)
    with pytest.raises(ValueError, match=r"backoff_s=0.0: expected a number of seconds > 0"):
        RespawnPolicy(1, 0.0)


@pytest.mark.parametrize(("args", "message"), [
    (["--respawn", "-1"], "--respawn=-1: expected a number of respawns per rank >= 0"),
    (["--respawn", "2", "--respawn-backoff", "0"], "--respawn-backoff=0.0: expected a number of seconds > 0"),
    (["--respawn", "2", "--respawn-backoff", "nan"], "--respawn-backoff=nan: expected a number of seconds > 0"),
])
def test_bad_respawn_arguments_are_refused_naming_the_value(
        tmp_path: pathlib.Path, args: list[str], message: str) -> None:
    res = launch(tmp_path, 2, {}, *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not every_pid(tmp_path)  # no rank was started


def test_the_statuses_that_ask_for_a_new_process_are_the_wrappers() -> None:
    from inprocess.engine.trigger import EXIT_CODE_UNRELEASABLE
    from inprocess.gpu.errors import EXIT_CODE_CONTEXT_LOST

    assert set(REPLACE_ME_STATUSES) == {EXIT_CODE_UNRELEASABLE, EXIT_CODE_CONTEXT_LOST}
    assert replacement_reason(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert [replacement_reason(status) for status in (None, 0, 1, 3, 124, 137)] == [None] * 6


@pytest.mark.timeout(120)
def test_a_rank_that_finished_or_left_with_its_own_failure_is_not_respawned(tmp_path: pathlib.Path) -> None:
    # Rank 1 leaves with a Python exception (status 1), rank 2 with a status of its own; rank 0 outlives
    # both, so the job still runs when they exit.
    plan = {0: ["after:done"], 1: ["exit:1"], 2: ["exit:3"]}
    script = write_standin(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "inprocess.launch", "--nproc", "3", "--respawn", "2",
                             "--respawn-backoff", "0.1", str(script)], env=launcher_env(tmp_path, plan),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all(lives(tmp_path, r) for r in range(3)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # ten polls of the launcher after ranks 1 and 2 exited (they exit on start)
        (tmp_path / "out" / "done").touch()
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert not leftover_processes(every_pid(tmp_path), grace=5.0)
    assert proc.returncode == 1, stderr
    assert "respawn" not in stderr.replace("0 respawns", "")
    assert stderr.splitlines()[-1] == (
        "inprocess.launch: job failed: 1 of 3 seats finished; restarts unknown (no rank wrote events); 0 respawns; "
        "rank 1 exited with status 1; rank 2 exited with status 3; exit status 1")
    assert [len(lives(tmp_path, r)) for r in range(3)] == [1, 1, 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("plan", "why"), [
    # Rank 0 finished (the job completed), then rank 1 is killed: a joiner would join a job that ends.
    ({0: ["ok"], 1: ["gone:0:sigkill", "ok"], 2: ["gone:1:ok"]}, "the job is ending (rank 0 finished)"),
    # Every other rank left: there is no running job to join.
    ({0: ["exit:3"], 1: ["gone:0:sigkill", "ok"]}, "no other rank is running (nothing to join)"),
], ids=["a-rank-finished", "nobody-else-runs"])
def test_no_respawn_once_the_job_is_ending(tmp_path: pathlib.Path, plan: dict[int, list[str]], why: str) -> None:
    res = launch(tmp_path, len(plan), plan, "--respawn", "3", "--respawn-backoff", "0.1")
    assert f"inprocess.launch: rank 1 killed by SIGKILL; not respawned: {why}\n" in res.stderr, res.stderr
    assert len(lives(tmp_path, 1)) == 1
    assert f"rank 1 killed by SIGKILL (not respawned: {why})" in summary(res)
    assert res.returncode == (137 if why.startswith("the job") else 3), res.stderr


@pytest.mark.timeout(120)
def test_a_respawn_pending_when_the_job_ends_is_dropped(tmp_path: pathlib.Path) -> None:
    # Rank 1 dies with a 3 s back-off ahead of its respawn; rank 0 finishes the job meanwhile.
    plan = {0: ["gone:1:ok"], 1: ["sigkill"]}
    res = launch(tmp_path, 2, plan, "--respawn", "3", "--respawn-backoff", "3")
    assert "inprocess.launch: respawning rank 1 (attempt 1 of 3) in 3s: killed by SIGKILL\n" in res.stderr
    assert ("inprocess.launch: rank 1: the pending respawn is dropped: the job is ending (rank 0 finished)\n"
            in res.stderr), res.stderr
    assert len(lives(tmp_path, 1)) == 1
    assert res.returncode == 137 and summary(res).endswith(
        "0 respawns; rank 1 killed by SIGKILL (not respawned: the job is ending (rank 0 finished)); exit status 137")


def wait_for_text(path: pathlib.Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{text!r} not in:\n{path.read_text()}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stop", "respawn_state"), [
    (signal.SIGTERM, "pending"), (signal.SIGINT, "pending"), (signal.SIGTERM, "running"),
    (None, "pending"), (None, "running"),  # None: the launcher's --timeout
], ids=["sigterm-pending", "ctrl-c-pending", "sigterm-running", "timeout-pending", "timeout-running"])
def test_interrupted_or_timed_out_the_launcher_stops_respawning_and_leaves_nothing_running(
        tmp_path: pathlib.Path, stop: signal.Signals | None, respawn_state: str) -> None:
    # Rank 0 runs until killed. Rank 1 dies at once; its respawn is pending (a 30 s back-off) or its
    # replacement runs (then sleeps until killed) when the launcher is stopped.
    pending = respawn_state == "pending"
    plan = {0: ["sleep"], 1: ["sigkill", "sleep"]}
    script = write_standin(tmp_path)
    stderr_path = tmp_path / "stderr.txt"
    args = ["--respawn", "3", "--respawn-backoff", "30" if pending else "0.1"]
    if stop is None:
        args += ["--timeout", "8"]
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "inprocess.launch", "--nproc", "2", *args, str(script)],
                                env=launcher_env(tmp_path, plan), stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
    try:
        wait_for_text(stderr_path, "respawning rank 1 (attempt 1 of 3)", 60)
        if not pending:
            wait_for_text(stderr_path, "rank 1 respawned (attempt 1 of 3", 30)
            deadline = time.monotonic() + 30
            while len(lives(tmp_path, 1)) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        if stop is not None:
            proc.send_signal(stop)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pids = every_pid(tmp_path)
        assert not leftover_processes(pids, grace=5.0)
    text = stderr_path.read_text()
    if stop is None:
        assert proc.returncode == 124 and "did not finish within 8s; every rank was killed" in text, text
    else:
        assert proc.returncode == 130 and "interrupted; every rank was killed" in text, text
    # The pending respawn never happened; a running replacement was killed with the rest.
    assert len(lives(tmp_path, 1)) == (1 if pending else 2)
    assert len(pids) == (2 if pending else 3)
