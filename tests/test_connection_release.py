"""ConnectionRelease on real TCP sockets over 127.0.0.1 (no torch): what gloo's side and the peer see."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from inprocess.engine import sockets
from inprocess.engine.connection_release import ConnectionRelease

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s


def connected_pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """(owner, peer): owner plays gloo's pair socket, peer the other rank's."""
    peer = socket.create_connection(listener.getsockname())
    owner, _ = listener.accept()
    return owner, peer


def identity(s: socket.socket) -> str:
    ident = sockets.identity(s.fileno())
    assert ident is not None
    return ident


def wait_until(cond, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def write_all(s: socket.socket, n: int, timeout: float) -> int:
    """Writes n bytes with a deadline; returns how many went out."""
    s.settimeout(timeout)
    sent = 0
    chunk = b"x" * 65536
    try:
        while sent < n:
            sent += s.send(chunk[: n - sent])
    except (TimeoutError, OSError):
        pass
    return sent


def test_the_owner_reads_the_queued_bytes_then_end_of_file_and_the_peer_can_still_write(listener):
    owner, peer = connected_pair(listener)
    release = ConnectionRelease()
    try:
        peer.sendall(b"queued")
        time.sleep(0.05)
        assert release.release({owner.fileno(): identity(owner)}) == 1
        owner.settimeout(2)
        assert owner.recv(100) == b"queued"
        assert owner.recv(100) == b""  # the end of file that fails gloo's pair
        owner.sendall(b"the owner's sends still go out")
        assert peer.recv(100) == b"the owner's sends still go out"
        peer.sendall(b"and so do the peer's")
    finally:
        owner.close()
        peer.close()
        release.close_all()


def test_once_the_owner_closed_the_peer_can_write_far_more_than_the_buffers_hold(listener):
    owner, peer = connected_pair(listener)
    release = ConnectionRelease()
    try:
        release.release({owner.fileno(): identity(owner)})
        owner.close()  # gloo closes its descriptor when the pair fails
        # Without the drain, the kernel's queues (a few MB) would fill and the write block.
        assert write_all(peer, 64 << 20, timeout=10) == 64 << 20
        assert release.held() == 1
        peer.close()
        assert wait_until(lambda: release.held() == 0), "the hold outlived the peer's close"
    finally:
        peer.close()
        release.close_all()


def test_a_socket_with_unsent_bytes_is_shut_only_once_its_queue_drained(listener):
    owner, peer = connected_pair(listener)
    release = ConnectionRelease(gate_s=10)
    try:
        # Fill the owner's send queue: the peer does not read.
        owner.setblocking(False)
        try:
            while True:
                owner.send(b"y" * 65536)
        except BlockingIOError:
            pass
        assert sockets.unsent_bytes(owner.fileno()) > 0
        release.release({owner.fileno(): identity(owner)})
        peer.sendall(b"z")
        time.sleep(0.2)
        owner.setblocking(True)
        owner.settimeout(2)
        assert owner.recv(1) == b"z"
        owner.setblocking(False)
        with pytest.raises(BlockingIOError):  # no end of file yet: the read side is still open
            owner.recv(1)
        # The peer reads: the queue drains, and the read side is shut within a few polls.
        reader = threading.Thread(target=lambda: write_all_reader(peer), daemon=True)
        reader.start()
        assert wait_until(lambda: read_eof(owner)), "the read side was not shut after the queue drained"
    finally:
        owner.close()
        peer.close()
        release.close_all()


def write_all_reader(s: socket.socket) -> None:
    s.settimeout(5)
    try:
        while s.recv(1 << 20):
            pass
    except OSError:
        pass


def read_eof(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False


def test_listeners_closed_and_unconnected_sockets_are_left_alone(listener):
    unconnected = socket.socket()
    owner, peer = connected_pair(listener)
    gone_fd, gone_ident = peer.fileno(), identity(peer)
    peer.close()
    release = ConnectionRelease()
    try:
        held = release.release({
            listener.fileno(): identity(listener),
            unconnected.fileno(): identity(unconnected),
            gone_fd: gone_ident,
        })
        assert held == 0
        assert release.held() == 0
        listener.settimeout(0.01)
        with pytest.raises(TimeoutError):
            listener.accept()  # still listening, untouched
    finally:
        unconnected.close()
        owner.close()


def test_close_all_gives_every_descriptor_back(listener):
    pairs = [connected_pair(listener) for _ in range(4)]
    before = len(os.listdir("/proc/self/fd"))
    release = ConnectionRelease()
    try:
        assert release.release({o.fileno(): identity(o) for o, _ in pairs}) == 4
        assert len(os.listdir("/proc/self/fd")) == before + 4
        assert release.close_all() == 4
        assert len(os.listdir("/proc/self/fd")) == before
        assert release.held() == 0
    finally:
        for o, p in pairs:
            o.close()
            p.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="gate_s=-1"):
        ConnectionRelease(gate_s=-1)
    with pytest.raises(ValueError, match="busy_poll_s=0"):
        ConnectionRelease(busy_poll_s=0)
