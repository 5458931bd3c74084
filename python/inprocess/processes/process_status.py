"""A rank's process seen from outside, as its monitor sees it: its start time (against a
recycled pid), its wait status once it died (from /proc while it is a zombie, else through its
pidfd once its parent reaped it), and what that status says (a fault kind and type). This module
imports no torch."""

from __future__ import annotations

import fcntl
import os
import signal
import struct


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def start_time(pid: int) -> int | None:
    fields = proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def zombie_status(pid: int, start_time: int | None) -> int | None:
    """The wait status of the rank while it is an unreaped zombie, else None.

    Best effort: the parent (the launcher) may have reaped it already. The
    start time guards against a recycled pid.
    """
    fields = proc_stat(pid)
    if not fields or len(fields) < 50 or fields[0] != "Z":
        return None
    if start_time is None or int(fields[19]) != start_time:
        return None
    return int(fields[49])


# PIDFD_GET_INFO (linux/pidfd.h): _IOWR(PIDFS_IOCTL_MAGIC 0xFF, 11, struct pidfd_info), its first
# 64 bytes (PIDFD_INFO_SIZE_VER0); PIDFD_INFO_EXIT asks for the wait status, which Linux >= 6.15 keeps
# for any holder of a pidfd once the process was reaped. exit_code sits at offset 60.
_PIDFD_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_INFO_EXIT_CODE_OFFSET = 60


def reaped_status(pidfd: int) -> int | None:
    """The wait status of a reaped process, read through its pidfd; None where the kernel keeps none
    (before Linux 6.15, or not reaped yet)."""
    if pidfd < 0:
        return None
    buf = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("=Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    except OSError:
        return None
    if not struct.unpack_from("=Q", buf, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    return int(struct.unpack_from("=i", buf, _PIDFD_INFO_EXIT_CODE_OFFSET)[0])


def exit_status(pid: int, start_time: int | None, pidfd: int) -> int | None:
    """The rank's wait status: from /proc while it is a zombie, else (its parent, the launcher, reaped
    it first: a launcher that waits on its children does so within microseconds) from its pidfd."""
    status = zombie_status(pid, start_time)
    return status if status is not None else reaped_status(pidfd)


def describe_status(status: int | None) -> tuple[str, str]:
    """(fault kind, type) from a wait status."""
    if status is None:
        return "exited", "RankExited"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "killed", name
    if os.WIFEXITED(status):
        return "exited", f"exit code {os.WEXITSTATUS(status)}"
    return "exited", "RankExited"
