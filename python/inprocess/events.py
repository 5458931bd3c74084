"""Structured events of a wrapped call: one JSON line per event, one file per rank.

Off by default. ``Wrapper(events_dir=...)`` or the environment variable
``INPROCESS_EVENTS_DIR`` turns it on; every rank then appends to
``<dir>/rank<initial rank>.jsonl`` (the directory is created if needed; a
rank restarted by its launcher appends to the same file). ``python -m
inprocess.timeline DIR`` turns a directory of them into a trace.

Each line is a JSON object with at least:

=========  =================================================================
``t_ns``   CLOCK_MONOTONIC of this host, ns (orders the events of one host)
``wall``   time.time() (aligns hosts, to the precision of their clocks)
``rank``   initial rank of the writer
``call``   index of the wrapped call in the process
``kind``   what happened (below)
=========  =================================================================

Kinds and their own fields:

=====================  ======================================================
``call_start``         world_size, host, pid, timeouts (the Wrapper's, in seconds)
``phase``              phase, iteration: the rank is in this phase until its
                       next ``phase`` event. Phases, in the order a restart
                       goes through them: INITIAL_BARRIER, RUNNING (the
                       function, or a spare waiting), ABORTING (back in the
                       main thread after the abort), FINALIZING,
                       HEALTH_CHECK, RESTART_BARRIER; then COMPLETION (the
                       function returned, waiting for the others), DONE or
                       TERMINATED (the phase table,
                       ``inprocess.control.phases``, lists them in order)
``iteration_start``    iteration, mode ("ACTIVE"/"INACTIVE"), job_rank (the
                       rank among active and spares), active_rank,
                       world_size, active_world_size
``fault``              iteration, fault ("exception", "after_restart",
                       "soft_timeout", "restart_abort": a RestartAbort that
                       ends the job, or why the rank leaves), type, message:
                       a fault this rank reports itself
``restart_detected``   iteration: the rank's trigger learnt that the
                       iteration restarts (``t_ns`` is that moment)
``abort_done``         iteration: the abort hook returned (trigger thread)
``decision``           iteration (the one it starts), world_size,
                       active_world_size, terminated (initial ranks, new at
                       this barrier), leader, n_faults, faults (up to 8:
                       rank, kind, type, message); and the decision's
                       summary (``control/recovery_plan.py``): left,
                       activated, deactivated, joined (initial ranks, up
                       to 32 each) with n_left, n_activated, n_deactivated,
                       n_joined, and stayed_active, stayed_spare,
                       started_active (counts), ends_job (null, or why
                       the job ends); digest (of the decision's JSON:
                       every rank reads the same), term, joined_lives
                       ([seat, life] per process admitted), life (of the
                       seat the writer holds), backoff_s (the storm
                       brake's wait after it)
``exit``               outcome ("completed" or "terminated"), reason,
                       iteration
=====================  ======================================================

Writing costs one ``json.dumps`` and one unbuffered ``write`` per event, a
handful per restart and per iteration: nothing in the training step.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import threading
import time
from typing import Any

ENV_VAR = "INPROCESS_EVENTS_DIR"


class EventLog:
    """Appends this rank's events to ``<directory>/rank<rank>.jsonl``; thread-safe."""

    def __init__(self, directory: str, rank: int, call: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        self._rank = rank
        self._call = call
        # O_APPEND: lines of several writers (a relaunched process) never interleave within a line.
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._lock = threading.Lock()

    @classmethod
    def open(cls, directory: str | None, rank: int, call: int) -> EventLog | None:
        """The log for ``directory`` (else ``$INPROCESS_EVENTS_DIR``), or None when neither is set."""
        directory = directory or os.environ.get(ENV_VAR) or None
        return None if directory is None else cls(directory, rank, call)

    def emit(self, kind: str, t_ns: int | None = None, **fields: Any) -> None:
        """One event; ``t_ns`` (CLOCK_MONOTONIC) dates one that happened earlier, e.g. on another thread."""
        now_ns, wall = time.monotonic_ns(), time.time()
        if t_ns is not None:
            wall -= (now_ns - t_ns) / 1e9
        record = {"t_ns": now_ns if t_ns is None else t_ns, "wall": wall, "rank": self._rank, "call": self._call,
                  "kind": kind, **fields}
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def call_start_fields(world_size: int, timeouts: Any = None) -> dict[str, Any]:
    """``call_start``'s fields; ``timeouts`` (the Wrapper's), in seconds: what bounds a restart."""
    fields: dict[str, Any] = {"world_size": world_size, "host": socket.gethostname(), "pid": os.getpid()}
    if timeouts is not None:
        fields["timeouts"] = {name: value.total_seconds() for name, value in sorted(vars(timeouts).items())
                              if isinstance(value, datetime.timedelta)}
    return fields


def decision_fields(decision: Any, life: int, backoff_s: float) -> dict[str, Any]:
    """What identifies a decision in a ``decision`` event (a digest of its JSON, its term, the (seat,
    life) of each process it admits), the life of the seat the writer holds, and the storm brake's
    back-off after it: what ``python -m inprocess.chaos check`` compares across ranks."""
    return {"digest": hashlib.sha256(decision.to_json().encode()).hexdigest()[:16], "term": decision.term,
            "joined_lives": [list(pair) for pair in decision.joined], "life": life, "backoff_s": backoff_s}
