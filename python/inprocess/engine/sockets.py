"""Finding this process's sockets and acting on chosen ones without taking them from their owner.

Used to release a thread blocked on a connection (a gloo pair, the
iteration store's client): ``shutdown(2)`` makes the blocked read fail at
once while the owner still closes its descriptor itself. A socket is named by
its descriptor *and* its identity ("socket:[inode]"), so that a number the
owner closed and the kernel handed out again is never mistaken for it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios

# Linux TCP states (include/net/tcp_states.h): the peer closed its end.
_TCP_CLOSE_WAIT = 8
_TCP_CLOSE = 7
_TCP_LAST_ACK = 9
# linux/sockios.h: output queue size, not yet sent (the ioctl module has no name for it).
_SIOCOUTQNSD = 0x894B


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
    """(local port, is a listener) of socket ``fd``; (-1, False) for a non-IP socket or one
    that is closed by now."""
    try:
        # Its owner's threads (gloo's, a store's) may close it at any moment: then
        # socket() itself fails, with EBADF, while it probes the descriptor's family.
        sock = socket.socket(fileno=fd)
    except OSError:
        return -1, False
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


def identity(fd: int) -> str | None:
    """ "socket:[inode]" of descriptor fd, or None if it is closed or not a socket."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith("socket:") else None


def shutdown_connected(sockets: dict[int, str]) -> tuple[int, list[int]]:
    """Shut down each socket still open under the same identity, never a listener.

    Returns (how many were shut down, descriptors already gone).
    """
    current = socket_fds()
    count = 0
    gone = []
    for fd, ident in sockets.items():
        if current.get(fd) != ident:
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


def hold_connected(fd: int, ident: str) -> int | None:
    """A second descriptor of the connected TCP socket (fd, ident), or None.

    The socket then stays open when its owner closes fd: the peer sees no
    FIN or RST until the hold is closed too. None for a listener, a socket
    that is not connected, or one that is no longer (fd, ident).
    """
    try:
        held = os.dup(fd)  # not inheritable (os.dup's default)
    except OSError:
        return None
    # The owner may have closed fd and the number been reused before the dup.
    if identity(held) != ident:
        os.close(held)
        return None
    sock = socket.socket(fileno=held)
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise OSError("not a TCP socket")
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError("a listener")
        sock.getpeername()  # raises when not connected
    except OSError:
        sock.close()
        return None
    sock.detach()
    return held


def shutdown_read(fd: int) -> bool:
    """shutdown(fd, SHUT_RD): reads return what is queued, then end of file; writes still go out."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RD)
        return True
    except OSError:
        return False  # not connected any more: nothing to release on it
    finally:
        sock.detach()


def unsent_bytes(fd: int) -> int:
    """Bytes written to the socket and not sent yet, because the peer's window is full
    (SIOCOUTQNSD; bytes sent and waiting for a possibly delayed ACK do not count)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, _SIOCOUTQNSD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def unread_bytes(fd: int) -> int:
    """Bytes received and not yet read (SIOCINQ)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def quiet_ms(fd: int) -> int:
    """Milliseconds since data last went out or came in on the socket, whichever is later
    (tcp_info's last_data_sent and last_data_recv); 0 if unknown."""
    sock = socket.socket(fileno=fd)
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        if len(info) < 56:
            return 0
        last_sent, last_recv = struct.unpack_from("<I4xI", info, 44)
        return int(min(last_sent, last_recv))
    except OSError:
        return 0
    finally:
        sock.detach()


def peer_closed(fd: int) -> bool:
    """True once the peer closed its end (or reset the connection): it sends nothing more."""
    sock = socket.socket(fileno=fd)
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
        return state in (_TCP_CLOSE_WAIT, _TCP_CLOSE, _TCP_LAST_ACK)
    except OSError:
        return True
    finally:
        sock.detach()


def discard_input(fd: int, limit: int = 1 << 20) -> int:
    """Read and drop up to limit queued bytes without blocking; returns how many."""
    n = min(unread_bytes(fd), limit)
    if n <= 0:
        return 0
    sock = socket.socket(fileno=fd)
    try:
        return len(sock.recv(n, socket.MSG_DONTWAIT))
    except OSError:
        return 0
    finally:
        sock.detach()
