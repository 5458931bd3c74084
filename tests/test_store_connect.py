"""A rank that starts before the store host listens connects as soon as it listens (torch's own
client would back off for about half a second first)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from inprocess.store import _await_listener

pytestmark = pytest.mark.timeout(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_returns_within_a_few_polls_of_the_listener_appearing() -> None:
    port = _free_port()
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
        _await_listener("127.0.0.1", port, timeout_s=10)
        returned = time.monotonic()
        t.join()
        assert listening_at, "returned before anything listened"
        assert returned - listening_at[0] < 0.1, returned - listening_at[0]
    finally:
        t.join()
        listener.close()


def test_gives_up_at_its_deadline_when_nothing_listens() -> None:
    start = time.monotonic()
    _await_listener("127.0.0.1", _free_port(), timeout_s=0.3)
    assert 0.25 < time.monotonic() - start < 2


def test_an_unresolvable_host_is_left_to_torch_at_once() -> None:
    start = time.monotonic()
    _await_listener("no-such-host.invalid", 1234, timeout_s=10)
    assert time.monotonic() - start < 5
