"""Starts N ranks of a script on 127.0.0.1 and reaps them on every path.

``python -m inprocess.launch --nproc 4 train.py [args...]`` runs a job on this
machine, for trying the library, its demo, its tests and benchmarks; real jobs
are launched by torchrun or SLURM. Each rank gets RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT, and LOCAL_RANK, LOCAL_WORLD_SIZE and
GROUP_RANK as torchrun numbers them (``--ranks-per-node`` fakes several
nodes). Unlike torchrun, it leaves the other ranks running when one exits or
dies: that is the case the in-process restart handles. It waits for every
rank, kills them all (their process groups: monitors included) on Ctrl-C,
SIGTERM or ``--timeout``, and exits with 0 when every rank did, else with the
first non-zero status in rank order (128 + the signal for a killed rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (inclusive)."""
    try:
        low, high = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(count: int = 2) -> int:
    """A port P such that P .. P + count - 1 are free to listen on now.

    Chosen below the kernel's ephemeral range, as launchers' defaults are
    (torchrun's 29500): a port inside it can be taken at any moment as the
    local port of some outgoing connection on this machine, and a program that
    listens on MASTER_PORT + 1 only later (a store of its own, as NVRx's
    examples do) then fails with EADDRINUSE, for as long as that connection or
    its TIME_WAIT lasts (seen in about one run in 50 under load).
    """
    if count < 1:
        raise ValueError(f"count={count!r}: expected a positive int")
    low = ephemeral_port_range()[0]
    first, last = 10000, low - count  # the candidates for P
    if last <= first:
        first, last = 1024, 65535 - count  # no room below the range: anywhere
    chooser = random.Random()
    for _ in range(1000):
        port = chooser.randint(first, last)
        if all(_can_listen(port + i) for i in range(count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports found in {first}..{last + count - 1}")


def _can_listen(port: int) -> bool:
    # Any address and no SO_REUSEADDR: free for a listener on every address,
    # with no connection or TIME_WAIT holding it either.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@dataclasses.dataclass
class RankProcess:
    rank: int
    popen: subprocess.Popen[str]
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
        python: Optional[str] = None,
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
        # MASTER_PORT + 1 is free too: programs written as NVRx's examples host a store of their own there.
        self.port = port or free_port()
        self.env = dict(env or {})
        self.capture = capture
        self.python = python or sys.executable  # the interpreter every rank runs
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
                    LOCAL_WORLD_SIZE=str(self._local_world_size(rank)),
                    GROUP_RANK=str(rank // self.ranks_per_node),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(self.port),
                    PYTHONUNBUFFERED="1",
                )
                out = subprocess.PIPE if self.capture else None
                popen = subprocess.Popen(
                    [self.python, *self.argv],
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

    def _local_world_size(self, rank: int) -> int:
        """Ranks on this rank's node: the last node may hold fewer."""
        first_on_node = rank // self.ranks_per_node * self.ranks_per_node
        return min(self.ranks_per_node, self.world_size - first_on_node)

    def wait(self, timeout: Optional[float]) -> list[RankProcess]:
        """Wait for every rank (``timeout`` None: however long); on timeout kill them all and raise TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for rp in self.ranks:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
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


def _exit_status(returncode: Optional[int]) -> int:
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inprocess.launch",
        description="Run N ranks of a Python script on 127.0.0.1 (for trying inprocess on one machine).",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks (WORLD_SIZE)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="consecutive ranks per fake node (LOCAL_WORLD_SIZE); default: one node")
    parser.add_argument("--port", type=int, default=None, help="MASTER_PORT (default: a free port)")
    parser.add_argument("--timeout", type=float, default=None, help="kill every rank after this many seconds")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"--nproc={ns.nproc}: expected a number of ranks >= 1")
    if ns.port is not None and not 0 < ns.port < 65536:
        parser.error(f"--port={ns.port}: expected a TCP port in 1..65535")
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error(f"--timeout={ns.timeout}: expected a number of seconds > 0")
    if not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r}: no such file")
    try:
        job = LocalJob([ns.script, *ns.args], ns.nproc, port=ns.port, capture=False,
                       ranks_per_node=ns.ranks_per_node)
    except ValueError as e:
        parser.error(str(e))

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    with job:
        try:
            ranks = job.wait(ns.timeout)
        except TimeoutError:
            print(f"inprocess.launch: the job did not finish within {ns.timeout:g}s; every rank was killed",
                  file=sys.stderr)
            return 124
        except KeyboardInterrupt:
            print("inprocess.launch: interrupted; every rank was killed", file=sys.stderr)
            return 130
    statuses = [_exit_status(rp.returncode) for rp in ranks]
    for rp, status in zip(ranks, statuses, strict=True):
        if status:
            print(f"inprocess.launch: rank {rp.rank} exited with status {status}", file=sys.stderr)
    return next((s for s in statuses if s), 0)


if __name__ == "__main__":
    sys.exit(main())
