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
from inprocess.launch import ephemeral_port_range, free_port

pytestmark = pytest.mark.multiprocess

SCRIPT = """
import json, os, sys, time
out = os.environ["LAUNCH_TEST_OUT"]
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"env": {k: os.environ[k] for k in keys}, "argv": sys.argv[1:], "pid": os.getpid()}, f)
behaviour = os.environ.get("LAUNCH_TEST_BEHAVIOUR", "")
if behaviour == "fail_rank_1" and rank == 1:
    sys.exit(3)
if behaviour == "sleep":
    time.sleep(600)
"""


def launch(
    tmp_path: pathlib.Path, *args: str, behaviour: str = "", timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, LAUNCH_TEST_OUT=str(tmp_path), LAUNCH_TEST_BEHAVIOUR=behaviour)
    return subprocess.run(
        [sys.executable, "-m", "inprocess.launch", *args, str(script), "x", "--y"],
        env=env, capture_output=True, text=True, timeout=timeout,
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


def test_a_failing_rank_leaves_the_others_running_and_sets_the_status(tmp_path: pathlib.Path) -> None:
    res = launch(tmp_path, "--nproc", "3", behaviour="fail_rank_1")
    assert res.returncode == 3, res.stderr
    assert "rank 1 exited with status 3" in res.stderr
    assert len(ranks_seen(tmp_path, 3)) == 3  # ranks 0 and 2 ran to their end


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
