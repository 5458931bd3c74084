"""Replacing a rank's process while its job runs (``inprocess.launch --respawn N``): which deaths ask
for a new process (:func:`replacement_reason`), how many and how soon (:class:`RespawnPolicy`), and
the loop that waits for every seat and respawns it (:class:`Supervisor`). A new process joins the
running job (``INPROCESS_JOIN=1``). This module imports no torch: the launcher runs it."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Protocol

from .exits import EXIT_CODE_CONTEXT_LOST, EXIT_CODE_UNRELEASABLE

# The exit statuses with which a rank leaves so that its process is replaced (inprocess.exits).
REPLACE_ME_STATUSES = {
    EXIT_CODE_UNRELEASABLE: "the main thread could not be released after the abort",
    EXIT_CODE_CONTEXT_LOST: "the CUDA context is lost",
}
RESPAWN_BACKOFF_CAP_S = 30.0  # the longest wait between two respawns of one seat (unless the base is longer)
RESPAWN_COUNT_VAR = "INPROCESS_RESPAWN_COUNT"


class Process(Protocol):
    """One process of a rank, as the launcher holds it (:class:`inprocess.launch.RankProcess`)."""

    rank: int
    popen: subprocess.Popen[str]
    returncode: int | None


class Job(Protocol):
    """A running job, as the launcher holds it (:class:`inprocess.launch.LocalJob`)."""

    @property
    def ranks(self) -> Sequence[Process]: ...
    def respawn(self, rank: int, count: int) -> Process: ...


def say(line: str) -> None:
    print(f"inprocess.launch: {line}", file=sys.stderr, flush=True)


def describe_status(returncode: int | None) -> str:
    if returncode is None:
        return "did not exit"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def replacement_reason(returncode: int | None) -> str | None:
    """Why a rank's process that exited must be replaced, or None when it left the job on its own terms.

    A process killed by a signal is gone without having left (SIGKILL, a segfault, the OOM killer, the
    monitor's hard timeout); 75 and 76 are the wrapper's "replace this process" (:data:`REPLACE_ME_STATUSES`).
    Any other status is the rank's own end: 0, it finished; else it left with its exception (a rank
    excluded by a restart, or a failed job), and a new process would only repeat it.
    """
    if returncode is None:
        return None
    if returncode < 0:
        return describe_status(returncode)
    if returncode in REPLACE_ME_STATUSES:
        return f"exited with status {returncode} ({REPLACE_ME_STATUSES[returncode]})"
    return None


@dataclasses.dataclass(frozen=True)
class RespawnPolicy:
    """At most ``max_per_seat`` replacements per rank, the k-th one ``backoff_s * 2**(k-1)`` seconds after the
    death that asks for it, at most :data:`RESPAWN_BACKOFF_CAP_S` (or ``backoff_s``, if that is longer)."""

    max_per_seat: int = 0
    backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if type(self.max_per_seat) is not int or self.max_per_seat < 0:
            raise ValueError(f"max_per_seat={self.max_per_seat!r}: expected a number of respawns >= 0")
        if not self.backoff_s > 0 or math.isinf(self.backoff_s):
            raise ValueError(f"backoff_s={self.backoff_s!r}: expected a number of seconds > 0")

    def delay(self, attempt: int) -> float:
        """The wait before the ``attempt``-th respawn (1, 2, ...) of one seat."""
        return min(self.backoff_s * 2.0 ** min(attempt - 1, 64), max(RESPAWN_BACKOFF_CAP_S, self.backoff_s))


@dataclasses.dataclass
class RankSeat:
    """One rank's place in the job: its processes, the first and its replacements, oldest first."""

    rank: int
    lives: list[Process]
    respawn_at: float | None = None  # time.monotonic() of the pending respawn
    respawn_reason: str = ""  # why the pending respawn replaces the last process
    empty_because: str = ""  # why a process that had to be replaced was not

    @property
    def respawns(self) -> int:
        return len(self.lives) - 1

    @property
    def last(self) -> Process:
        return self.lives[-1]

    def running(self) -> bool:
        return self.last.returncode is None


class Supervisor:
    """Waits for every seat of a job (:class:`inprocess.launch.LocalJob`) once started, respawning a seat
    whose process had to be replaced (:func:`replacement_reason`) while the job runs, within :class:`RespawnPolicy`.

    A seat is respawned only while the job goes on: not once a rank finished (it exits 0 when the job
    completed), nor when no other rank's process runs (a joiner needs a running job to join). A respawn
    pending then is dropped. Each decision is one line on stderr.
    """

    POLL_S = 0.05  # how often the processes are polled: what a death costs before it is seen

    def __init__(self, job: Job, policy: RespawnPolicy):
        self.job = job
        self.policy = policy
        self.seats: list[RankSeat] = []  # from the job's ranks, once it started
        self.stop_signal: int | None = None  # set by a signal handler: the loop raises KeyboardInterrupt

    def finish(self, timeout: float | None, who: str) -> list[RankSeat] | None:
        """:meth:`wait`, or None past ``timeout``, said on stderr as `who`: the caller then leaves the
        job's ``with``, which kills every rank, and exits 124 (as timeout(1) does)."""
        try:
            return self.wait(timeout)
        except TimeoutError:
            print(f"{who}: the job did not finish within {timeout:g}s; every rank was killed", file=sys.stderr)
            return None

    def wait(self, timeout: float | None) -> list[RankSeat]:
        """Until every seat's last process exited and no respawn is pending. Raises TimeoutError past
        ``timeout`` and KeyboardInterrupt once :attr:`stop_signal` is set; the caller kills the job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.seats = [RankSeat(rp.rank, [rp]) for rp in self.job.ranks]
        while True:
            if self.stop_signal is not None:
                raise KeyboardInterrupt(signal.Signals(self.stop_signal).name)
            now = time.monotonic()
            # Every exit seen first, then each decided: two ranks that died together see each other dead.
            exited = []
            for seat in self.seats:
                if seat.running():
                    seat.last.returncode = exit_status_unreaped(seat.last.popen)
                    if seat.last.returncode is not None:
                        exited.append(seat)
            for seat in exited:
                self._exited(seat, now)
            for seat in self.seats:
                if seat.respawn_at is not None and seat.respawn_at <= now:
                    self._respawn(seat)
            pending = [seat.respawn_at for seat in self.seats if seat.respawn_at is not None]
            if not pending and not any(seat.running() for seat in self.seats):
                return self.seats
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"the job did not finish within {timeout:g}s")
            time.sleep(max(0.0, min([self.POLL_S, *(at - now for at in pending)])))

    def _exited(self, seat: RankSeat, now: float) -> None:
        reason = replacement_reason(seat.last.returncode)
        if reason is None or self.policy.max_per_seat == 0:
            return
        limit = self.policy.max_per_seat
        if seat.respawns >= limit:
            seat.empty_because = f"no respawn left: {limit} of {limit} used; the seat stays empty"
        else:
            ending = self._job_ending(seat)
            if ending is None:
                attempt = seat.respawns + 1
                delay = self.policy.delay(attempt)
                seat.respawn_at, seat.respawn_reason = now + delay, reason
                say(f"respawning rank {seat.rank} (attempt {attempt} of {limit}) in {delay:g}s: {reason}")
                return
            seat.empty_because = f"not respawned: {ending}"
        say(f"rank {seat.rank} {reason}; {seat.empty_because}")

    def _respawn(self, seat: RankSeat) -> None:
        seat.respawn_at = None
        ending = self._job_ending(seat)
        if ending is not None:
            seat.empty_because = f"not respawned: {ending}"
            say(f"rank {seat.rank}: the pending respawn is dropped: {ending}")
            return
        seat.lives.append(self.job.respawn(seat.rank, seat.respawns + 1))
        say(f"rank {seat.rank} respawned (attempt {seat.respawns} of {self.policy.max_per_seat}, "
             f"pid {seat.last.popen.pid}, {RESPAWN_COUNT_VAR}={seat.respawns})")

    def _job_ending(self, seat: RankSeat) -> str | None:
        """Why the job is ending for ``seat``'s respawn, or None while it runs."""
        others = [s for s in self.seats if s is not seat]
        finished = [s.rank for s in others if s.last.returncode == 0]
        if finished:
            return f"the job is ending (rank {finished[0]} finished)"
        if not any(s.running() for s in others):
            return "no other rank is running (nothing to join)"
        return None


def exit_status_unreaped(popen: subprocess.Popen[str]) -> int | None:
    """The process's returncode (as Popen's: -N for signal N) once it exited, without reaping it; None
    while it runs.

    A dead rank stays a zombie until the job ends (:meth:`inprocess.launch.LocalJob.kill` reaps it), as it did when the
    launcher waited for the ranks in rank order: its monitor reads its exit status from /proc while it
    is one (processes/monitor.py, ``_zombie_status``), and its pid, its process group's id, cannot be
    reused by another process before the launcher's last ``killpg``.
    """
    if popen.returncode is not None:
        return popen.returncode
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere: Popen knows, or nobody does
        return popen.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
