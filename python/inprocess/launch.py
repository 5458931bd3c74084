"""Starts N ranks of a script on 127.0.0.1 and reaps them on every path.

``python -m inprocess.launch --nproc 4 train.py [args...]`` runs a job on this
machine, for trying the library, its demo, its tests and benchmarks; real jobs
are launched by torchrun or SLURM. Each rank gets the variables torchrun's
agent gives its workers (torch/distributed/elastic/agent/server/
local_elastic_agent.py, ``_start_workers``), numbered as torchrun numbers them
(``--ranks-per-node`` fakes several nodes), and OMP_NUM_THREADS=1 when several
ranks run and the variable is unset (torch/distributed/run.py). Unlike
torchrun, it leaves the other ranks running when one exits or dies: that is
the case the in-process restart handles. It waits for every rank, kills them
all (their process groups: monitors included) on Ctrl-C, SIGTERM or
``--timeout``, and ends with one summary line. Its exit status is 0 when the
job finished: every rank returned 0 or was excluded by a restart that the
others recovered from (the ranks' events say which); else, and always with
``--strict``, the first non-zero status in rank order (128 + the signal for a
killed rank).

``--respawn N`` replaces a rank's process that must be replaced (killed by a
signal, or exited with 75 or 76: :func:`replacement_reason`) while the job
runs: the same seat's environment plus ``INPROCESS_JOIN=1`` and
``INPROCESS_RESPAWN_COUNT=k``, at most N times per rank, after a back-off
(``--respawn-backoff``, doubled per respawn of the rank). The new process joins
the running job; the summary counts seats and respawns (:class:`Supervisor`,
:func:`summarize`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .respawn import (
    REPLACE_ME_STATUSES,
    RESPAWN_BACKOFF_CAP_S,
    RESPAWN_COUNT_VAR,
    RankSeat,
    RespawnPolicy,
    Supervisor,
    describe_status,
    exit_status_unreaped,
    replacement_reason,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["REPLACE_ME_STATUSES", "RESPAWN_BACKOFF_CAP_S", "LocalJob", "RankProcess", "RespawnPolicy", "Supervisor",
           "exit_status_unreaped", "free_port", "main", "replacement_reason"]

# torchrun's --role default: every rank has the one role.
ROLE_NAME = "default"

# What torchrun prints when it sets OMP_NUM_THREADS (torch/distributed/run.py), word for word.
OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be "
    "1 in default, to avoid your system being overloaded, "
    "please further tune the variable for optimal performance in "
    "your application as needed. \n"
    "*****************************************"
)
EVENTS_VAR = "INPROCESS_EVENTS_DIR"  # inprocess/events.py: where each rank appends its events
# Set on a respawned process only: "1", this process joins a job that is running (the join protocol reads
# it), and the how-manyth replacement of its seat it is (1, 2, ...).
JOIN_VAR = "INPROCESS_JOIN"


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
    returncode: int | None = None
    output: str = ""
    # While LocalJob.wait runs: the thread that reads this process's output as it comes (a pipe read
    # only once the ranks before it exited fills, 64 KiB, and the rank then blocks in its next write,
    # at any point of the protocol: issue 31's storm without the brake "hung" so, at a barrier).
    reader: threading.Thread | None = None

    def read_output(self) -> None:
        """Until the process and what holds its pipe exited (a reader thread's body)."""
        out, _ = self.popen.communicate()
        self.output = out or ""


class LocalJob:
    """A group of rank processes; a context manager that always reaps them."""

    def __init__(
        self,
        argv: Sequence[str],
        world_size: int,
        env: dict[str, str] | None = None,
        port: int | None = None,
        capture: bool = True,
        ranks_per_node: int | None = None,
        python: str | None = None,
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
        self.nodes = math.ceil(world_size / self.ranks_per_node)
        # As torchrun: several processes and no OMP_NUM_THREADS of the user's -> 1 thread each. torchrun
        # counts the processes of one node; every fake node here shares this machine, so all of them count.
        self.sets_omp_num_threads = world_size > 1 and "OMP_NUM_THREADS" not in {**os.environ, **self.env}
        self.ranks: list[RankProcess] = []  # the first process of each rank, in rank order
        self.respawned: list[RankProcess] = []  # the replacements (:meth:`respawn`), oldest first

    def __enter__(self) -> Self:
        try:
            for rank in range(self.world_size):
                self.ranks.append(self._start(rank, {}))
        except BaseException:
            self.kill()
            raise
        return self

    def rank_env(self, rank: int) -> dict[str, str]:
        """The environment rank ``rank``'s process starts with: the launcher's, the job's, torchrun's numbers."""
        env = dict(os.environ)
        env.update(self.env)
        env.update(
            RANK=str(rank),
            GROUP_RANK=str(rank // self.ranks_per_node),
            ROLE_RANK=str(rank),
            ROLE_NAME=ROLE_NAME,
            LOCAL_RANK=str(rank % self.ranks_per_node),
            LOCAL_WORLD_SIZE=str(self._local_world_size(rank)),
            WORLD_SIZE=str(self.world_size),
            GROUP_WORLD_SIZE=str(self.nodes),
            ROLE_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            PYTHONUNBUFFERED="1",
        )
        # torchrun sets 1, which tears a rank down on an NCCL error; an in-process restart needs 2
        # (abort the communicators, the failed work raises: README, "GPU"). A user's value is kept.
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if self.sets_omp_num_threads:
            env["OMP_NUM_THREADS"] = "1"
        return env

    def _start(self, rank: int, extra_env: dict[str, str]) -> RankProcess:
        out = subprocess.PIPE if self.capture else None
        popen = subprocess.Popen(
            [self.python, *self.argv],
            env={**self.rank_env(rank), **extra_env},
            stdout=out,
            stderr=subprocess.STDOUT if self.capture else None,
            text=True,
            start_new_session=True,  # one process group per rank: killpg reaps its children too
        )
        return RankProcess(rank, popen)

    def respawn(self, rank: int, count: int, extra_env: dict[str, str] | None = None) -> RankProcess:
        """Start the ``count``-th replacement of rank ``rank``'s process: the seat's environment, plus
        :data:`JOIN_VAR` (it joins a running job), :data:`RESPAWN_COUNT_VAR` and ``extra_env``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: expected 0..{self.world_size - 1}")
        if count < 1:
            raise ValueError(f"count={count!r}: expected the replacement's number, >= 1")
        rp = self._start(rank, {**(extra_env or {}), JOIN_VAR: "1", RESPAWN_COUNT_VAR: str(count)})
        self.respawned.append(rp)
        return rp

    def _local_world_size(self, rank: int) -> int:
        """Ranks on this rank's node: the last node may hold fewer."""
        first_on_node = rank // self.ranks_per_node * self.ranks_per_node
        return min(self.ranks_per_node, self.world_size - first_on_node)

    def wait(self, timeout: float | None) -> list[RankProcess]:
        """Wait for every rank (``timeout`` None: however long); on timeout kill them all and raise TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        readers = []
        for rp in self.ranks:  # every pipe read at once
            rp.reader = threading.Thread(target=rp.read_output, name=f"rank{rp.rank}-output", daemon=True)
            rp.reader.start()
            readers.append((rp, rp.reader))
        for rp, reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                self.kill()
                raise TimeoutError(f"job did not finish within {timeout:g}s:\n{self.outputs()}")
            rp.returncode = rp.popen.returncode
        return self.ranks

    def outputs(self) -> str:
        return "\n".join(f"--- rank {rp.rank} (rc={rp.returncode})\n{rp.output}" for rp in self.ranks)

    def kill(self) -> None:
        every = self.ranks + self.respawned
        for rp in every:
            if rp.popen.poll() is None:
                try:
                    os.killpg(rp.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for rp in every:
            if rp.reader is not None:  # LocalJob.wait's reader has the pipe: it ends with the process
                rp.reader.join(10)
            else:
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


def _exit_status(returncode: int | None) -> int:
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def elastic_env() -> dict[str, str]:
    """The job-wide variables of torchrun's elastic agent, as a first incarnation without restarts has them.

    Only the command sets them, not :class:`LocalJob`: the tests' and benchmarks' workers read
    TORCHELASTIC_RESTART_COUNT to tell a torchrun restart of their processes. The run id is new for every
    job, as torchrun's standalone one is; no agent hosts a store here (rank 0's process does).
    """
    return {
        "TORCHELASTIC_RUN_ID": str(uuid.uuid4()),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


@dataclasses.dataclass
class EventsSeen:
    """What the ranks' event files (inprocess/events.py) say about the job."""

    restarts: int  # restart decisions: distinct (call, iteration > 0) of the ``decision`` events
    excluded: set[int]  # initial ranks (seats) a restart's decision terminated and no later one admitted back


class EventsReader:
    """Reads the events the ranks append to a directory, from where the files ended when the job started."""

    def __init__(self, directory: str):
        self.directory = pathlib.Path(directory)
        self.start = {path.name: path.stat().st_size for path in self.directory.glob("rank*.jsonl")}

    def read(self) -> EventsSeen | None:
        """None when no rank wrote an event here (a program without the wrapper, or with its own events_dir)."""
        events: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob("rank*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.start.get(path.name, 0))
                for line in f:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue  # a line cut by a kill
                    if isinstance(event, dict):
                        events.append(event)
        if not events:
            return None
        restarts = {(e.get("call"), e.get("iteration")) for e in events
                    if e.get("kind") == "decision" and isinstance(e.get("iteration"), int) and e["iteration"] > 0}
        return EventsSeen(len(restarts), excluded_at_the_end(e for e in events if e.get("kind") == "decision"))


def excluded_at_the_end(decisions: Iterable[dict[str, Any]]) -> set[int]:
    """The seats whose last decision terminated them: a seat that a later decision gave to a process
    that joined it (a respawn) holds that process now, whose exit status is the seat's."""
    out: dict[int, int] = {}  # seat -> the last iteration whose decision terminated it
    back: dict[int, int] = {}  # seat -> the last iteration whose decision admitted a joiner into it
    for e in decisions:
        iteration = e["iteration"] if isinstance(e.get("iteration"), int) else -1
        for seat in e.get("terminated") or ():
            out[seat] = max(out.get(seat, -1), iteration)
        # joined_lives: every (seat, life) admitted ("joined" names at most 32 seats)
        for seat in [pair[0] for pair in e.get("joined_lives") or ()] + list(e.get("joined") or ()):
            back[seat] = max(back.get(seat, -1), iteration)
    return {seat for seat, iteration in out.items() if iteration > back.get(seat, -1)}


def summarize(returncodes: Sequence[int | None], seen: EventsSeen | None, strict: bool,
              seats: Sequence[RankSeat] | None = None) -> tuple[str, int]:
    """The summary line and the launcher's exit status.

    The job finished when every rank returned 0, or was excluded by a restart's decision while a rank
    that was not excluded returned 0: the others recovered from its fault and ended the job. Without
    events nothing tells a recovered fault, so any non-zero rank fails the job. A failed job (and any job,
    ``strict``) exits with the first non-zero status in rank order.

    With ``seats`` (``--respawn``), ``returncodes`` are each seat's last process's: a process that was
    replaced fails nothing by itself, its replacement's status counts. The line counts seats and
    respawns and names each replaced process ("(respawned)") and each seat left empty, and why; with
    ``strict`` the status is the first non-zero one of any process, seat by seat, oldest first.
    """
    statuses = [_exit_status(rc) for rc in returncodes]
    excluded = seen.excluded if seen is not None else set()
    finished = [r for r, status in enumerate(statuses) if status == 0]
    lost = [r for r, status in enumerate(statuses) if status != 0]
    recovered = bool(lost) and all(r in excluded for r in lost) and any(r not in excluded for r in finished)
    job_finished = not lost or recovered
    parts = [f"{len(finished)} of {len(statuses)} {'ranks' if seats is None else 'seats'} finished"]
    if seen is None:
        parts.append("restarts unknown (no rank wrote events)")
    else:
        parts.append(f"{seen.restarts} restart{'' if seen.restarts == 1 else 's'}")
    every_status = statuses
    if seats is not None:
        respawns = sum(seat.respawns for seat in seats)
        parts.append(f"{respawns} respawn{'' if respawns == 1 else 's'}")
        for seat in seats:
            parts.extend(f"rank {seat.rank} {describe_status(rp.returncode)} (respawned)" for rp in seat.lives[:-1])
        every_status = [_exit_status(rp.returncode) for seat in seats for rp in seat.lives]
    for r in lost:
        why = describe_status(returncodes[r])
        if seats is not None and seats[r].empty_because:
            why += f" ({seats[r].empty_because})"
        parts.append(f"rank {r} {why}" + (", excluded by a restart" if r in excluded else ""))
    status = next((s for s in (every_status if strict else statuses) if s), 0)
    if job_finished and not strict:
        status = 0
    verdict = "job finished" if job_finished else "job failed"
    return f"inprocess.launch: {verdict}: {'; '.join(parts)}; exit status {status}", status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inprocess.launch",
        description="Run N ranks of a Python script on 127.0.0.1 (for trying inprocess on one machine).",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of ranks (WORLD_SIZE)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="consecutive ranks per fake node (LOCAL_WORLD_SIZE); default: one node")
    parser.add_argument("--port", type=int, default=None, help="MASTER_PORT (default: a free port)")
    parser.add_argument("--timeout", type=float, default=None, help="kill every rank after this many seconds")
    parser.add_argument("--respawn", type=int, default=0, metavar="N",
                        help="replace a rank's process that was killed by a signal or exited with 75 or 76, at "
                             "most N times per rank, while the job runs; the new process gets "
                             f"{JOIN_VAR}=1 and {RESPAWN_COUNT_VAR}=<k> (default 0: never)")
    parser.add_argument("--respawn-backoff", type=float, default=1.0, metavar="SECONDS",
                        help="wait before a rank's first respawn, doubled for each next one of that rank, "
                             f"at most {RESPAWN_BACKOFF_CAP_S:g}s (default 1)")
    parser.add_argument("--strict", action="store_true",
                        help="exit with the first non-zero rank status even when the others recovered and finished")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"--nproc={ns.nproc}: expected a number of ranks >= 1")
    if ns.port is not None and not 0 < ns.port < 65536:
        parser.error(f"--port={ns.port}: expected a TCP port in 1..65535")
    if ns.timeout is not None and ns.timeout <= 0:
        parser.error(f"--timeout={ns.timeout}: expected a number of seconds > 0")
    if ns.respawn < 0:
        parser.error(f"--respawn={ns.respawn}: expected a number of respawns per rank >= 0")
    if not ns.respawn_backoff > 0 or math.isinf(ns.respawn_backoff):
        parser.error(f"--respawn-backoff={ns.respawn_backoff}: expected a number of seconds > 0")
    if not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r}: no such file")
    # The ranks' events tell a rank excluded by a recovered restart from a failed job: the user's
    # directory if set (read from where its files end now), else one of ours for this job.
    own_events = None if os.environ.get(EVENTS_VAR) else tempfile.mkdtemp(prefix="inprocess-launch-events-")
    events_dir = own_events or os.environ[EVENTS_VAR]
    try:
        return _run(parser, ns, events_dir)
    finally:
        if own_events is not None:
            shutil.rmtree(own_events, ignore_errors=True)


def _run(parser: argparse.ArgumentParser, ns: argparse.Namespace, events_dir: str) -> int:
    os.makedirs(events_dir, exist_ok=True)
    events = EventsReader(events_dir)
    try:
        job = LocalJob([ns.script, *ns.args], ns.nproc, port=ns.port, capture=False,
                       ranks_per_node=ns.ranks_per_node, env={**elastic_env(), EVENTS_VAR: events_dir})
    except ValueError as e:
        parser.error(str(e))
    if job.sets_omp_num_threads:
        print(OMP_WARNING, file=sys.stderr)

    supervisor = Supervisor(job, RespawnPolicy(ns.respawn, ns.respawn_backoff))

    def stop(signum: int, _frame: object) -> None:
        # Noted, not raised here: an exception between a respawn's fork and its bookkeeping would leak it.
        supervisor.stop_signal = signum

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with job:
            try:
                seats = supervisor.finish(ns.timeout, "inprocess.launch")
                if seats is None:
                    return 124
            except KeyboardInterrupt:
                print("inprocess.launch: interrupted; every rank was killed", file=sys.stderr)
                return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    line, status = summarize([seat.last.returncode for seat in seats], events.read(), ns.strict,
                             seats if ns.respawn > 0 else None)
    print(line, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
