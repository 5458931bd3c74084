"""The store as the simulated ranks see it: one client process's connections,
and the store of one simulated rank over them, with its bytes on the wire.

Requests are counted by the library itself (each simulated rank's
:class:`~inprocess.control.protocol.RestartProtocol` counts its calls and
their wire requests in its :class:`~inprocess.control.store_ops.CountingStore`);
what is added here is a byte estimate from the torch TCPStore wire format:
1 byte query type, strings and values sent as an 8-byte length plus the bytes
(keys with the client's "/" prefix), 8-byte integers, 1-byte wait/check
answers; a ``get`` (and a ``multi_get``) is a WAIT then a GET on the wire;
``set`` and ``append`` have no answer. TCP/IP headers are not counted.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
from typing import Any, Protocol

from .config import HOST


def as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def key_bytes(key: str) -> int:
    """A key on the wire: its length, the client's "/" prefix, the key."""
    return 8 + 1 + len(key.encode())


class Tally:
    """The bytes one simulated rank (or node relay, or fault reporter) sent and received."""

    __slots__ = ("out", "inb", "decision")

    def __init__(self) -> None:
        self.out = 0  # bytes sent
        self.inb = 0  # bytes received
        self.decision = ""  # digest of the decision bytes this rank published or read

    def snapshot(self) -> tuple[int, int]:
        return self.out, self.inb


class Connections:
    """The TCPStore client connections of one client process.

    Two per group (non-blocking operations; blocking waits and gets) and the
    group's node agents' own (``relay_forward`` and ``relay_broadcast``, the
    :class:`inprocess._native.StoreConnection` a real agent's native relay
    runs over; with the Python relay, ``pipes``: the forward side's
    torch-free client, for its pipelined seats), one for the barrier's leader
    once it blocks (see ``Group.hand_over``), one for the simulated joiners
    (``--joiners``, :mod:`.joins`) and one for control (fault injection, end
    of job).
    """

    def __init__(self, port: int, groups: int, timeout_s: float, relay: str = "native"):
        import torch.distributed as dist

        from inprocess import _native
        from inprocess.control.host_names import numeric_host_names
        from inprocess.control.tcpstore_client import TCPStoreClient

        numeric_host_names()  # as a rank's: torch names each connection without asking the resolver
        td = datetime.timedelta(seconds=timeout_s)

        def connect(_: int) -> Any:
            return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False, use_libuv=True, timeout=td)

        # Connect a few at a time: a connect may wait on the resolver (see harness.CHILD_ENV).
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            made = list(pool.map(connect, range(2 * groups + 3)))
        self.pipes: list[Any] = []
        self.relay_forward: list[Any] = []
        self.relay_broadcast: list[Any] = []
        if relay == "native":
            # Per group: the two connections of a real agent (forward; broadcast, which blocks).
            def native(_: int) -> Any:
                return _native.StoreConnection(HOST, port, timeout=timeout_s, connect_timeout=timeout_s)

            self.relay_forward = [native(g) for g in range(groups)]
            self.relay_broadcast = [native(g) for g in range(groups)]
        else:
            # Per group: the Python relay's forward side, the library's torch-free client, which
            # sends the node's seats pipelined (compare_set_many); its gets and adds go to the
            # group's torch connections.
            self.pipes = [TCPStoreClient(HOST, port, timeout=td, connect_timeout=td) for _ in range(groups)]
        self.ops = made[0:2 * groups:2]  # per group: non-blocking operations
        self.waits = made[1:2 * groups:2]  # per group: blocking waits and gets
        self.join = made[-3]  # the simulated joiners of this process (--joiners)
        self.lead = made[-2]  # the leader of a barrier, once its group went on without it
        self.control = made[-1]  # the client's command loop (fault injection, end of job)
        self.count = len(made) + len(self.pipes) + len(self.relay_forward) + len(self.relay_broadcast)


class Deferred(BaseException):
    """Raised by a rank's wait for the decision while its group is still arriving.

    A BaseException: the protocol's waits let it through untouched, and
    ``barrier`` has nothing to unwind. The group then finishes the rank with
    ``wait_decision``, which is what ``barrier`` returns for a non-leader.
    Nothing was sent, but the rank's CountingStore counted the get: see
    ``SimRank.unsent_get``.
    """


class Turns(Protocol):
    """How a group of simulated ranks takes turns on its connections (ranks.Group, nodes.NodeGroup)."""

    def arriving(self) -> bool:
        """This thread is making the group's ranks arrive at a barrier."""

    def leading(self) -> bool:
        """This thread stays with the barrier's leader, on the leader connection."""

    def hand_over(self) -> None:
        """The leader blocks here: a new thread goes on with the rest of the group."""

    def lead_connection(self) -> Any:
        """The process's connection for a leader that blocked."""


# Keys whose value the protocol waits for with a blocking get.
_BLOCKING_GETS = ("/event", "/decision")


class SharedStore:
    """One simulated rank's store (main or trigger side) over its group's connections.

    Has the torch Store methods the protocol uses, tallies bytes. Non-blocking
    calls go to the group's operations connection, blocking ones (``wait``,
    the ``get`` of the event and of the decision) to its waits connection; a
    leader that blocked uses the process's leader connection for everything,
    so that its group never queues behind it (torch's client runs one call at
    a time per connection).
    """

    def __init__(self, op_conn: Any, wait_conn: Any, tally: Tally, group: Turns | None,
                 cap_s: float | None = None, pipe: Any = None):
        self._op = op_conn
        self._pipe = pipe  # a node agent's forward connection (TCPStoreClient): its pipelined seats
        self._wait_conn = wait_conn
        self._t = tally
        self._group = group
        self._timeout = op_conn.timeout  # what set_timeout gave; applied to the connection of each get
        # A node relay's blocking gets have no deadline (WAIT_CHUNK_S chunks);
        # capped here so that a stalled simulation fails within the job's timeout.
        self._cap = None if cap_s is None else datetime.timedelta(seconds=cap_s)

    def _conns(self) -> tuple[Any, Any]:
        g = self._group
        if g is not None and g.leading():
            lead = g.lead_connection()
            return lead, lead
        return self._op, self._wait_conn

    def _saw(self, key: str, raw: bytes) -> None:
        if key.endswith("/decision"):
            self._t.decision = hashlib.sha1(raw).hexdigest()[:16]

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    # The server's address, as torch's TCPStore has them: the admission of joiners opens a connection of
    # its own there for its pipelined compare_sets (CountingStore.open_pipe), as a real leader does; its
    # bytes are not tallied here.
    @property
    def host(self) -> str:
        return str(self._op.host)

    @property
    def port(self) -> int:
        return int(self._op.port)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout if self._cap is None else min(timeout, self._cap)  # client-side: no request

    def set(self, key: str, value: Any) -> None:
        v = as_bytes(value)
        self._t.out += 1 + key_bytes(key) + 8 + len(v)
        self._conns()[0].set(key, v)
        self._saw(key, v)

    def get(self, key: str) -> bytes:
        op, wait = self._conns()
        conn = op
        if key.endswith(_BLOCKING_GETS):
            g = self._group
            if g is not None and g.arriving() and key.endswith("/decision"):
                raise Deferred()  # nothing was sent: the group sends this get once it has arrived
            conn = wait
        conn.set_timeout(self._timeout)
        raw = conn.get(key)
        t = self._t
        t.out += (1 + 8 + key_bytes(key)) + (1 + key_bytes(key))  # WAIT (answered once the key exists) + GET
        t.inb += 1 + 8 + len(raw)
        self._saw(key, raw)
        return raw

    def add(self, key: str, amount: int) -> int:
        t = self._t
        t.out += 1 + key_bytes(key) + 8
        t.inb += 8
        return self._conns()[0].add(key, amount)

    def append(self, key: str, value: Any) -> None:
        v = as_bytes(value)
        self._t.out += 1 + key_bytes(key) + 8 + len(v)
        self._conns()[0].append(key, v)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        e, d = as_bytes(expected), as_bytes(desired)
        out = self._conns()[0].compare_set(key, e, d)
        t = self._t
        t.out += 1 + key_bytes(key) + 8 + len(e) + 8 + len(d)
        t.inb += 8 + len(out)
        if out == d:  # the leader published the decision (compare_set: the first writer wins)
            self._saw(key, out)
        return out

    def compare_set_many(self, items: list[tuple[str, Any, Any]]) -> list[bytes]:
        """A node agent's seats, pipelined on its forward connection (the real agent's client)."""
        if self._pipe is None:
            raise AttributeError("compare_set_many: this simulated store has no pipelined connection")
        out = self._pipe.compare_set_many(items)
        t = self._t
        # Seat keys and values are ASCII: their lengths are their bytes (this runs once per simulated rank).
        t.out += sum(1 + 8 + 1 + len(key) + 8 + len(e) + 8 + len(d) for key, e, d in items)
        t.inb += sum(8 + len(v) for v in out)
        return list(out)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raw = [bytes(v) for v in self._conns()[0].multi_get(keys)]
        t = self._t
        t.out += 2 * (1 + 8 + sum(key_bytes(k) for k in keys))  # WAIT (the keys exist), then MULTI_GET
        t.inb += 1 + sum(8 + len(v) for v in raw)
        return raw

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        vs = [as_bytes(v) for v in values]
        self._t.out += 1 + 8 + sum(key_bytes(k) + 8 + len(v) for k, v in zip(keys, vs, strict=True))
        self._conns()[0].multi_set(keys, vs)

    def check(self, keys: list[str]) -> bool:
        t = self._t
        t.out += 1 + 8 + sum(key_bytes(k) for k in keys)
        t.inb += 1
        return self._conns()[0].check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        g = self._group
        if g is not None and g.arriving():
            g.hand_over()  # the leader blocks here (for "ready"): a new thread goes on with the group
        t = self._t
        t.out += 1 + 8 + sum(key_bytes(k) for k in keys)
        t.inb += 1
        self._conns()[1].wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        t = self._t
        t.out += 1 + key_bytes(key)
        t.inb += 8
        return self._conns()[0].delete_key(key)
