"""A gloo send in flight when its peer releases the connection: stranded, or released in bounded time.

torch 2.13's gloo strands an unbound send whose write fails (the pair fails
afterwards but never wakes that buffer): the wait ends only at the group's
timeout. These tests reproduce the race of a restart deterministically with
two real gloo ranks (tests/workers/gloo_release_worker.py): the sender is
stopped while the receiver's "ready to receive" notice reaches its socket,
the receiver releases its connections, and the sender resumes and starts
the send. See inprocess.engine.connection_release.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

import pytest

from inprocess.launch import LocalJob

pytestmark = [pytest.mark.timeout(90), pytest.mark.multiprocess]

WORKER = pathlib.Path(__file__).parent / "workers" / "gloo_release_worker.py"
GLOO_TIMEOUT_S = 30.0


def wait_file(path: pathlib.Path, timeout: float, job: LocalJob) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if any(rp.popen.poll() not in (None, 0) for rp in job.ranks):
            raise AssertionError(f"a rank failed before {path.name}:\n{job_outputs(job)}")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def job_outputs(job: LocalJob) -> str:
    job.kill()
    return job.outputs()[-6000:]


def run_scenario(tmp_path: pathlib.Path, release: str, sender_budget_s: float) -> tuple[dict, dict | None]:
    """Runs the scenario; returns (receiver.json, sender.json or None if the
    sender was still waiting after sender_budget_s)."""
    out = tmp_path / "out"
    out.mkdir()
    env = {"OUT": str(out), "RELEASE": release, "GLOO_TIMEOUT_S": str(GLOO_TIMEOUT_S), "SEND_MB": "64",
           "OMP_NUM_THREADS": "1"}
    with LocalJob([str(WORKER)], 2, env=env) as job:
        sender = job.ranks[0].popen
        assert wait_file(out / "sender_posted", 60, job), f"the sender never posted its send:\n{job_outputs(job)}"
        os.kill(sender.pid, signal.SIGSTOP)
        try:
            (out / "sender_stopped").touch()
            assert wait_file(out / "receiver.json", 20, job), f"the receiver never released:\n{job_outputs(job)}"
        finally:
            os.kill(sender.pid, signal.SIGCONT)
        receiver = json.loads((out / "receiver.json").read_text())
        finished = wait_file(out / "sender.json", sender_budget_s, job)
        sender_result = json.loads((out / "sender.json").read_text()) if finished else None
        (out / "done").touch()
        if finished:
            job.wait(30)
    return receiver, sender_result


def test_a_send_started_after_the_peer_released_completes(tmp_path: pathlib.Path) -> None:
    receiver, sender = run_scenario(tmp_path, "hold", sender_budget_s=10)
    assert receiver["released"] >= 1, receiver
    assert receiver["outcome"].startswith("error"), f"the receiver's recv was not failed by the release: {receiver}"
    assert sender is not None, "the sender's send was still waiting 10 s after it resumed (stranded)"
    # Nothing stopped the data: the held socket took it and the receiver dropped it.
    assert sender["outcome"] == "completed", sender
    assert sender["wait_s"] < 10, sender


def test_a_plain_shutdown_strands_the_send_until_glooss_timeout(tmp_path: pathlib.Path) -> None:
    """The control: what inprocess did before (SHUT_RDWR) leaves the sender blocked."""
    receiver, sender = run_scenario(tmp_path, "shutdown", sender_budget_s=5)
    assert receiver["outcome"].startswith("error"), receiver
    assert sender is None, (
        "gloo released the send by itself after a plain shutdown: this torch no longer strands it, "
        f"and inprocess.engine.connection_release may be simplified ({sender})"
    )
