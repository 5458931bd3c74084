"""Stopping what a benchmark started, also on Ctrl-C: a launcher (torchrun) starts its
workers in sessions of their own, so killing the launcher's process group is not enough.
Every process the benchmark starts inherits a marker in its environment; whatever still
carries it at the end is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import time


def marked_processes(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (``NAME=value``)."""
    found = []
    needle = marker.encode() + b"\0"
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read() + b"\0":
                    continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(name))
    return found


def stop(proc: subprocess.Popen[str], marker: str, grace_s: float = 10.0) -> None:
    """SIGTERM the launcher's process group (torchrun stops its workers on it), SIGKILL it
    after ``grace_s``, then SIGKILL every process still carrying ``marker``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    deadline = time.monotonic() + grace_s
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def exit_on_sigterm() -> None:
    """``kill PID`` (SIGTERM) ends the benchmark as Ctrl-C does, through its ``finally``
    blocks and context managers, which stop what it started (Python's default for SIGTERM
    ends the process at once, leaving its ranks or torchrun running)."""

    def stop_by_exception(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop_by_exception)
