"""The edges of joining a running job (issue 21, item 1), each with its outcome asserted, in one job:
a joiner whose configuration differs is refused and told why; one that asks for a seat held by a
running process waits, and the job's end closes it; one that dies while it waits is withdrawn and
costs the job no restart; one of another incarnation is refused at once; the right one is admitted."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import signal
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist

from conftest import WORKERS, leftover_processes
from inprocess.control.joining import JoinKeys, Outcome
from inprocess.control.store_ops import CountingStore
from inprocess.launch import LocalJob, RankProcess

pytestmark = pytest.mark.multiprocess


def until(what: str, done: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(0.05)


def outcome_of(keys: JoinKeys, token_pid: int) -> Outcome | None | str:
    """The outcome of the joiner whose process is ``token_pid`` ("absent" before it announced)."""
    for _, a in keys.pending()[1]:
        if a.pid == token_pid:
            return keys.read_outcome(a.token)
    return "absent"


@pytest.mark.timeout(420)
def test_a_job_meets_every_kind_of_joiner(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    wrapper = {"soft_timeout": 90, "hard_timeout": 120, "barrier_timeout": 150}
    plan = {"steps": 60, "step_s": 0.03, "active": 4, "end_after_joiners": 1, "wrapper": wrapper, "pg_timeout": 120,
            "kills": [{"seat": 3, "life": 0, "step": 8}, {"seat": 2, "life": 0, "step": 20, "after_joiners": 3}]}
    other_plan = {**plan, "wrapper": {**wrapper, "soft_timeout": 80}}
    env = {"INPROCESS_TEST_OUT": str(out), "INPROCESS_TEST_PLAN": json.dumps(plan), "INPROCESS_TEST_LOG": "INFO",
           "INPROCESS_RESTART_STORM": "off", "INPROCESS_TEST_DUMP_AFTER": "380"}
    with LocalJob([str(WORKERS / "join_worker.py")], 4, env=env) as job:
        try:
            client = dist.TCPStore("127.0.0.1", job.port, 1, False, datetime.timedelta(seconds=30))
            keys = JoinKeys(CountingStore(client), 0, "")
            until("seat 3 killed", lambda: job.ranks[3].popen.poll() is not None)
            doomed = job.respawn(3, 1)
            until("the first joiner announced", lambda: outcome_of(keys, doomed.popen.pid) is None)
            # The process only, as the OOM killer would: its monitor withdraws it.
            os.kill(doomed.popen.pid, signal.SIGKILL)
            until("the killed joiner withdrawn", lambda: isinstance(o := outcome_of(keys, doomed.popen.pid), Outcome)
                  and o.kind == "gone")
            stale = job.respawn(0, 1, {"TORCHELASTIC_RUN_ID": "another-run", "TORCHELASTIC_RESTART_COUNT": "3"})
            unfit = job.respawn(3, 2, {"INPROCESS_TEST_PLAN": json.dumps(other_plan)})
            held = job.respawn(1, 1)
            fit = job.respawn(3, 3)  # seat 2's kill waits for it: then the restart admits it
            job.wait(360)
            every: list[RankProcess] = job.ranks + job.respawned
            for rp in job.respawned:
                rp.output, _ = rp.popen.communicate(timeout=30)
                rp.returncode = rp.popen.returncode
            text = "\n".join(f"--- rank {rp.rank} pid {rp.popen.pid} rc={rp.returncode}\n{(rp.output or '')[-3000:]}"
                             for rp in every)
        except BaseException:
            job.kill()
            for rp in job.ranks + job.respawned:
                print(f"--- rank {rp.rank} pid {rp.popen.pid} rc={rp.popen.returncode}\n{(rp.output or '')[-3000:]}")
            raise
        finally:
            job.kill()
        left = leftover_processes({rp.popen.pid for rp in job.ranks + job.respawned}, grace=10.0)
        assert not left, left
    assert unfit.returncode == 1 and "JoinRefused" in (unfit.output or ""), text
    assert "soft_timeout differs: the job has '0:01:30', this process has '0:01:20'" in (unfit.output or ""), text
    assert stale.returncode == 1 and "another incarnation" in (stale.output or ""), text
    assert doomed.returncode == -signal.SIGKILL, text
    assert held.returncode == 0 and "is held by a running process" in (held.output or ""), text
    assert fit.returncode == 0, text
    logs = {path.stem: json.loads(path.read_text()) for path in out.glob("seat*.json")}
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0", "seat1.life0", "seat3.life3"], (sorted(finishers), text)
    assert logs["seat3.life3"]["iterations"][0]["iteration"] == 2, logs["seat3.life3"]
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1
    assert {r["step"] for r in finishers.values()} == {60}
    # Two restarts, one per kill: the withdrawn joiner cost none; the second admitted the fit joiner.
    restarts = finishers["seat0.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[3], [2]], restarts
    assert restarts[1]["joined"] == [3] and restarts[1]["activated"] == [3], restarts
    assert logs["seat1.life1"]["result"] is None  # the held seat's joiner returned like a spare
