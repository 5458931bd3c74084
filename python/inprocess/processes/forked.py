"""A helper process forked from the rank, without exec: the store host's fast start.

The store host runs torch's TCPStore server, so a fresh interpreter must
``import torch`` before the first barrier can begin: about a second on an idle
machine, several under load (measured: ``benchmarks/startup.py``). The rank
that starts it has imported torch already, so a fork of the rank serves
within milliseconds: the child shares the rank's loaded libraries
copy-on-write and only builds the server.

A fork carries the parent's whole state, and the child must not touch what is
not its own:

* every descriptor but stdin/stdout/stderr and the ready pipe is closed, so
  that the child never holds a rank's connection (a peer would not see it
  close when the rank dies) nor its heartbeat page;
* the garbage collector never looks at the parent's objects (``gc.freeze``)
  and the child never returns into the rank's frames (it leaves with
  ``os._exit``): no finalizer of the rank's objects runs, so none closes a
  descriptor number the child has reused;
* the rank's signal handlers and log handlers are set aside (kept alive, never
  called): the child routes its stop signals and logs like every helper;
* only the forking thread exists in the child; it takes no lock another thread
  of the rank may have held (it builds a new server and a new client).

The child gets its own name (``inprocess-store``, what ``ps -o comm`` shows);
its command line stays the rank's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import select
import signal
import subprocess
from collections.abc import Callable
from typing import Any, TypeVar

from .contract import EXIT_INTERNAL, HelperConfig, StopRequest, leave, serve_config
from .helper_process import HelperProcess

Config = TypeVar("Config", bound=HelperConfig)

_PR_SET_NAME = 15
_kept_from_the_rank: list[Any] = []  # what the child set aside: referenced, so never finalized


class ForkedChild:
    """A child made by ``os.fork()``, with the part of ``subprocess.Popen`` a handle uses."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self._reaped(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and not select.select([self._pidfd], [], [], max(0.0, timeout))[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            _, status = os.waitpid(self.pid, 0)
            self._reaped(status)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        # As Popen does: a child that has exited by now is reaped, not left a zombie.
        if self._pidfd >= 0:
            try:
                self.poll()
            except OSError:
                pass
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def _reaped(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        os.close(self._pidfd)
        self._pidfd = -1


def fork_helper(config: Config, body: Callable[[Config, StopRequest], int], *, ready_timeout_s: float,
                name: str) -> HelperProcess:
    """Fork a child that runs ``body(config, stop)`` as a helper process, and wait for its ready line.

    ``config`` needs a ``ready_fd`` field; ``name`` is the child's process name (15 bytes at most).
    """
    read_fd, write_fd = os.pipe()
    try:
        config = dataclasses.replace(config, ready_fd=write_fd)  # type: ignore[call-arg]
        pid = os.fork()
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:
        code = EXIT_INTERNAL
        try:
            _become_a_helper(name, keep={write_fd})
            code = serve_config(config, body)
        finally:
            leave(code)
    os.close(write_fd)
    return HelperProcess(config, ForkedChild(pid, [name, *config.to_argv()])).await_ready(read_fd, ready_timeout_s)


def _become_a_helper(name: str, keep: set[int]) -> None:
    """In the child, before anything else: what the rank owns is set aside (module docstring)."""
    gc.freeze()
    for fd in _open_descriptors():
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for sig in range(1, signal.NSIG):
        try:
            if signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None):
                _kept_from_the_rank.append(signal.signal(sig, signal.SIG_DFL))
        except (OSError, ValueError):
            pass  # not a catchable signal
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger) and logger.handlers:
            _kept_from_the_rank.append(logger.handlers)
            logger.handlers = []
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the name is a convenience for ps


def _open_descriptors() -> list[int]:
    try:
        return [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))
