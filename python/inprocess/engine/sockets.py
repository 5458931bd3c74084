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
    out = {}
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
