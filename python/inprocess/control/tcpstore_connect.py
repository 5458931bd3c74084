"""Opening a connection to a torch ``TCPStore`` server: retries, the server's handshake, kernel timeouts.

A connection is retried with backoff (10 ms, doubling to 1 s) until ``connect_timeout`` while the
server is not listening yet (refused, reset) or the attempt times out; with ``retry_refused``
False a refusal fails at once (a client of a server known to have been serving takes it as the
server being gone). An open socket then passes torch's validation handshake (the magic number,
then a ``PING`` whose nonce must come back: what a torch ``TCPStore`` server answers and nothing
else does), and gets ``SO_RCVTIMEO``/``SO_SNDTIMEO`` for the client's operation timeout, so that
every later send or receive is bounded by the kernel (:mod:`inprocess.control.tcpstore_client`).

This module imports no torch.
"""

from __future__ import annotations

import builtins
import errno
import os
import socket
import struct
import time

from . import tcpstore_wire as wire
from .store_errors import StoreConnectionError, StoreHandshakeClosedError, StoreProtocolError

__all__ = ["open_connection", "set_socket_timeouts"]

_RETRY_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EAGAIN, errno.EINTR}
_GONE_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED}  # nobody listens there (any more)


def open_connection(host: str, port: int, connect_timeout: float, timeout: float, retry_refused: bool) -> socket.socket:
    """A blocking socket to the server at `host`:`port`, handshake done, kernel timeouts set to
    `timeout` seconds; StoreConnectionError (or a handshake's StoreError) within `connect_timeout`."""
    address = f"{host}:{port}"
    deadline = time.monotonic() + connect_timeout
    backoff = 0.01
    attempts = 0
    while True:
        attempts += 1
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=max(remaining, 0.001))
        except socket.gaierror as e:
            raise StoreConnectionError(f"cannot resolve the store host {host!r} ({address}): {e}") from e
        except OSError as e:
            retry = isinstance(e, builtins.TimeoutError) or (
                e.errno in _RETRY_ERRNOS and (retry_refused or e.errno not in _GONE_ERRNOS))
            remaining = deadline - time.monotonic()
            if not retry or remaining <= 0:
                raise StoreConnectionError(
                    f"cannot connect to the store server at {address} within "
                    f"{connect_timeout:g}s ({attempts} attempt(s)): {e}"
                ) from e
            time.sleep(min(backoff, remaining))
            backoff = min(backoff * 2, 1.0)
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _handshake(sock, address, deadline, connect_timeout)
            sock.settimeout(None)  # blocking: the kernel's timeouts bound each call
            set_socket_timeouts(sock, timeout)
        except BaseException:
            sock.close()
            raise
        return sock


def _handshake(sock: socket.socket, address: str, deadline: float, connect_timeout: float) -> None:
    nonce = (os.getpid() ^ int.from_bytes(os.urandom(4), "little")) & 0xFFFFFFFF
    hello = (bytes((wire.VALIDATE,)) + wire.U32.pack(wire.VALIDATION_MAGIC) + bytes((wire.PING,))
             + wire.U32.pack(nonce))
    reply = b""
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(hello)
        while len(reply) < 4:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = sock.recv(4 - len(reply))
            if not chunk:
                raise StoreHandshakeClosedError("connection closed by the peer")
            reply += chunk
    except (StoreHandshakeClosedError, ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as e:
        raise StoreHandshakeClosedError(
            f"the store server at {address} closed the connection in the handshake: {e} "
            "(it is going away, or what listens there is not a torch TCPStore server)"
        ) from e
    except OSError as e:
        raise StoreConnectionError(
            f"the store server at {address} did not complete the handshake within "
            f"{connect_timeout:g}s: {e} (is a torch TCPStore server listening there?)"
        ) from e
    echoed = wire.U32.unpack(reply)[0]
    if echoed != nonce:
        raise StoreProtocolError(
            f"{address} answered the handshake with {echoed:#x} instead of {nonce:#x}: not a torch TCPStore server?"
        )


def set_socket_timeouts(sock: socket.socket, seconds: float) -> None:
    """``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` of `seconds` (at least 1 ms: a zero timeval means "no
    timeout" to the kernel, never sent)."""
    seconds = max(seconds, 0.001)
    whole = int(seconds)
    timeval = struct.pack("@ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
