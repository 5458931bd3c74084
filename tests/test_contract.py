"""The helper processes' contract (inprocess.processes.contract): each
configuration reads back what it writes, every field refuses a bad value with
a message naming it (and the real process exits 2), the console scripts are
installed and answer --help, and the handle's stop() leaves no process behind."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import os
import pathlib
import signal
import subprocess
import sys
import sysconfig
import time
from typing import Any

import pytest

from inprocess.processes.contract import (
    EXIT_USAGE,
    ConfigError,
    HelperConfig,
    MonitorConfig,
    NodeAgentConfig,
    StopRequest,
    StoreHostConfig,
)
from inprocess.processes.helper_process import HelperProcess

pytestmark = pytest.mark.timeout(60)

MONITOR = MonitorConfig(
    store_host="node-7.example", store_port=29500, call=3, rank=12, heartbeat_fd=5, pid=4242, grace_s=0.1,
    kill_wait_s=2.5, world_size=16, store_timeout_s=1e-9, barrier_timeout_s=120, heartbeat_interval_s=0.3,
    heartbeat_timeout_s=1.7, pidfile="/tmp/a dir/monitor 12.pid", logfile="--odd name.log", log_level="DEBUG",
    incarnation="torchrun.job%2F1.2+slurm.7.0.", log_format="%(asctime)s [%(levelname)s] %(name)s: %(message)s",
    join_token="node-7-4242-0a1b2c3d",
)
STORE_HOST = StoreHostConfig(port=0, world_size=8, idle_timeout_s=60, ready_fd=9, parent_pid=77,
                             check_interval_s=0.25, libuv=False, log_level="ERROR")
NODE_AGENT = NodeAgentConfig(store_host="127.0.0.1", store_port=1, call=0, node="rack 3/node=4", slots=8,
                             store_timeout_s=30.5, connect_timeout_s=30)
SAMPLES: list[HelperConfig] = [MONITOR, STORE_HOST, NODE_AGENT]

# One value per field that the field must refuse (wrong type, or outside its rule).
BAD_VALUES: dict[type, dict[str, Any]] = {
    MonitorConfig: {
        "log_level": "LOUD", "logfile": 3, "store_host": "", "store_port": 0, "call": -1, "rank": -1,
        "heartbeat_fd": -1, "pid": 0, "grace_s": -1.0, "kill_wait_s": 0, "world_size": 0, "store_timeout_s": 0,
        "barrier_timeout_s": float("nan"), "heartbeat_interval_s": -0.5, "heartbeat_timeout_s": "1", "pidfile": 7,
        "incarnation": "torchrun.a/b.0", "log_format": 3, "join_token": "a/b",
    },
    StoreHostConfig: {
        "log_level": "info", "logfile": b"log", "port": 65536, "world_size": 0, "idle_timeout_s": 0, "ready_fd": -2,
        "parent_pid": -1, "check_interval_s": float("inf"), "libuv": 1, "incarnation": 3, "log_format": b"%(message)s",
    },
    NodeAgentConfig: {
        "log_level": None, "logfile": 1.5, "store_host": 5, "store_port": 70000, "call": True, "node": "",
        "slots": 0, "store_timeout_s": -1, "connect_timeout_s": 0, "incarnation": "x/y", "log_format": 1.5,
    },
}


@pytest.mark.parametrize("config", SAMPLES, ids=lambda c: type(c).__name__)
def test_a_config_reads_back_what_it_writes(config: HelperConfig) -> None:
    argv = config.to_argv()
    assert type(config).from_argv(argv) == config
    command = config.command()
    assert command[:3] == [sys.executable, "-m", type(config).module]  # never through PATH
    assert command[3:] == argv


def test_ints_given_for_durations_are_stored_as_floats_and_none_is_left_out() -> None:
    config = dataclasses.replace(MONITOR, world_size=None, pidfile=None)
    assert isinstance(config.barrier_timeout_s, float) and config.barrier_timeout_s == 120.0
    assert not any(a.startswith(("--world-size", "--pidfile")) for a in config.to_argv())
    assert MonitorConfig.from_argv(config.to_argv()) == config


def test_every_field_has_a_bad_value_in_this_test() -> None:
    for cls, bad in BAD_VALUES.items():
        assert set(bad) == {f.name for f in dataclasses.fields(cls)}, cls.__name__


@pytest.mark.parametrize(
    "sample, name, value",
    [(s, name, value) for s in SAMPLES for name, value in BAD_VALUES[type(s)].items()],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_a_bad_value_is_refused_naming_the_field(sample: HelperConfig, name: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(sample, **{name: value})
    e = info.value
    assert (e.name, e.owner) == (name, type(sample).__name__)
    assert f"{type(sample).__name__}: {name}={value!r}: expected " in str(e)
    assert e.expected and e.as_option().startswith("--" + name.replace("_", "-") + "=")


@pytest.mark.parametrize(
    "cls, option, expected",
    [
        (MonitorConfig, "--grace-s=soon", "--grace-s=soon: expected a number >= 0"),
        (StoreHostConfig, "--libuv=maybe", "--libuv=maybe: expected true or false"),
        (NodeAgentConfig, "--slots=2.5", "--slots=2.5: expected an int > 0"),
    ],
)
def test_text_that_is_not_of_the_field_type_is_refused_naming_the_option(
    cls: type[HelperConfig], option: str, expected: str
) -> None:
    sample = next(s for s in SAMPLES if type(s) is cls)
    flag = option.split("=")[0]
    argv = [a for a in sample.to_argv() if not a.startswith(flag + "=")] + [option]
    with pytest.raises(ConfigError) as info:
        cls.from_argv(argv)
    assert info.value.as_option() == expected


def _run_module(cls: type[HelperConfig], argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", cls.module, *argv], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL, **kwargs)


@pytest.mark.parametrize(
    "sample, option",
    [(MONITOR, "--store-port=0"), (STORE_HOST, "--world-size=0"), (NODE_AGENT, "--connect-timeout-s=-1")],
    ids=["monitor", "store_host", "node_agent"],
)
def test_the_process_exits_2_naming_the_bad_option(sample: HelperConfig, option: str) -> None:
    flag = option.split("=")[0]
    argv = [a for a in sample.to_argv() if not a.startswith((flag + "=", "--ready-fd="))] + [option]
    proc = _run_module(type(sample), argv)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert f"{type(sample).script}: error: {option}: expected " in proc.stderr


def test_a_missing_option_exits_2_naming_it() -> None:
    argv = [a for a in NODE_AGENT.to_argv() if not a.startswith("--slots=")]
    proc = _run_module(NodeAgentConfig, argv)
    assert proc.returncode == EXIT_USAGE and "--slots" in proc.stderr, proc.stderr


def test_the_store_host_reports_bad_input_on_its_ready_pipe_too() -> None:
    read_fd, write_fd = os.pipe()
    try:
        argv = ["--port=70000", "--world-size=2", "--idle-timeout-s=60", f"--ready-fd={write_fd}"]
        proc = _run_module(StoreHostConfig, argv, pass_fds=[write_fd])
        os.close(write_fd)
        write_fd = -1
        with os.fdopen(read_fd, "rb") as pipe:
            read_fd = -1
            line = pipe.read().decode()
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
    assert proc.returncode == EXIT_USAGE
    assert line.strip() == "--port=70000: expected an int in 0..65535"


SCRIPTS = {
    "inprocess-monitor": "inprocess.processes.monitor:main",
    "inprocess-store-host": "inprocess.processes.store_host:main",
    "inprocess-node-agent": "inprocess.processes.node_agent:main",
}


def test_the_console_scripts_are_in_the_installed_metadata() -> None:
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
                 if ep.name in SCRIPTS}
    assert installed == SCRIPTS
    for cls in (MonitorConfig, StoreHostConfig, NodeAgentConfig):
        assert SCRIPTS[cls.script] == f"{cls.module}:main"


@pytest.mark.parametrize("cls", [MonitorConfig, StoreHostConfig, NodeAgentConfig], ids=lambda c: c.script)
def test_the_console_script_and_the_module_answer_help(cls: type[HelperConfig]) -> None:
    script = pathlib.Path(sysconfig.get_path("scripts")) / cls.script
    assert script.exists(), f"{script} is not installed: pip install -e . again"
    for command in ([str(script), "--help"], [sys.executable, "-m", cls.module, "--help"]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (command, proc.stderr)
        assert cls.summary.split(":")[0] in " ".join(proc.stdout.split())
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in proc.stdout, f.name


def _pid_exists(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return os.path.exists(f"/proc/{pid}")  # not our child any more: reaped, unless it was reused
    return True


def test_stop_kills_and_reaps_a_process_that_ignores_sigterm() -> None:
    stubborn = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "print('ignoring', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )
    handle = HelperProcess(NODE_AGENT, stubborn)  # any config: the handle does not care what runs
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == "ignoring\n"
        t0 = time.monotonic()
        assert handle.stop(grace_s=0.5) == -signal.SIGKILL
        assert time.monotonic() - t0 >= 0.5  # it had its grace first
        assert not _pid_exists(stubborn.pid)
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
            stubborn.wait()
        assert stubborn.stdout is not None
        stubborn.stdout.close()


def test_stop_continues_a_frozen_helper_which_then_exits_on_sigterm() -> None:
    """A real node agent, SIGSTOPped: SIGCONT lets it take the SIGTERM, and it
    leaves through its own stop path (status 0), not through SIGKILL."""
    dist = pytest.importorskip("torch.distributed")
    from inprocess.control.node_link import NodeLink, socket_name

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    config = dataclasses.replace(NODE_AGENT, store_port=server.port, node="frozen", slots=1)
    agent = HelperProcess.start(config)
    link = None
    try:
        link = NodeLink.connect(socket_name("127.0.0.1", server.port, 0, "frozen"), 0, 20)
        os.kill(agent.pid, signal.SIGSTOP)
        assert agent.stop(grace_s=10) == 0
        assert not _pid_exists(agent.pid)
    finally:
        if link is not None:
            link.close()
        if agent.poll() is None:
            agent.popen.kill()
            agent.popen.wait()


def test_the_first_to_set_a_stop_request_says_why() -> None:
    by_signal = StopRequest()
    by_signal.set_by_signal(signal.SIGTERM)
    by_signal.set()
    assert by_signal.is_set() and by_signal.signal == signal.SIGTERM
    by_itself = StopRequest()
    by_itself.set()
    by_itself.set_by_signal(signal.SIGHUP)
    assert by_itself.is_set() and by_itself.signal is None
