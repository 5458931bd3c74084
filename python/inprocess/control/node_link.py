"""A rank's side of its node agent: where the rank sits on its node, the
agent's socket name, and the link through which the rank reads and writes the
node's board (:class:`inprocess._native.NodeBoard`).

The agent's side (the process, its relay threads) is
:mod:`inprocess.processes.node_agent`. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Any, Protocol

from .. import _native
from .incarnation import job_incarnation
from .slurm_layout import slurm_layout

log = logging.getLogger("inprocess.processes.node_agent")

# The first bytes the agent sends on a new connection, with the board's descriptor.
HELLO = b"inprocess-node-board 1\n"


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Where this rank sits on its node, from the launcher's environment."""

    node: str  # names the node among the job's nodes
    local_rank: int
    local_world_size: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> NodeLayout | None:
        """torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK, or a SLURM task's
        (:func:`inprocess.control.slurm_layout.slurm_layout`); None without them."""
        env = dict(os.environ) if env is None else env
        local, size = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
        if local in env and size in env:
            try:
                local_rank, local_world_size = int(env[local]), int(env[size])
            except ValueError:
                raise ValueError(f"{local}={env[local]!r}, {size}={env[size]!r}: expected integers") from None
            if not 0 <= local_rank < local_world_size:
                raise ValueError(f"{local}={local_rank} is not in [0, {size}={local_world_size})")
            return cls(env.get("GROUP_RANK", socket.gethostname()), local_rank, local_world_size)
        slurm = slurm_layout(env)
        return None if slurm is None else cls(*slurm)


def socket_name(store_host: str, store_port: int, call: int, node: str, env: dict[str, str] | None = None) -> bytes:
    """Abstract Unix socket name of a node's agent: unique per job incarnation, call and node.

    torchrun restarts its workers with the same store address and call index,
    and an agent of the previous workers may still be winding down: the name
    holds the job's incarnation. The agent inherits its spawner's environment,
    so both sides name the same socket.
    """
    incarnation = job_incarnation(env)
    return f"\0inprocess-node/{store_host}:{store_port}/{incarnation}/{call}/{node}".encode()


# What a wait on the board returns besides an answer (see _native.NodeBoard).
BOARD_TIMEOUT = -1
BOARD_CLOSED = -2
BOARD_NEWS = 1  # NodeBoardLink.wait_news: a later decision or event is posted
# What NodeBoardLink.wait_outcome answers.
OUTCOME_LEAD = 1  # this rank leads the barrier
OUTCOME_DECIDED = 2  # the barrier's decision is posted (or too large for the board: read it from the store)
OUTCOME_REFUSED = 3  # the agent found this rank's seat taken: the rank looks at its seat itself
# How often a wait on a node board looks whether the node agent is still there.
NODE_POLL_S = 0.5


class NodeBoardLink(Protocol):
    """What the restart protocol needs of a rank's link to its node agent.

    The board's operations for this rank's slot, and whether the agent is
    still there. :class:`NodeLink` is the real one; a test or the simulator
    may link a rank to a board of its own.
    """

    @property
    def slot(self) -> int:
        """This rank's slot on the board (its local rank)."""

    def alive(self) -> bool:
        """False for good once the agent exited or closed the board."""

    def post_arrival(self, barrier: int, expected: int, initial_rank: int, life: int) -> None:
        """This rank arrived (healthy) at ``barrier``, which counts ``expected`` ranks: the agent takes the
        seat of ``initial_rank`` (in the seat's life ``life``) and forwards the arrival."""

    def wait_event(self, iteration: int, timeout_s: float) -> int:
        """0 restart, 1 complete, BOARD_TIMEOUT or BOARD_CLOSED."""

    def wait_outcome(self, barrier: int, timeout_s: float) -> int:
        """OUTCOME_LEAD, OUTCOME_DECIDED, OUTCOME_REFUSED, BOARD_TIMEOUT or BOARD_CLOSED."""

    def read_decision(self) -> tuple[int, bytes | None] | None:
        """(barrier, decision bytes) as posted last; the bytes are None when too large for the board."""

    def forwarded(self) -> int:
        """The last barrier the agent counted this rank at, -1 if none."""

    def posted(self) -> int:
        """The barrier of the latest arrival in this rank's slot (by whichever process of the slot), -1 if none."""

    def event(self) -> int:
        """The board's event word: -1, else 2 * iteration + (1 if it completed)."""

    def wait_news(self, decision_after: int, event_after: int, timeout_s: float) -> int:
        """BOARD_NEWS once a decision after barrier ``decision_after`` or an event word above
        ``event_after`` is posted; BOARD_TIMEOUT or BOARD_CLOSED."""

    def leads(self) -> int:
        """The last barrier this rank was named to lead, -1 if none."""


class NodeLink:
    """A rank's connection to its node agent: the board, its slot, the agent's liveness.

    ``sock`` is the connection the agent counts the node's ranks by; ``pidfd``
    (of the agent) tells this rank when the agent is gone, also when it could
    not close the board (SIGKILL). The simulator links its ranks to boards of
    its own, without either.
    """

    def __init__(self, board: Any, slot: int, sock: socket.socket | None = None, pidfd: int = -1):
        if not 0 <= slot < board.slots:
            raise ValueError(f"local rank {slot} is not in [0, {board.slots}) (the node board's slots)")
        self.board = board
        self.slot = slot
        self._sock = sock
        self._pidfd = pidfd
        self._lost = False

    @classmethod
    def connect(cls, name: bytes, slot: int, timeout: float, *, absent_s: float | None = None) -> NodeLink:
        """Connect to the agent (retrying until it listens) and map its board.

        ``absent_s``: stop retrying refused connections after this long (no
        agent listens, and none is expected to start); an agent that accepted
        still has ``timeout`` to send its board.
        """
        start = time.monotonic()
        deadline = start + timeout
        refusals_end = deadline if absent_s is None else min(deadline, start + absent_s)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.connect(name)
                msg, fds, _flags, _addr = socket.recv_fds(sock, len(HELLO), 1)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if time.monotonic() > refusals_end:
                    raise TimeoutError(
                        f"no node agent listening on {name[1:].decode()!r} within "
                        f"{refusals_end - start:.3g}s"
                    ) from None
                time.sleep(0.02)
            except BaseException:
                sock.close()
                raise
        try:
            if msg != HELLO or len(fds) != 1:
                raise RuntimeError(f"node agent {name[1:].decode()!r} sent {msg!r} with {len(fds)} descriptors")
            board = _native.NodeBoard.attach(fds[0])
        except BaseException:
            for fd in fds:
                os.close(fd)
            sock.close()
            raise
        os.close(fds[0])  # attach keeps a duplicate
        try:
            return cls(board, slot, sock, _native.pidfd_open(board.agent_pid))
        except BaseException:
            sock.close()
            raise

    def alive(self) -> bool:
        """False for good once the agent exited or closed the board."""
        if self._lost:
            return False
        if self.board.closed or (self._pidfd >= 0 and _native.wait_for_exit(self._pidfd, 0)):
            self._lost = True
            log.warning("node agent (pid %d) is gone: this rank talks to the store directly", self.board.agent_pid)
        return not self._lost

    # -- the board, for this rank's slot (NodeBoardLink) -------------------------

    def post_arrival(self, barrier: int, expected: int, initial_rank: int, life: int) -> None:
        self.board.arrive(self.slot, barrier, expected, initial_rank, life)

    def wait_event(self, iteration: int, timeout_s: float) -> int:
        return int(self.board.wait_event(iteration, timeout_s))

    def wait_outcome(self, barrier: int, timeout_s: float) -> int:
        return int(self.board.wait_outcome(self.slot, barrier, timeout_s))

    def read_decision(self) -> tuple[int, bytes | None] | None:
        posted = self.board.read_decision()
        return None if posted is None else (int(posted[0]), posted[1])

    def forwarded(self) -> int:
        return int(self.board.forwarded(self.slot))

    def posted(self) -> int:
        arrival = self.board.slot_arrival(self.slot)
        return -1 if arrival is None else int(arrival[0])

    def event(self) -> int:
        return int(self.board.event())

    def wait_news(self, decision_after: int, event_after: int, timeout_s: float) -> int:
        return int(self.board.wait_news(decision_after, event_after, timeout_s))

    def leads(self) -> int:
        return int(self.board.leads(self.slot))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
