"""What the real torchrun does when one of its workers dies: the rule README's "Respawn and rejoin" states.

torch 2.13, torch/distributed/elastic/agent/server/api.py, ``SimpleElasticAgent._invoke_run``: the agent
polls its workers (``_monitor_workers``, every ``--monitor-interval``); one worker that failed (a non-zero
status or a signal) makes the whole group FAILED. With restarts left it calls ``_restart_workers``: every
worker stopped (``_stop_workers``: SIGTERM, SIGKILL 30 s later), a new rendezvous round, all workers
started again with ``TORCHELASTIC_RESTART_COUNT`` + 1. With none left it stops every worker and ends. So
no worker is ever replaced alone, which is why a job under torchrun cannot keep its healthy processes
through a process death, and a respawned process cannot join one.

No inprocess here: plain workers, so that the test states torchrun's behaviour only.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from conftest import leftover_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

# Worker 1 SIGKILLs itself in every incarnation once its three siblings of that incarnation have started;
# they wait to be stopped (60 s at most) and record the signal that stops them.
WORKER = r"""
import json, os, signal, sys, time
out = os.environ["TORCHRUN_TEST_OUT"]
rank = int(os.environ["RANK"])
incarnation = os.environ["TORCHELASTIC_RESTART_COUNT"]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")

def record(what):
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "what": what,
                            "env": {k: os.environ.get(k) for k in keys}}) + "\n")

def stopped(signum, frame):
    record(signal.Signals(signum).name)
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, stopped)
record("start")
open(os.path.join(out, f"started.{incarnation}.{rank}"), "w").close()
deadline = time.monotonic() + 60
if rank == 1:
    while not all(os.path.exists(os.path.join(out, f"started.{incarnation}.{r}")) for r in range(4)):
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.02)
    record("sigkill")
    os.kill(os.getpid(), signal.SIGKILL)
while time.monotonic() < deadline:
    time.sleep(0.05)
record("timed out")
"""


def test_one_worker_killed_stops_every_worker_and_a_restart_starts_all_of_them_again(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, TORCHRUN_TEST_OUT=str(tmp_path))
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "--max-restarts", "1", "--monitor-interval", "0.1", str(script)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - start
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # torchrun's workers lead their own sessions (subprocess_handler.py: start_new_session=True).
    assert not leftover_processes({proc.pid} | {e["pid"] for e in events}, grace=10.0)

    def of(incarnation: str, what: str) -> dict[int, dict[str, object]]:
        return {int(e["env"]["RANK"]): e for e in events
                if e["env"]["TORCHELASTIC_RESTART_COUNT"] == incarnation and e["what"] == what}

    first, second = of("0", "start"), of("1", "start")
    assert sorted(first) == sorted(second) == [0, 1, 2, 3], output[-3000:]
    for incarnation in ("0", "1"):
        # Worker 1 killed: each of the three others was stopped with SIGTERM, none ran to its end.
        assert sorted(of(incarnation, "sigkill")) == [1]
        assert sorted(of(incarnation, "SIGTERM")) == [0, 2, 3], output[-3000:]
        assert not of(incarnation, "timed out")
        killed_at = of(incarnation, "sigkill")[1]["t"]
        assert all(e["t"] > killed_at for e in of(incarnation, "SIGTERM").values())
    # The restart: all four workers again, new processes, the next TORCHELASTIC_RESTART_COUNT, the same
    # run id, ranks and world; none of the first incarnation's processes lives on in it.
    assert not {e["pid"] for e in first.values()} & {e["pid"] for e in second.values()}
    for rank in range(4):
        before, after = first[rank]["env"], second[rank]["env"]
        assert isinstance(before, dict) and isinstance(after, dict)
        assert after == {**before, "TORCHELASTIC_RESTART_COUNT": "1"}, (before, after)
        assert before["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert min(e["t"] for e in second.values()) > max(e["t"] for e in of("0", "SIGTERM").values())
    # No restart left after the second death: no third incarnation, and torchrun fails.
    assert not of("2", "start")
    assert proc.returncode == 1, output[-3000:]
    assert elapsed < 120
