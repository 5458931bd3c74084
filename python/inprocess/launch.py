"""Starts N ranks of a script on 127.0.0.1 and reaps them on every path.

For the test suite, the demo and the benchmarks on one machine; real jobs are
launched by torchrun or SLURM.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class RankProcess:
    rank: int
    popen: subprocess.Popen  # type: ignore[type-arg]
    returncode: Optional[int] = None
    output: str = ""


class LocalJob:
    """A group of rank processes; a context manager that always reaps them."""

    def __init__(
        self,
        argv: Sequence[str],
        world_size: int,
        env: Optional[dict[str, str]] = None,
        port: Optional[int] = None,
        capture: bool = True,
        ranks_per_node: Optional[int] = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: expected >= 1")
        if ranks_per_node is not None and not 1 <= ranks_per_node <= world_size:
            raise ValueError(f"ranks_per_node={ranks_per_node}: expected 1..world_size={world_size}")
        # Consecutive ranks form a node, as torchrun numbers them: LOCAL_RANK,
        # LOCAL_WORLD_SIZE and GROUP_RANK say where each sits. Default: one node.
        self.ranks_per_node = ranks_per_node or world_size
        self.argv = list(argv)
        self.world_size = world_size
        self.port = port or free_port()
        self.env = dict(env or {})
        self.capture = capture
        self.ranks: list[RankProcess] = []

    def __enter__(self) -> "LocalJob":
        try:
            for rank in range(self.world_size):
                env = dict(os.environ)
                env.update(self.env)
                env.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(self.world_size),
                    LOCAL_RANK=str(rank % self.ranks_per_node),
                    LOCAL_WORLD_SIZE=str(min(self.ranks_per_node, self.world_size - rank // self.ranks_per_node * self.ranks_per_node)),
                    GROUP_RANK=str(rank // self.ranks_per_node),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(self.port),
                    PYTHONUNBUFFERED="1",
                )
                out = subprocess.PIPE if self.capture else None
                popen = subprocess.Popen(
                    [sys.executable, *self.argv],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT if self.capture else None,
                    text=True,
                    start_new_session=True,  # one process group per rank: killpg reaps its children too
                )
                self.ranks.append(RankProcess(rank, popen))
        except BaseException:
            self.kill()
            raise
        return self

    def wait(self, timeout: float) -> list[RankProcess]:
        """Wait for every rank; on timeout kill them all and raise TimeoutError."""
        deadline = time.monotonic() + timeout
        try:
            for rp in self.ranks:
                remaining = max(0.0, deadline - time.monotonic())
                out, _ = rp.popen.communicate(timeout=remaining)
                rp.output = out or ""
                rp.returncode = rp.popen.returncode
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"job did not finish within {timeout:g}s:\n{self.outputs()}") from None
        return self.ranks

    def outputs(self) -> str:
        return "\n".join(f"--- rank {rp.rank} (rc={rp.returncode})\n{rp.output}" for rp in self.ranks)

    def kill(self) -> None:
        for rp in self.ranks:
            if rp.popen.poll() is None:
                try:
                    os.killpg(rp.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for rp in self.ranks:
            try:
                out, _ = rp.popen.communicate(timeout=10)
                rp.output = rp.output or (out or "")
            except (subprocess.TimeoutExpired, ValueError):
                pass
            rp.returncode = rp.popen.returncode
            # The process group may hold grandchildren (e.g. a monitor): reap them too.
            try:
                os.killpg(rp.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def __exit__(self, *exc: object) -> None:
        self.kill()
