"""Reaching the store: a rank that starts before the store host listens connects as soon as it
listens (torch's own client backs off for about half a second first), and a bad MASTER_ADDR or
MASTER_PORT is a clear error naming it, in bounded time, with nothing left running."""

from __future__ import annotations

import datetime
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import inprocess
from inprocess.launch import free_port
from inprocess.store import _await_listener, _reach_store, _resolve

pytestmark = pytest.mark.timeout(60)


def test_returns_within_a_few_polls_of_the_listener_appearing() -> None:
    port = free_port()
    listener = socket.socket()
    listening_at: list[float] = []

    def listen_later() -> None:
        time.sleep(0.3)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        listening_at.append(time.monotonic())

    t = threading.Thread(target=listen_later)
    t.start()
    try:
        _await_listener(_resolve("127.0.0.1", port), "127.0.0.1", port, timeout_s=10)
        returned = time.monotonic()
        t.join()
        assert listening_at, "returned before anything listened"
        assert returned - listening_at[0] < 0.1, returned - listening_at[0]
    finally:
        t.join()
        listener.close()


def _store(monkeypatch: pytest.MonkeyPatch, addr: str, port: int, rank: int, timeout_s: float) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    inprocess.store.TCPStore(host_name=addr, port=port, timeout=datetime.timedelta(seconds=timeout_s))


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unresolvable_master_addr_is_named_at_once(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"'no-such-host\.invalid' \(store_kwargs host_name\) does not resolve"):
        _store(monkeypatch, "no-such-host.invalid", free_port(), rank, 30)
    assert time.monotonic() - start < 10


def test_nothing_listening_is_named_at_the_stores_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"nothing listens at 127\.0\.0\.1:{port} .* after 1s"):
        _store(monkeypatch, "127.0.0.1", port, 1, 1)
    assert time.monotonic() - start < 5


def test_a_listener_that_is_not_a_store_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # Accepts connections and never answers: the handshake probe gives up after its own bound.
    monkeypatch.setattr(inprocess.store, "PROBE_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"127\.0\.0\.1:{port} \(store_kwargs host_name, store_kwargs port\) "
                                                  "is not a torch TCPStore server"):
            _store(monkeypatch, "127.0.0.1", port, 1, 30)
        assert time.monotonic() - start < 5


def test_a_bad_master_addr_in_a_wrapped_call_leaves_nothing_running(tmp_path) -> None:
    # Rank 0 would fork the store host: the address fails first, and no process is left.
    code = textwrap.dedent("""
        import os, psutil, inprocess
        @inprocess.Wrapper()
        def train():
            return "ran"
        try:
            train()
        except ValueError as e:
            print("ERROR", e)
        print("CHILDREN", len(psutil.Process().children(recursive=True)))
    """)
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="no-such-host.invalid", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=40)
    assert "ERROR the store's address 'no-such-host.invalid' (MASTER_ADDR) does not resolve" in done.stdout, done
    assert "CHILDREN 0" in done.stdout, done.stdout


def _resetting_listener(port: int, resets: int | None, closed: threading.Event) -> threading.Thread:
    """Listens at ``port`` and resets the first ``resets`` connections (every one if None) before any
    answer, as a store server going away does; then stops listening and sets ``closed``."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    listener.settimeout(0.2)

    def serve() -> None:
        done = 0
        try:
            while (resets is None or done < resets) and not closed.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # linger on, 0 s: a reset
                done += 1
        finally:
            listener.close()
            closed.set()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_a_server_going_away_in_the_handshake_is_waited_out_until_its_successor_answers() -> None:
    # The previous wrapped call's store host resets this rank's probe; the next call's host takes the
    # port right after it: the rank connects to the new one instead of leaving the job.
    port = free_port()
    closed = threading.Event()
    old = _resetting_listener(port, 1, closed)
    successor: list[object] = []

    def take_over() -> None:
        closed.wait(10)
        successor.append(torch_store(port))

    t = threading.Thread(target=take_over, daemon=True)
    t.start()
    try:
        start = time.monotonic()
        _reach_store(_resolve("127.0.0.1", port), "127.0.0.1", port, timeout_s=10)
        assert time.monotonic() - start < 5
        assert closed.is_set(), "returned before the old server went away"
    finally:
        t.join(15)
        old.join(5)
    assert successor, "the successor store never started"


def test_a_listener_that_resets_every_handshake_is_named_at_the_timeout() -> None:
    port = free_port()
    closed = threading.Event()
    listener = _resetting_listener(port, None, closed)
    try:
        start = time.monotonic()
        # Reset in the handshake or, at the last attempt, in the connect itself: either is named.
        with pytest.raises(ConnectionError, match=rf"127\.0\.0\.1:{port} \(MASTER_ADDR, MASTER_PORT\) is not a torch "
                                                  r"TCPStore server: .*("
                                                  r"closed the connection in the handshake|Connection reset by peer)"):
            _reach_store(_resolve("127.0.0.1", port), "127.0.0.1", port, timeout_s=1.0)
        assert time.monotonic() - start < 3
    finally:
        closed.set()
        listener.join(5)


def torch_store(port: int) -> object:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


# -- Which store: torchrun's agent store, or the one the keywords name -------------------------------


def _under_torchrun(monkeypatch: pytest.MonkeyPatch, master_port: int, rank: int = 0) -> None:
    """The environment torchrun gives its workers with its shared agent store (torch/distributed/elastic/
    agent/server/local_elastic_agent.py sets TORCHELASTIC_USE_AGENT_STORE; MASTER_PORT is the agent's port)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master_port))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.mark.parametrize(
    ("host_name", "port_offset", "agent"),
    [(None, None, True), (None, 0, True), ("127.0.0.1", 0, True), ("localhost", 0, True),
     (None, 1, False), ("127.0.0.1", 1, False), ("127.0.0.2", 0, False)],
)
def test_the_agent_store_is_used_only_where_the_keywords_point_at_it(
    monkeypatch: pytest.MonkeyPatch, host_name: str | None, port_offset: int | None, agent: bool
) -> None:
    _under_torchrun(monkeypatch, 29400)
    port = None if port_offset is None else 29400 + port_offset
    assert inprocess.store.uses_agent_store(host_name, port) is agent


@pytest.mark.parametrize("value", [None, "False", "0"])
def test_without_torchruns_shared_store_no_agent_store_is_assumed(monkeypatch: pytest.MonkeyPatch,
                                                                  value: str | None) -> None:
    _under_torchrun(monkeypatch, 29400)
    if value is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", value)
    assert inprocess.store.uses_agent_store(None, None) is False


def test_under_torchrun_an_explicit_port_is_served_by_rank_0_and_reached_by_the_others(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Nothing listens at MASTER_PORT: had either rank taken the agent's store, it would wait there and fail.
    agent_port, port = free_port(), free_port()
    _under_torchrun(monkeypatch, agent_port, rank=0)
    caplog.set_level("DEBUG", logger="inprocess")
    timeout = datetime.timedelta(seconds=5)
    host = inprocess.store.TCPStore(port=port, timeout=timeout)
    try:
        assert host.host_process is not None and host.is_host and not host.uses_agent_store
        assert host.port == port
        monkeypatch.setenv("RANK", "1")
        client = inprocess.store.TCPStore(port=port, timeout=timeout)
        assert client.host_process is None and not client.is_host and client.port == port
        client.set("seen", "by rank 1")
        assert host.get("seen") == b"by rank 1"
        del client
    finally:
        host.host_process.stop()
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("store:")]
    assert chosen == [f"store: served by initial rank 0 at 127.0.0.1:{port} (MASTER_ADDR, store_kwargs port), "
                      f"not torchrun's agent store at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{agent_port}"] * 2, chosen


@pytest.mark.parametrize("explicit_port", [False, True], ids=["no_port", "master_port"])
def test_under_torchrun_the_agent_store_is_joined_as_a_client_by_every_rank(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, explicit_port: bool
) -> None:
    agent = torch_store(free_port())  # stands for the server in torchrun's agent
    agent_port = agent.port  # type: ignore[attr-defined]
    _under_torchrun(monkeypatch, agent_port, rank=0)
    caplog.set_level("DEBUG", logger="inprocess")
    store = inprocess.store.TCPStore(port=agent_port if explicit_port else None,
                                     timeout=datetime.timedelta(seconds=5))
    assert store.host_process is None and not store.is_host and store.uses_agent_store
    store.set("k", "v")
    assert agent.get("k") == b"v"  # type: ignore[attr-defined]
    origin = "MASTER_ADDR, store_kwargs port" if explicit_port else "MASTER_ADDR, MASTER_PORT"
    assert f"store: torchrun's agent store at 127.0.0.1:{agent_port} (torchrun's agent store; {origin}), every " \
           "rank its client" in caplog.text


def test_an_unreachable_explicit_port_is_named_as_the_store_kwargs_port(monkeypatch: pytest.MonkeyPatch) -> None:
    # The message names the port that was tried and where it came from, not MASTER_PORT.
    agent_port, port = free_port(), free_port()
    _under_torchrun(monkeypatch, agent_port, rank=1)
    with pytest.raises(TimeoutError) as raised:
        inprocess.store.TCPStore(port=port, timeout=datetime.timedelta(seconds=1))
    assert str(raised.value).startswith(f"nothing listens at 127.0.0.1:{port} (MASTER_ADDR, store_kwargs port) "
                                        "after 1s"), raised.value
    assert "MASTER_PORT" not in str(raised.value)
