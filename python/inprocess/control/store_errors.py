"""The errors of a store connection, one definition for both clients of the TCPStore wire: the
Python :class:`~inprocess.control.tcpstore_client.TCPStoreClient` and the native
:class:`inprocess._native.StoreConnection`, to which :mod:`inprocess.control` hands them down
once (the native module defines no Python class of its own and names no module of the
package). Like the client and its wire module, this file imports nothing of the package: the
three stand alone."""

from __future__ import annotations

import builtins


class StoreError(Exception):
    """Base class of the errors of :class:`TCPStoreClient`."""


class StoreTimeoutError(StoreError, builtins.TimeoutError):
    """A wait (or a reply) did not come within its timeout."""


class StoreConnectionError(StoreError, ConnectionError):
    """The connection to the store server could not be opened, was lost or was closed."""


class StoreHandshakeClosedError(StoreConnectionError):
    """The server closed or reset the connection before it answered the handshake:
    what a server that is going away does (not a silent listener: that times out)."""


class StoreProtocolError(StoreError):
    """The peer answered something torch's TCPStore server never sends."""
