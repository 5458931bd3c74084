"""A joiner's liveness (issue 21, item 1): a waiting joiner is watched like a spare, one that dies
right after its admission is counted out at once, and a grow that never came leaves no keys.

Real processes on 127.0.0.1, a real TCPStore, gloo, SIGKILL."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from conftest import WORKERS, leftover_processes
from inprocess.control import seat_table
from inprocess.control.incarnation import call_prefix
from inprocess.control.joining import Announcement, JoinKeys, Outcome
from inprocess.control.protocol import monitor_heartbeat_key
from inprocess.control.store_ops import CountingStore
from inprocess.launch import LocalJob, RankProcess

pytestmark = pytest.mark.multiprocess


def until(what: str, done: Callable[[], Any], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := done()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(0.05)
    return value


def announcement_of(keys: JoinKeys, pid: int) -> Announcement | None:
    return next((a for _, a in keys.pending()[1] if a.pid == pid), None)


def job_env(out: pathlib.Path, plan: dict[str, Any]) -> dict[str, str]:
    return {"INPROCESS_TEST_OUT": str(out), "INPROCESS_TEST_PLAN": json.dumps(plan), "INPROCESS_TEST_LOG": "INFO",
            "INPROCESS_RESTART_STORM": "off", "INPROCESS_TEST_DUMP_AFTER": "280"}


def finish(job: LocalJob, timeout: float) -> str:
    """Wait for every process of ``job``, the joiners too; their outputs, for the failure messages."""
    job.wait(timeout)
    for rp in job.respawned:
        rp.output, _ = rp.popen.communicate(timeout=60)
        rp.returncode = rp.popen.returncode
    every: list[RankProcess] = job.ranks + job.respawned
    whole = "\n".join(f"--- seat {rp.rank} pid {rp.popen.pid} rc={rp.returncode}\n{rp.output or ''}" for rp in every)
    (pathlib.Path(job.env["INPROCESS_TEST_OUT"]) / "outputs.txt").write_text(whole)  # for a failure's look
    return "\n".join(f"--- seat {rp.rank} pid {rp.popen.pid} rc={rp.returncode}\n{(rp.output or '')[-4000:]}"
                     for rp in every)


def read_logs(out: pathlib.Path) -> dict[str, Any]:
    return {path.stem: json.loads(path.read_text()) for path in out.glob("seat*.json")}


def assert_nothing_left(job: LocalJob) -> None:
    left = leftover_processes({rp.popen.pid for rp in job.ranks + job.respawned}, grace=10.0)
    assert not left, left


@contextlib.contextmanager
def join_job(argv: list[str], seats: int, **kwargs: Any) -> Iterator[LocalJob]:
    """A LocalJob whose outputs are printed when the test fails inside it; every process it
    started, the joiners too, is killed on the way out, and none may be left."""
    with LocalJob(argv, seats, **kwargs) as job:
        try:
            yield job
        except BaseException:
            job.kill()
            print(job.outputs())
            raise
        finally:
            job.kill()
        assert_nothing_left(job)


WRAPPER = {"soft_timeout": 90, "hard_timeout": 120, "barrier_timeout": 150, "heartbeat_interval": 1,
           "heartbeat_timeout": 6}


@pytest.mark.timeout(300)
def test_a_waiting_joiner_whose_node_is_lost_is_withdrawn_and_never_admitted(tmp_path: pathlib.Path) -> None:
    """4 active seats. Seat 3 is SIGKILLed: the job goes on with 3. Its replacement waits to join;
    once its monitor beats, the joiner AND its monitor are SIGKILLed (its node is lost: nobody of
    its own is left to withdraw it). The peers' monitors see the seat's counter stand still and
    withdraw it within heartbeat_timeout; then seat 2 is SIGKILLed, and that restart admits nobody:
    the job ends at world 2, without waiting for the barrier_timeout of a dead member."""
    out = tmp_path / "out"
    out.mkdir()
    plan = {"steps": 40, "step_s": 0.03, "active": 4, "wrapper": WRAPPER, "pg_timeout": 150,
            "hold": {"step": 12, "file": "go"},
            "kills": [{"seat": 3, "life": 0, "step": 5}, {"seat": 2, "life": 0, "step": 20}]}
    with join_job([str(WORKERS / "join_worker.py")], 4, env=job_env(out, plan)) as job:
        client = dist.TCPStore("127.0.0.1", job.port, 1, False, datetime.timedelta(seconds=30))
        keys = JoinKeys(CountingStore(client), 0, "")
        until("seat 3 killed", lambda: job.ranks[3].popen.poll() is not None)
        lost = job.respawn(3, 1)
        joiner = until("the joiner announced", lambda: announcement_of(keys, lost.popen.pid), timeout=180)
        # Two beats of the joiner's monitor on its seat's counter (seat 3's own monitor is gone).
        counter = monitor_heartbeat_key(0, 3)
        first = int(keys.counted.peek(counter) or 0)
        until("the joiner's monitor beats", lambda: int(keys.counted.peek(counter) or 0) >= first + 2)
        assert keys.read_outcome(joiner.token) is None  # it waits
        os.killpg(lost.popen.pid, signal.SIGKILL)  # the joiner and its monitor: its node is gone
        killed = time.monotonic()
        outcome = until("the lost joiner withdrawn", lambda: keys.read_outcome(joiner.token), timeout=90)
        withdrawn_s = time.monotonic() - killed
        (out / "go").touch()
        text = finish(job, 240)
    assert isinstance(outcome, Outcome) and outcome.kind == "gone", outcome
    assert "its node is lost" in outcome.why and "sent no heartbeat" in outcome.why, outcome
    assert withdrawn_s < 6 + 30, withdrawn_s  # heartbeat_timeout, a few intervals, a loaded machine
    assert lost.returncode == -signal.SIGKILL, text
    logs = read_logs(out)
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0", "seat1.life0"], (sorted(finishers), text)
    assert {r["active_world_size"] for r in finishers.values()} == {2}
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1
    restarts = finishers["seat0.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[3], [2]], restarts
    assert [r["joined"] for r in restarts] == [[], []], restarts


@pytest.mark.timeout(300)
def test_a_joiner_that_dies_admitted_before_its_seat_moved_is_counted_out_at_once(tmp_path: pathlib.Path) -> None:
    """4 active seats. Seat 3 is SIGKILLed and its replacement waits; seat 2 is SIGKILLed, and the
    leader of that restart admits the joiner, then SIGKILLs the joiner's process before it moves
    the seat into the joiner's life (its monitor lives on, and counts it out meanwhile). The next
    restart excludes the dead joiner within the monitors' timing, not after barrier_timeout; the job
    ends with seats 0 and 1."""
    out = tmp_path / "out"
    out.mkdir()
    plan = {"steps": 40, "step_s": 0.03, "active": 4, "wrapper": WRAPPER, "pg_timeout": 150,
            "kill_admitted": True,
            "kills": [{"seat": 3, "life": 0, "step": 5}, {"seat": 2, "life": 0, "step": 20, "after_joiners": 1}]}
    with join_job([str(WORKERS / "join_worker.py")], 4, env=job_env(out, plan)) as job:
        until("seat 3 killed", lambda: job.ranks[3].popen.poll() is not None)
        doomed = job.respawn(3, 1)
        text = finish(job, 260)
    logs = read_logs(out)
    killers = [name for name, log in logs.items() if log.get("killed_admitted")]
    assert len(killers) == 1 and logs[killers[0]]["killed_admitted"] == [doomed.popen.pid], (killers, text)
    assert doomed.returncode == -signal.SIGKILL, text
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0", "seat1.life0"], (sorted(finishers), text)
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1
    restarts = finishers["seat0.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[3], [2], [3]], restarts
    assert [r["joined"] for r in restarts] == [[], [3], []], restarts
    # The iteration that admitted the dead joiner ended within the monitors' timing (barrier_timeout: 150 s):
    # the next one started soon after the kill (the admitted one may restart before the function starts).
    starts = {entry["iteration"]: entry["t"] for entry in logs["seat0.life0"]["iterations"]}
    admitted_in = restarts[1]["iteration"] + 1  # the restart after iteration i admits into iteration i + 1
    assert starts[admitted_in + 1] - logs[killers[0]]["killed_admitted_t"] < 60, starts


@pytest.mark.timeout(300)
def test_an_admitted_joiner_whose_node_is_lost_is_counted_out_by_the_peers(tmp_path: pathlib.Path) -> None:
    """4 active seats. Seat 3 is SIGKILLed, its replacement waits, seat 2 is SIGKILLed: the restart
    admits the joiner into seat 3. Once every rank waits at a hold (no collective in flight), the
    joiner AND its monitor are SIGKILLed. Seat 3's heartbeat counter had stopped with its first
    process's monitor; it moved again with the joiner's, and stands still now: the peers' monitors
    count the joiner out, the job restarts without it within the monitors' timing (not after
    barrier_timeout), and ends with seats 0 and 1."""
    out = tmp_path / "out"
    out.mkdir()
    plan = {"steps": 40, "step_s": 0.03, "active": 4, "wrapper": WRAPPER, "pg_timeout": 150,
            "hold": {"step": 25, "file": "go"}, "monitor_logs": True,
            "kills": [{"seat": 3, "life": 0, "step": 5}, {"seat": 2, "life": 0, "step": 20, "after_joiners": 1}]}
    with join_job([str(WORKERS / "join_worker.py")], 4, env=job_env(out, plan)) as job:
        until("seat 3 killed", lambda: job.ranks[3].popen.poll() is not None)
        joiner = job.respawn(3, 1)
        until("the joiner waits at the hold", lambda: (out / "seat3.life1.json").exists()
              and "held_at" in json.loads((out / "seat3.life1.json").read_text()), timeout=240)
        until("every rank waits at the hold", lambda: all(
            "held_at" in json.loads((out / f"seat{r}.life0.json").read_text()) for r in (0, 1)))
        os.killpg(joiner.popen.pid, signal.SIGKILL)  # the joiner and its monitor: its node is gone
        killed = time.time()
        until("the restart without the joiner", lambda: len(
            json.loads((out / "seat0.life0.json").read_text())["iterations"]) == 4, timeout=120)
        restarted_s = time.time() - killed
        (out / "go").touch()
        text = finish(job, 240)
    assert joiner.returncode == -signal.SIGKILL, text
    logs = read_logs(out)
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0", "seat1.life0"], (sorted(finishers), text)
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1
    restarts = finishers["seat0.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[3], [2], [3]], restarts
    assert [r["joined"] for r in restarts] == [[], [3], []], restarts
    assert "sent no heartbeat" in " ".join(" ".join(r["faults"]) for r in restarts), restarts
    assert restarted_s < 60, restarted_s  # heartbeat_timeout 6 s, barrier_timeout 150 s


def seat_3_replaced(tmp_path: pathlib.Path, plan: dict[str, Any]) -> tuple[RankProcess, str, dict[str, Any]]:
    """A 4-seat job run by ``plan`` to its end: once seat 3's first process is killed, its replacement
    is started to join. Returns the joiner, the outputs and the processes' logs."""
    out = tmp_path / "out"
    out.mkdir()
    with join_job([str(WORKERS / "join_worker.py")], 4, env=job_env(out, plan)) as job:
        until("seat 3 killed", lambda: job.ranks[3].popen.poll() is not None)
        joiner = job.respawn(3, 1)
        text = finish(job, 240)
    return joiner, text, read_logs(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_admitted_joiner_that_dies_before_its_process_group_exists_costs_one_restart(
        tmp_path: pathlib.Path) -> None:
    """4 active seats. Seat 3 is SIGKILLed, its replacement waits, seat 2 is SIGKILLed: the restart
    admits the joiner into seat 3. The joiner SIGKILLs itself at the start of its first iteration,
    before init_process_group, while the others wait in theirs for its address: they are released
    by the restart its monitor starts (not by pg_timeout, 150 s, or hard_timeout, 120 s), and the
    job ends with seats 0 and 1."""
    plan = {"steps": 40, "step_s": 0.03, "active": 4, "wrapper": WRAPPER, "pg_timeout": 150,
            "kills": [{"seat": 3, "life": 0, "step": 5}, {"seat": 2, "life": 0, "step": 20, "after_joiners": 1},
                      {"seat": 3, "life": 1, "step": "init"}]}
    joiner, text, logs = seat_3_replaced(tmp_path, plan)
    assert joiner.returncode == -signal.SIGKILL, text
    assert logs["seat3.life1"]["killed_at"] == "init", text
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0", "seat1.life0"], (sorted(finishers), text)
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1
    restarts = finishers["seat0.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[3], [2], [3]], restarts
    assert [r["joined"] for r in restarts] == [[], [3], []], restarts
    died = logs["seat3.life1"]["iterations"][0]["t"]  # written just before it killed itself
    starts = {entry["iteration"]: entry["t"] for entry in logs["seat0.life0"]["iterations"]}
    assert starts[restarts[2]["iteration"] + 1] - died < 30, (starts, died)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_joiner_that_dies_restarts_after_its_admission_costs_one_restart(tmp_path: pathlib.Path) -> None:
    """4 active seats. Seat 3 is SIGKILLed, its replacement waits, seat 2 is SIGKILLed (the restart
    admits the joiner, barrier 2), seat 1 is SIGKILLed (barrier 3: its leader deletes barrier 2's keys),
    then the joiner dies. Its monitor counts it out at once: it does not wait for the decision that
    admitted it, long out and deleted (it waited for it until barrier_timeout, and the survivor with it)."""
    plan = {"steps": 45, "step_s": 0.03, "active": 4, "wrapper": WRAPPER, "pg_timeout": 150,
            "kills": [{"seat": 3, "life": 0, "step": 5}, {"seat": 2, "life": 0, "step": 20, "after_joiners": 1},
                      {"seat": 1, "life": 0, "step": 28}, {"seat": 3, "life": 1, "step": 34}]}
    joiner, text, logs = seat_3_replaced(tmp_path, plan)
    assert joiner.returncode == -signal.SIGKILL, text
    assert logs["seat3.life1"]["killed_at"] == 34, text
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0"], (sorted(finishers), text)
    restarts = finishers["seat0.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[3], [2], [1], [3]], restarts
    assert [r["joined"] for r in restarts] == [[], [3], [], []], restarts
    starts = {entry["iteration"]: entry["t"] for entry in logs["seat0.life0"]["iterations"]}
    last = restarts[3]["iteration"]
    # The last iteration before the restart began before step 34, at most ~0.3 s of steps; 30 s is far from
    # barrier_timeout (150 s) and hard_timeout (120 s), which the stalled job ran into.
    assert starts[last + 1] - starts[last] < 30, starts


@pytest.mark.timeout(300)
def test_a_grow_scheduled_when_the_function_returns_leaves_no_keys(tmp_path: pathlib.Path) -> None:
    """3 active seats, GrowPolicy(check_every=1000). Seat 2 is SIGKILLed; its replacement waits.
    At the end, with the joiner waiting, every rank passes 1,000 safe points: one is a look, where
    active rank 0 schedules a grow 1,000 safe points later, and the function returns first. The
    store (torchrun's agent store stands in: it outlives the ranks) holds no grow key afterwards."""
    out = tmp_path / "out"
    out.mkdir()
    server = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    plan = {"steps": 30, "step_s": 0.03, "active": 3, "wrapper": WRAPPER, "grow": {"check_every": 1000},
            "end_after_joiners": 1, "end_safe_points": 1000, "kills": [{"seat": 2, "life": 0, "step": 3}]}
    env = {**job_env(out, plan), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with join_job([str(WORKERS / "join_worker.py")], 3, env=env, port=server.port) as job:
        until("seat 2 killed", lambda: job.ranks[2].popen.poll() is not None)
        job.respawn(2, 1)
        text = finish(job, 240)
    assert [rp.returncode for rp in job.ranks] == [0, 0, -signal.SIGKILL], text
    assert "grow: 1 joiner(s) wait; the job restarts to take them in at safe point" in text, text[-4000:]
    logs = read_logs(out)
    last = logs["seat0.life0"]["result"]["iteration"]
    prefix = call_prefix(0)
    grow_keys = [f"{prefix}{i}/{name}" for i in range(last + 1) for name in ("grow_at", "grow_arrivals")]
    assert [key for key in grow_keys if server.check([key])] == [], text[-4000:]
    # The store was read where the job wrote: its seats are there.
    assert server.check([seat_table.key(prefix, 0)])
