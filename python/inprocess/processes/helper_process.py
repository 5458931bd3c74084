"""The rank's handle on a helper process it starts (a monitor, a store host, a node agent): a fresh
interpreter told its :mod:`~inprocess.processes.contract` configuration on its command line,
waited for until it says it is ready where it must, stopped and reaped on every path. This module
imports no torch."""

from __future__ import annotations

import dataclasses
import os
import select
import signal
import subprocess
import time
import typing

from .contract import READY, HelperConfig


class ChildProcess(typing.Protocol):
    """The part of ``subprocess.Popen`` a handle uses (a forked child has it too)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class HelperProcess:
    """The rank's handle on a helper process it started (see :meth:`start`)."""

    def __init__(self, config: HelperConfig, popen: ChildProcess, ready: str = ""):
        self.config = config
        self.popen = popen
        self.ready = ready  # what followed "ready" on its ready pipe ("" without one)

    @classmethod
    def start(cls, config: HelperConfig, *, env: dict[str, str] | None = None,
              ready_timeout_s: float | None = None) -> HelperProcess:
        """Fork and exec a fresh interpreter running the helper.

        The descriptors named by the config's ``inherited_fds`` are the only ones
        passed on, with the write end of a ready pipe when ``ready_timeout_s`` is
        given: the config then needs a ``ready_fd`` field, and this waits for the
        process's ready line. RuntimeError (and no process left behind) when
        it reports a failure or says nothing in time.
        """
        pass_fds = [getattr(config, name) for name in config.inherited_fds]
        read_fd = write_fd = -1
        if ready_timeout_s is not None:
            if not hasattr(config, "ready_fd"):
                raise ValueError(f"{type(config).__name__} has no ready_fd field: it cannot be waited for")
            read_fd, write_fd = os.pipe()
            config = dataclasses.replace(config, ready_fd=write_fd)  # type: ignore[call-arg]
            pass_fds.append(write_fd)
        # The signals the helper ignores are blocked from its first instruction: a fresh
        # interpreter takes a second or more to reach the line that ignores them, and a Ctrl-C
        # to the process group meanwhile (Python's default SIGINT handler) would end it. The
        # child inherits this thread's mask; it discards what is pending once it ignores it.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, config.ignored_signals)
        try:
            popen = subprocess.Popen(config.command(), pass_fds=pass_fds, stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            if read_fd >= 0:
                os.close(read_fd)
            raise
        finally:
            # A signal that came meanwhile is pending here, not lost: unblocking delivers it.
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if write_fd >= 0:
                os.close(write_fd)
        handle = cls(config, popen)
        if ready_timeout_s is None:
            return handle
        return handle.await_ready(read_fd, ready_timeout_s)

    def await_ready(self, read_fd: int, timeout_s: float) -> HelperProcess:
        """Read the process's ready line from ``read_fd`` (closed here); RuntimeError,
        with the process stopped and reaped, when it reports a failure or says nothing in time."""
        try:
            line = _read_line(read_fd, timeout_s)
        finally:
            os.close(read_fd)
        word, _, detail = line.partition(" ")
        if word == READY:
            self.ready = detail
            return self
        status = self.popen.poll()
        self.stop()
        why = line or f"no answer within {timeout_s:g}s (exit code {status})"
        raise RuntimeError(f"{self.config.describe()} did not start: {why}")

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        """Its exit status if it has exited (and reaps it then), else None."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_exit(self, timeout_s: float | None) -> bool:
        """True once it exited by itself within ``timeout_s`` (reaped)."""
        try:
            self.popen.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM and SIGCONT (a frozen process acts on the SIGTERM once continued);
        SIGKILL if it is still there after ``grace_s`` (the config's
        ``stop_grace_s`` by default). Reaped either way; returns its status."""
        if self.popen.poll() is None:
            self.popen.terminate()
            self.popen.send_signal(signal.SIGCONT)
            try:
                self.popen.wait(self.config.stop_grace_s if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def _read_line(fd: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()
