"""``python -m inprocess.launch``: the single-machine launcher of the demo, the tests and the benchmarks."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from conftest import leftover_processes
from inprocess.launch import (
    EVENTS_VAR,
    OMP_WARNING,
    EventsSeen,
    ephemeral_port_range,
    excluded_at_the_end,
    free_port,
    summarize,
)

pytestmark = pytest.mark.multiprocess

FAULTS_WORKER = pathlib.Path(__file__).parent / "workers" / "faults_worker.py"

SCRIPT = """
import json, os, sys, time
out = os.environ["LAUNCH_TEST_OUT"]
base = json.loads(os.environ["LAUNCH_TEST_BASE_ENV"])  # the launcher's own environment
rank = int(os.environ["RANK"])
added = {k: v for k, v in os.environ.items() if base.get(k) != v and k != "LAUNCH_TEST_BASE_ENV"}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"env": added, "argv": sys.argv[1:], "pid": os.getpid()}, f)
behaviour = os.environ.get("LAUNCH_TEST_BEHAVIOUR", "")
if behaviour == "fail_rank_1" and rank == 1:
    sys.exit(3)
if behaviour == "sleep":
    time.sleep(600)
"""


def launch(
    tmp_path: pathlib.Path, *args: str, behaviour: str = "", timeout: float = 60,
    launcher: tuple[str, ...] = ("-m", "inprocess.launch"), env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs SCRIPT under ``launcher`` (ours, or torchrun's ``-m torch.distributed.run``)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    base = dict(os.environ, LAUNCH_TEST_OUT=str(tmp_path), LAUNCH_TEST_BEHAVIOUR=behaviour)
    base.pop("OMP_NUM_THREADS", None)
    base.update(env or {})
    base["LAUNCH_TEST_BASE_ENV"] = json.dumps(base)
    return subprocess.run(
        [sys.executable, *launcher, *args, str(script), "x", "--y"],
        env=base, capture_output=True, text=True, timeout=timeout,
    )


def ranks_seen(tmp_path: pathlib.Path, n: int) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


def test_every_rank_gets_torchruns_environment_and_the_scripts_arguments(tmp_path: pathlib.Path) -> None:
    res = launch(tmp_path, "--nproc", "5", "--ranks-per-node", "2", "--port", "29999")
    assert res.returncode == 0, res.stderr
    seen = ranks_seen(tmp_path, 5)
    assert [s["env"]["RANK"] for s in seen] == ["0", "1", "2", "3", "4"]
    assert {s["env"]["WORLD_SIZE"] for s in seen} == {"5"}
    assert [s["env"]["LOCAL_RANK"] for s in seen] == ["0", "1", "0", "1", "0"]
    assert [s["env"]["GROUP_RANK"] for s in seen] == ["0", "0", "1", "1", "2"]
    # The last node holds the one rank left over.
    assert [s["env"]["LOCAL_WORLD_SIZE"] for s in seen] == ["2", "2", "2", "2", "1"]
    assert {(s["env"]["MASTER_ADDR"], s["env"]["MASTER_PORT"]) for s in seen} == {("127.0.0.1", "29999")}
    assert {tuple(s["argv"]) for s in seen} == {("x", "--y")}
    # torchrun's other numbers: one role for every rank, three nodes (the last one short).
    assert [s["env"]["ROLE_RANK"] for s in seen] == ["0", "1", "2", "3", "4"]
    assert {(s["env"]["ROLE_NAME"], s["env"]["ROLE_WORLD_SIZE"], s["env"]["GROUP_WORLD_SIZE"]) for s in seen} == {
        ("default", "5", "3")}
    assert len({s["env"]["TORCHELASTIC_RUN_ID"] for s in seen}) == 1  # one job, one run id
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ:  # else inherited, not added
        # Abort the communicators, the failed work raises (torchrun's 1 would tear the rank down).
        assert {s["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] for s in seen} == {"2"}


# torchrun's worker variables that ours leaves out, and why (README, "Use"): torchrun's agent reads a
# rank's error file (written by @record) and forwards the signals it lists; this launcher does neither.
NOT_SET_HERE = {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}
# Ours only: unbuffered output (the ranks share the terminal), the events the summary line is read from.
OURS_ONLY = {"PYTHONUNBUFFERED", "INPROCESS_EVENTS_DIR"}
# Same names, other values, and why: 127.0.0.1, not torchrun's "localhost" (no name lookup, no ::1); no
# agent store (rank 0's process hosts the store); a run id and a port of every job's own; NCCL's async
# error handling 2 (abort the communicators), where torchrun's 1 tears the process down on an NCCL error.
DIFFERENT_VALUES = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


@pytest.mark.timeout(120)
def test_the_environment_is_torchruns_variable_for_variable(tmp_path: pathlib.Path) -> None:
    """The same script under real torchrun and under ours, 3 processes on one node: what each launcher added."""
    theirs_dir, ours_dir = tmp_path / "torchrun", tmp_path / "ours"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    # --standalone: torchrun's rendezvous on a free port of its own (its default is the fixed 29500).
    res = launch(theirs_dir, "--standalone", "--nproc-per-node", "3", launcher=("-m", "torch.distributed.run"),
                 timeout=100)
    assert res.returncode == 0, res.stderr
    theirs = ranks_seen(theirs_dir, 3)
    res = launch(ours_dir, "--nproc", "3", timeout=100)
    assert res.returncode == 0, res.stderr
    ours = ranks_seen(ours_dir, 3)
    for rank in range(3):
        t, o = theirs[rank]["env"], ours[rank]["env"]
        assert set(t) - NOT_SET_HERE == set(o) - OURS_ONLY, (rank, sorted(t), sorted(o))
        assert {k: v for k, v in t.items() if k in o and k not in DIFFERENT_VALUES} == {
            k: v for k, v in o.items() if k in t and k not in DIFFERENT_VALUES}, rank
        assert (t["OMP_NUM_THREADS"], o["OMP_NUM_THREADS"]) == ("1", "1")
        assert (o["MASTER_ADDR"], o["TORCHELASTIC_USE_AGENT_STORE"]) == ("127.0.0.1", "False")
    # Both print the same notice when they set OMP_NUM_THREADS.
    assert OMP_WARNING in res.stderr


@pytest.mark.timeout(60)
def test_a_users_omp_num_threads_is_kept_and_one_rank_gets_none(tmp_path: pathlib.Path) -> None:
    (tmp_path / "set").mkdir()
    res = launch(tmp_path / "set", "--nproc", "2", env={"OMP_NUM_THREADS": "3"})
    assert res.returncode == 0, res.stderr
    assert [s["env"].get("OMP_NUM_THREADS") for s in ranks_seen(tmp_path / "set", 2)] == [None, None]  # inherited
    assert "OMP_NUM_THREADS" not in res.stderr
    (tmp_path / "one").mkdir()
    res = launch(tmp_path / "one", "--nproc", "1")
    assert res.returncode == 0, res.stderr
    assert "OMP_NUM_THREADS" not in ranks_seen(tmp_path / "one", 1)[0]["env"]
    assert "OMP_NUM_THREADS" not in res.stderr
    (tmp_path / "nccl").mkdir()
    res = launch(tmp_path / "nccl", "--nproc", "2", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert [s["env"].get("TORCH_NCCL_ASYNC_ERROR_HANDLING") for s in ranks_seen(tmp_path / "nccl", 2)] == [None, None]


def test_a_failing_rank_leaves_the_others_running_and_sets_the_status(tmp_path: pathlib.Path) -> None:
    res = launch(tmp_path, "--nproc", "3", behaviour="fail_rank_1")
    assert res.returncode == 3, res.stderr
    # No wrapper, no events: nothing says the others recovered from it, so the job failed.
    assert res.stderr.splitlines()[-1] == ("inprocess.launch: job failed: 2 of 3 ranks finished; restarts unknown "
                                           "(no rank wrote events); rank 1 exited with status 3; exit status 3")
    assert len(ranks_seen(tmp_path, 3)) == 3  # ranks 0 and 2 ran to their end


def run_faults_job(tmp_path: pathlib.Path, plan: str, *args: str) -> subprocess.CompletedProcess[str]:
    """tests/workers/faults_worker.py, 3 ranks under the wrapper, faults from INPROCESS_FAULTS only."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, INPROCESS_FAULTS=plan, INPROCESS_TEST_OUT=str(out), FAULTS_TEST_STEPS="8")
    env.pop(EVENTS_VAR, None)
    return subprocess.run([sys.executable, "-m", "inprocess.launch", "--nproc", "3", *args, str(FAULTS_WORKER)],
                          env=env, capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_rank_killed_and_recovered_from_ends_a_finished_job(tmp_path: pathlib.Path, strict: bool) -> None:
    res = run_faults_job(tmp_path, "sigkill@rank=1,step=3", *(["--strict"] if strict else []))
    status = 137 if strict else 0
    assert res.returncode == status, res.stderr[-4000:]
    assert res.stderr.splitlines()[-1] == (
        "inprocess.launch: job finished: 2 of 3 ranks finished; 1 restart; rank 1 killed by SIGKILL, "
        f"excluded by a restart; exit status {status}"), res.stderr[-4000:]
    for r in (0, 2):  # what the ranks themselves say: both finished iteration 1, without rank 1
        log = json.loads((tmp_path / "out" / f"rank{r}.json").read_text())
        assert log["result"]["iteration"] == 1 and log["restarts"][0]["terminated"] == [1], log


@pytest.mark.timeout(120)
def test_a_clean_wrapped_job_counts_no_restart_and_a_users_events_directory_is_read_from_its_end(
        tmp_path: pathlib.Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    (events / "rank1.jsonl").write_text(json.dumps({"kind": "decision", "call": 0, "iteration": 1,
                                                    "terminated": [1], "rank": 0}) + "\n")  # an earlier job's
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, INPROCESS_TEST_OUT=str(out), FAULTS_TEST_STEPS="4", INPROCESS_EVENTS_DIR=str(events))
    env.pop("INPROCESS_FAULTS", None)
    res = subprocess.run([sys.executable, "-m", "inprocess.launch", "--nproc", "2", str(FAULTS_WORKER)],
                         env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stderr.splitlines()[-1] == (
        "inprocess.launch: job finished: 2 of 2 ranks finished; 0 restarts; exit status 0"), res.stderr[-4000:]
    assert sorted(p.name for p in events.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]  # the user's, kept


def test_the_summary_tells_a_recovered_fault_from_a_failed_job() -> None:
    one_excluded = EventsSeen(restarts=1, excluded={1})
    assert summarize([0, -9, 0], one_excluded, strict=False) == (
        "inprocess.launch: job finished: 2 of 3 ranks finished; 1 restart; rank 1 killed by SIGKILL, "
        "excluded by a restart; exit status 0", 0)
    # A survivor that fails after the restart fails the job: its status, the first non-zero one.
    line, status = summarize([0, -9, 3], one_excluded, strict=False)
    assert status == 137 and line.startswith("inprocess.launch: job failed: 1 of 3 ranks finished; 1 restart; ")
    assert "rank 2 exited with status 3; exit status 137" in line
    # Every rank excluded: nobody finished the job.
    assert summarize([-9, 75], EventsSeen(2, {0, 1}), strict=False)[1] == 137
    # A rank that died without a decision excluding it (the job ended first): failed.
    assert summarize([0, -9], EventsSeen(0, set()), strict=False)[1] == 137
    assert summarize([0, 0], EventsSeen(2, set()), strict=True) == (
        "inprocess.launch: job finished: 2 of 2 ranks finished; 2 restarts; exit status 0", 0)
    assert summarize([None, 0], None, strict=False)[1] == 1  # a rank that never exited


def test_a_seat_taken_back_by_its_respawn_is_not_excluded_at_the_end() -> None:
    """With --respawn a seat is excluded, then a respawned process joins it and finishes: that seat
    finished the job. Seen in a chaos run: every seat had been excluded once, two late respawns found
    the job over (exit 1), and the launcher called the job failed."""
    decisions = [{"iteration": 3, "terminated": [0], "joined": []},
                 {"iteration": 5, "terminated": [1], "joined_lives": [[0, 1]]},
                 {"iteration": 5, "terminated": [1], "joined": [0]},  # the same decision, read by another rank
                 {"iteration": 6, "terminated": [3], "joined": [1]},
                 {"iteration": 8, "terminated": [2], "joined_lives": [[3, 1]]},
                 {"iteration": 9, "terminated": [1], "joined": []}]
    assert excluded_at_the_end(decisions) == {1, 2}
    # Seats 0 and 3 finished after their respawns joined; 1 and 2's last processes found the job over.
    line, status = summarize([0, 1, 1, 0], EventsSeen(4, excluded_at_the_end(decisions)), strict=False)
    assert status == 0 and line.startswith("inprocess.launch: job finished: 2 of 4 ranks finished"), line
    # Counted by seat, not by the seat's last process, every seat was excluded: the job looked failed.
    every_seat = {seat for d in decisions for seat in d["terminated"]}
    assert every_seat == {0, 1, 2, 3} and summarize([0, 1, 1, 0], EventsSeen(4, every_seat), strict=False)[1] == 1


def test_timeout_kills_every_rank(tmp_path: pathlib.Path) -> None:
    start = time.monotonic()
    res = launch(tmp_path, "--nproc", "2", "--timeout", "2", behaviour="sleep")
    assert res.returncode == 124, res.stderr
    assert time.monotonic() - start < 30
    assert "did not finish within 2s" in res.stderr
    pids = {s["pid"] for s in ranks_seen(tmp_path, 2)}
    assert not leftover_processes(pids, grace=5.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "--nproc=0: expected a number of ranks >= 1"),
        (["--nproc", "2", "--port", "70000"], "--port=70000: expected a TCP port"),
        (["--nproc", "2", "--timeout", "-1"], "--timeout=-1.0: expected a number of seconds > 0"),
        (["--nproc", "2", "--ranks-per-node", "3"], "ranks_per_node=3: expected 1..world_size=2"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(tmp_path: pathlib.Path, args: list[str], message: str) -> None:
    res = launch(tmp_path, *args)
    assert res.returncode == 2
    assert message in res.stderr
    assert not list(tmp_path.glob("rank*.json"))  # no rank was started


def test_free_port_gives_consecutive_listenable_ports_below_the_ephemeral_range() -> None:
    low, _ = ephemeral_port_range()
    for count in (1, 2, 3):
        port = free_port(count)
        assert 1024 <= port and port + count - 1 < low, (port, count, low)
        held = []
        try:
            for p in range(port, port + count):
                s = socket.socket()
                held.append(s)
                s.bind(("", p))  # raises if the port was not free
                s.listen()
            # A port in use is never offered: with P .. P + count - 1 held, a new answer avoids them.
            again = free_port(count)
            assert not set(range(again, again + count)) & set(range(port, port + count))
        finally:
            for s in held:
                s.close()


def test_free_port_refuses_a_count_below_one() -> None:
    with pytest.raises(ValueError, match=r"count=0: expected a positive int"):
        free_port(0)


@pytest.mark.timeout(120)
def test_a_rank_that_writes_more_than_a_pipe_holds_does_not_block_before_the_ranks_before_it_exit(
        tmp_path: pathlib.Path) -> None:
    """LocalJob (the tests' launcher) read each rank's output only once the ranks before it had exited: a
    rank that wrote 64 KiB meanwhile blocked in its next write, wherever it was (issue 31: a restart
    storm without the brake, whose ranks log every restart, "hung" so at a barrier). Rank 1 writes 1 MB,
    then tells rank 0, which waits for it."""
    from inprocess.launch import LocalJob

    script = tmp_path / "chatty.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        f"done = pathlib.Path({str(tmp_path / 'done')!r})\n"
        "if os.environ['RANK'] == '1':\n"
        "    for _ in range(16):\n"
        "        sys.stdout.write('x' * 65535 + '\\n')\n"
        "    sys.stdout.flush()\n"
        "    done.write_text('1')\n"
        "else:\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not done.exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(0 if done.exists() else 3)\n")
    with LocalJob([str(script)], 2) as job:
        job.wait(90)
    assert [rp.returncode for rp in job.ranks] == [0, 0]
    assert len(job.ranks[1].output) == 16 * 65536
