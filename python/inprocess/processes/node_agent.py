"""The node agent: one process per node that talks to the store for the node's ranks.

At 16,384 ranks one TCPStore serves every rank, and during a restart every
rank needs the same few answers from it: the restart happened, the barrier's
count, the new decision. The server's cost is per reply, so the number of
clients is what matters. With a node agent, the ranks of a node meet on a
shared-memory board (:class:`inprocess._native.NodeBoard`) and one process
per node carries the traffic:

* the **broadcast** thread waits, with one blocking ``get`` each, for the
  decision of barrier b and then for the event of iteration b, and posts both
  on the board, where the ranks' waits (futexes, no GIL held) see them (a
  barrier whose leader was lost posts its lost mark first, which sends the
  node's ranks to the store to take the lead over);
* the **forward** thread turns the arrivals that ranks post on the board into
  one ``add`` per batch (usually one per node and barrier), names the batch's
  lowest slot the leader when the batch holds the barrier's first healthy
  arrivals, and sets ``ready`` when its ``add`` completes the count.

Before its ``add`` the forward thread takes the batch's seats (exactly-once
counting against the ranks' monitors, which arrive directly): one
``compare_set`` of the node's seat key (:mod:`inprocess.control.seat_table`;
the agent proposes its node's ranks as the call's seats per key). A seat found
taken is refused on the board, and its rank looks at it itself; terminated
arrivals never go through the agent.

The board is a memfd. The agent hands it to the ranks over an abstract Unix
socket (no file in the filesystem, nothing left behind) named after the store
address, the call and the node; a rank keeps that connection open while the
call runs, and the agent exits once every rank has closed it. A rank that sees
the agent gone (its pid) goes on with the direct protocol: the store counts
direct and forwarded arrivals alike.

This module imports no torch: the agent is a small process (like a monitor).
Run as ``python -m inprocess.processes.node_agent`` or ``inprocess-node-agent``,
with the options of :class:`inprocess.processes.contract.NodeAgentConfig` (the
node's local rank 0 starts it with
:meth:`~inprocess.processes.contract.HelperProcess.start`). Exit codes: 0 every
rank left (or none came), or told to stop; 1 its socket's name is taken; 2 bad
arguments; 4 internal error.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .. import _native
from ..control.node_link import HELLO, socket_name
from ..control.protocol import RestartProtocol
from ..control.seat_table import MAX_PER_KEY
from .contract import EXIT_OK, NodeAgentConfig, StopRequest, run_helper
from .native_relay import NativeNodeRelay
from .node_relay import DECISION_CAPACITY, NodeRelay

__all__ = ["DECISION_CAPACITY", "NodeAgent", "NodeRelay", "main", "serve"]

log = logging.getLogger("inprocess.processes.node_agent")

EXIT_NO_SOCKET = 1


# -- the process ---------------------------------------------------------------------


class NodeAgent:
    """The agent process: the board, the socket that hands it out, two relay threads."""

    def __init__(self, args: NodeAgentConfig, stop: StopRequest):
        self.args = args
        self.board = _native.NodeBoard.create(args.slots, DECISION_CAPACITY)
        # The relay's steps in C++, over connections of its own (_protocol): ~2.3x less CPU
        # per node and restart than NodeRelay (benchmarks/node_relay_cpu.py).
        self.relay: Any = NativeNodeRelay(self.board)
        self.stop = stop  # set by SIGTERM/SIGINT/SIGHUP, or when a relay thread fails
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)

    def _protocol(self) -> RestartProtocol:
        # Started by a rank that reached the server: a refusal means the server is gone.
        # A StoreConnection speaks TCPStoreClient's wire, and the native relay runs over it.
        client = _native.StoreConnection(self.args.store_host, self.args.store_port, timeout=self.args.store_timeout_s,
                                         connect_timeout=self.args.store_timeout_s, retry_refused=False)
        return RestartProtocol(client, self.args.call, incarnation=self.args.incarnation,
                               seats_per_key=min(self.args.slots, MAX_PER_KEY))

    def _forward_loop(self) -> None:
        p = self._protocol()
        seen = self.board.arrival_seq()
        while not self.stop.is_set():
            self.relay.forward(p)
            seq = self.board.wait_arrivals(seen, 1.0)
            if seq == -2:  # closed: the last rank left
                break
            if seq >= 0:
                seen = seq
        self.relay.forward(p)  # what arrived before the last rank left

    def _broadcast_loop(self) -> None:
        p = self._protocol()
        barrier = 0
        while self.relay.relay_decision(p, barrier, self.stop.is_set) and self.relay.relay_event(
            p, barrier, self.stop.is_set
        ):
            barrier += 1

    def _run_thread(self, name: str, target: Callable[[], None]) -> threading.Thread:
        def body() -> None:
            try:
                target()
            except Exception as e:
                if not self.stop.is_set():
                    # The ranks see the agent gone and go on without it.
                    log.error("node agent %s: %s stopped: %s: %s", self.args.node, name, type(e).__name__, e)
                    self.stop.set()

        thread = threading.Thread(target=body, name=f"inprocess-node-{name}", daemon=True)
        thread.start()
        return thread

    def serve(self) -> int:
        args = self.args
        try:
            self.listener.bind(socket_name(args.store_host, args.store_port, args.call, args.node))
        except OSError as e:
            log.error("node agent %s: cannot bind its socket: %s", args.node, e)
            return EXIT_NO_SOCKET
        self.listener.listen(max(16, args.slots * 2))
        self.listener.setblocking(False)
        forward = self._run_thread("forward", self._forward_loop)
        self._run_thread("broadcast", self._broadcast_loop)
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        clients = 0
        served = 0
        deadline = time.monotonic() + args.connect_timeout_s  # for the first rank
        while not self.stop.is_set():
            if clients == 0 and (served > 0 or time.monotonic() > deadline):
                break  # every rank of the node has left (or none ever came)
            for key, _ in sel.select(timeout=0.5):
                if key.fileobj is self.listener:
                    try:
                        conn, _ = self.listener.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(True)
                    try:
                        socket.send_fds(conn, [HELLO], [self.board.fd])
                    except OSError:
                        conn.close()
                        continue
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                    clients += 1
                    served += 1
                else:
                    conn = key.fileobj  # type: ignore[assignment]
                    try:
                        data = conn.recv(64)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(conn)
                        conn.close()
                        clients -= 1
        self.stop.set()
        self.board.close()  # wakes every wait on the board: the ranks go on without it
        # The forward thread wakes on the close and forwards what is left; the
        # broadcast thread may be blocked on the store: the process leaves it.
        forward.join(timeout=2.0)
        sel.close()
        self.listener.close()
        return EXIT_OK


def serve(config: NodeAgentConfig, stop: StopRequest) -> int:
    return NodeAgent(config, stop).serve()


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``inprocess-node-agent`` and ``python -m inprocess.processes.node_agent``."""
    run_helper(NodeAgentConfig, serve, argv)


if __name__ == "__main__":
    main()
