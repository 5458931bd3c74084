"""The store host process (python -m inprocess.processes.store_host): it serves, it exits
when the call is done, when it is orphaned and the job is silent, or when
told; it refuses bad input with a message naming the value."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from inprocess.control.protocol import done_key, monitor_heartbeat_key
from inprocess.processes import contract, store_host
from inprocess.processes.contract import StoreHostConfig
from inprocess.processes.helper_process import HelperProcess

pytestmark = [pytest.mark.timeout(90), pytest.mark.multiprocess]


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))


def _start(port: int, idle_timeout_s: float = 60.0, start_timeout_s: float = 120.0) -> tuple[HelperProcess, int]:
    """Start a store host as a rank does (store.TCPStore) and wait for its port."""
    config = StoreHostConfig(port=port, world_size=2, idle_timeout_s=idle_timeout_s, parent_pid=os.getpid())
    host = HelperProcess.start(config, ready_timeout_s=start_timeout_s)
    return host, int(host.ready)


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_serves_and_exits_when_the_call_is_done() -> None:
    host, port = _start(0, idle_timeout_s=60)
    try:
        client = _client(port)
        client.set("x", "1")
        assert _client(port).get("x") == b"1"
        client.set(store_host.CALL_KEY, "5")
        assert host.alive()
        client.set(done_key(5), "1")
        assert host.wait_exit(10), "the store host did not exit after done"
        assert host.popen.returncode == store_host.EXIT_OK
    finally:
        host.stop()


def test_a_taken_port_is_refused_with_its_number() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port}"):
            _start(port, start_timeout_s=60)


def test_bad_arguments_exit_2_naming_the_value() -> None:
    argv = ["--port", "70000", "--world-size", "2", "--idle-timeout-s", "60"]
    proc = subprocess.run([sys.executable, "-m", "inprocess.processes.store_host", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == contract.EXIT_USAGE
    assert "--port=70000" in proc.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_it_at_once(signum: int) -> None:
    """Not after its lifetime check's interval (1 s): the signal closes the connection its wait is on."""
    config = StoreHostConfig(port=0, world_size=2, idle_timeout_s=60, parent_pid=os.getpid(), check_interval_s=30)
    host = HelperProcess.start(config, ready_timeout_s=120)
    try:
        client = _client(int(host.ready))
        client.set(store_host.CALL_KEY, "0")  # its wait is now on the call's done key, for 30 s at a time
        time.sleep(0.3)
        start = time.monotonic()
        host.popen.send_signal(signum)
        assert host.wait_exit(10)
        assert time.monotonic() - start < 1.5
        assert host.popen.returncode == store_host.EXIT_OK
    finally:
        host.stop()


def test_orphaned_host_exits_once_no_monitor_heartbeats() -> None:
    """Its starter SIGKILLed, the host serves on while a monitor counter moves,
    and exits after idle_timeout of silence: no server outlives the job."""
    starter = textwrap.dedent("""
        import os, sys
        from inprocess.processes.contract import StoreHostConfig
        from inprocess.processes.helper_process import HelperProcess
        config = StoreHostConfig(port=0, world_size=2, idle_timeout_s=1.5, parent_pid=os.getpid())
        host = HelperProcess.start(config, ready_timeout_s=120)
        print(host.pid, host.ready, flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.Popen([sys.executable, "-c", starter], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    host_pid = 0
    try:
        assert proc.stdout is not None and proc.stdin is not None
        host_pid, port = (int(x) for x in proc.stdout.readline().split())
        client = _client(port)
        key = monitor_heartbeat_key(0, 1)
        client.add(key, 1)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(10) == -signal.SIGKILL
        for _ in range(10):  # 2.5 s of heartbeats after the starter died: still serving
            client.add(key, 1)
            time.sleep(0.25)
        assert not _gone(host_pid, 0.1), "exited while a monitor was heartbeating"
        assert _gone(host_pid, 15), "an orphaned store host stayed after the job went silent"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if host_pid and not _gone(host_pid, 0):
            os.kill(host_pid, signal.SIGKILL)


def test_an_orphaned_host_whose_own_connection_closes_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31's long chaos run: the store host, whose starter (rank 0) had died, was stopped for a
    moment (the runner's slow store) inside its own wait's cancel exchange; its connection gave up on
    the reply and closed itself (TCPStoreClient._run: "no reply in time"), and its next look at the
    monitors' heartbeats raised out of serve(): the store exited, and the job with it. Here the host's
    first connection closes itself so on its third call; serve() runs in a thread of this process."""
    from inprocess.control.tcpstore_client import StoreConnectionError, TCPStoreClient

    ports: list[int] = []
    monkeypatch.setattr(store_host, "tell_ready", lambda config, detail: ports.append(int(detail)))
    made: list[TCPStoreClient] = []

    class ClosesOnItsThirdCall(TCPStoreClient):
        calls = 0

        def wait(self, keys, timeout=None):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self is made[0] and self.calls == 3:
                self.close()
                raise StoreConnectionError("wait: no reply in time (as after a stop inside its cancel)")
            return super().wait(keys, timeout)

    def client(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(ClosesOnItsThirdCall(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(store_host, "TCPStoreClient", client)
    config = StoreHostConfig(port=0, world_size=2, idle_timeout_s=1.0, check_interval_s=0.2)  # no parent: orphaned
    stop = contract.StopRequest()
    ended: list[int] = []
    thread = threading.Thread(target=lambda: ended.append(store_host.serve(config, stop)), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not ports and time.monotonic() < deadline:
            time.sleep(0.05)
        store = _client(ports[0])
        store.set(store_host.CALL_KEY, "0")
        for _ in range(30):  # 3 s of heartbeats: it reads them every idle_timeout / 4
            store.add(monitor_heartbeat_key(0, 1), 1)
            time.sleep(0.1)
        assert thread.is_alive() and len(made) >= 2, (ended, len(made))  # a new connection, still serving
        store.set(done_key(0), "1")
        thread.join(10)
        assert ended == [store_host.EXIT_OK]
    finally:
        stop.set()
        thread.join(10)
