"""Finding this process's sockets and shutting chosen ones down.

Used to release a thread blocked on a connection (a gloo pair, the
iteration store's client) without closing the descriptor under its owner:
``shutdown(2)`` makes the blocked read or write fail at once, and the owner
still closes the descriptor itself.
"""

from __future__ import annotations

import os
import socket


def socket_fds() -> dict[int, str]:
    """Descriptor -> "socket:[inode]" for every socket of this process."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def new_since(before: dict[int, str]) -> dict[int, str]:
    return {fd: t for fd, t in socket_fds().items() if before.get(fd) != t}


def _local_port(fd: int) -> tuple[int, bool]:
    """(local port, is a listener) of socket ``fd``; (-1, False) for a non-IP socket."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return -1, False
        return int(sock.getsockname()[1]), bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return -1, False
    finally:
        sock.detach()


def accepted_by_older_listeners(new: dict[int, str], before: dict[int, str]) -> dict[int, str]:
    """The sockets of ``new`` that a listener of ``before`` accepted.

    A TCPStore server living in this process (multi_tenant, or rank 0 of an
    application's own store) accepts its clients' connections on its own
    threads, at any time: one accepted while a process group was being built
    belongs to the store, not to the group, and must survive the group's abort.
    """
    listening = set()
    for fd in before:
        port, is_listener = _local_port(fd)
        if is_listener:
            listening.add(port)
    accepted = {}
    for fd, identity in new.items():
        port, is_listener = _local_port(fd)
        if port in listening and not is_listener:
            accepted[fd] = identity
    return accepted


def shutdown_connected(sockets: dict[int, str]) -> tuple[int, list[int]]:
    """Shut down each socket still open under the same identity, never a listener.

    Returns (how many were shut down, descriptors already gone).
    """
    current = socket_fds()
    count = 0
    gone = []
    for fd, identity in sockets.items():
        if current.get(fd) != identity:
            gone.append(fd)  # closed, or the number now belongs to someone else
            continue
        try:
            # The owner may close it between our check and here.
            sock = socket.socket(fileno=fd)
        except OSError:
            gone.append(fd)
            continue
        try:
            # gloo's listener thread aborts the process when accept() fails.
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass  # not connected (yet, or any more): nothing in flight on it
        finally:
            sock.detach()
    return count, gone
