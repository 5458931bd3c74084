"""The job's TCPStore server, in a process of its own.

Run as ``python -m inprocess.processes.store_host`` (see :func:`spawn_store_host`; the
rank that hosts the store, rank 0 by default, starts it from
:class:`inprocess.store.TCPStore`). Why a process of its own: a server inside
rank 0's training process dies with it, and with it the whole job's
coordination, the restart barriers and the user's own rendezvous. This
process runs torch's TCPStore server and nothing else, so a SIGKILL of rank 0
(or of any other rank) leaves the store serving the ranks that remain.

It lives exactly as long as the job needs it:

- it exits once the wrapped call it serves has ended (``inprocess/<call>/done``,
  set by the last rank to leave; the call index is bound by the wrapper through
  the ``inprocess/store_host/call`` key);
- once the process that started it is gone, it also exits when no monitor
  process of the job has heartbeat (``inprocess/<call>/monitors/<rank>``) for
  ``--idle-timeout-s``: the job is gone without a word (killed by its
  scheduler), and a server nobody uses must not stay behind;
- SIGTERM/SIGINT stop it at once.

Memory: it imports torch for the server (about 220 MB RSS once per job, not
per rank). Under torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True`` the agent
already hosts a server that outlives the training processes, and no store host
is started.

Exit codes: 0 done or stopped, 2 bad arguments, 3 the server could not start
(the reason is written to the ready pipe and the log).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

from ..control.protocol import done_key, is_timeout, monitor_heartbeat_key

log = logging.getLogger("inprocess.processes.store_host")

CALL_KEY = "inprocess/store_host/call"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SERVER = 3
_READY = "ready"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inprocess.processes.store_host",
                                description="Host the TCPStore server of an inprocess job.")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0: any free port)")
    p.add_argument("--world-size", type=int, required=True, help="initial world size of the job")
    p.add_argument("--ready-fd", type=int, default=-1, help="write 'ready <port>' (or the error) here, then close it")
    p.add_argument("--parent-pid", type=int, default=0, help="the process that started this one")
    p.add_argument("--idle-timeout-s", type=float, default=60.0,
                   help="with the parent gone: exit when no monitor heartbeat advanced for this long")
    p.add_argument("--check-interval-s", type=float, default=1.0, help="how often the lifetime is checked")
    p.add_argument("--libuv", type=int, default=1, choices=[0, 1], help="torch's libuv server backend (1) or the legacy one")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _check_args(args: argparse.Namespace) -> Optional[str]:
    if not 0 <= args.port <= 65535:
        return f"--port={args.port}: expected 0..65535"
    if args.world_size < 1:
        return f"--world-size={args.world_size}: expected >= 1"
    if args.idle_timeout_s <= 0 or args.check_interval_s <= 0:
        return f"--idle-timeout-s={args.idle_timeout_s}, --check-interval-s={args.check_interval_s}: expected > 0"
    return None


class _JobLiveness:
    """Is any monitor of the job still heartbeating? Read a few times per idle
    timeout, with one ``multi_get`` of the counters known to exist (plus one
    ``check`` per counter not seen yet): never O(N) requests."""

    def __init__(self, store: Any, world_size: int, idle_timeout_s: float):
        self.store = store
        self.world_size = world_size
        self.every_s = idle_timeout_s / 4
        self.known: list[int] = []
        self.unknown = set(range(world_size))
        self.values: list[bytes] = []
        self.last_progress = self.last_read = time.monotonic()

    def idle_s(self, call: int) -> float:
        """Seconds since some monitor's counter was last seen to move."""
        now = time.monotonic()
        if now - self.last_read >= self.every_s:
            self.last_read = now
            for rank in sorted(self.unknown):
                if self.store.check([monitor_heartbeat_key(call, rank)]):
                    self.unknown.discard(rank)
                    self.known.append(rank)
                    self.last_progress = now  # a counter that appeared is news
            if self.known:
                values = self.store.multi_get([monitor_heartbeat_key(call, r) for r in self.known])
                if values != self.values:
                    self.last_progress = now
                self.values = values
        return now - self.last_progress


def _parent_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    return os.getppid() == pid


def serve(args: argparse.Namespace, stop: threading.Event) -> int:
    import torch.distributed as dist

    ready_fd = args.ready_fd
    try:
        server = dist.TCPStore(
            "127.0.0.1", args.port, None, True, datetime.timedelta(seconds=60),
            wait_for_workers=False, use_libuv=bool(args.libuv),
        )
    except Exception as e:
        message = f"cannot serve on port {args.port}: {type(e).__name__}: {e}"
        log.error("%s", message)
        _report(ready_fd, message)
        return EXIT_SERVER
    _report(ready_fd, f"{_READY} {server.port}")
    log.info("serving on port %d for %d ranks", server.port, args.world_size)
    liveness = _JobLiveness(server, args.world_size, args.idle_timeout_s)
    call: Optional[int] = None
    chunk = datetime.timedelta(seconds=args.check_interval_s)
    while not stop.is_set():
        try:
            # Blocking waits: the server wakes this client the moment the key is set.
            if call is None:
                server.wait([CALL_KEY], chunk)
                call = int(server.get(CALL_KEY))
                continue
            server.wait([done_key(call)], chunk)
            log.info("call %d is done", call)
            return EXIT_OK
        except Exception as e:
            if not is_timeout(e):  # the server itself answers these: only a bug lands here
                log.error("lifetime check failed: %s: %s", type(e).__name__, e)
                time.sleep(args.check_interval_s)
        if not _parent_alive(args.parent_pid):
            idle = liveness.idle_s(call if call is not None else 0)
            if idle > args.idle_timeout_s:
                log.warning("the process that started this store is gone and no monitor heartbeat "
                            "advanced for %.0fs: the job is gone", idle)
                return EXIT_OK
    return EXIT_OK


def _report(fd: int, line: str) -> None:
    if fd < 0:
        return
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s inprocess.processes.store_host[pid %(process)d] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(args.log_level)
    log.propagate = False
    problem = _check_args(args)
    if problem is not None:
        log.error("%s", problem)
        _report(args.ready_fd, problem)
        return EXIT_USAGE
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    return serve(args, stop)


class StoreHostProcess:
    """Handle on a running store host (the spawning rank's side)."""

    def __init__(self, popen: "subprocess.Popen[bytes]", port: int):
        self.popen = popen
        self.port = port

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_exit(self, timeout: Optional[float]) -> bool:
        """True once the host exited by itself (the call is done) within ``timeout``."""
        try:
            self.popen.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def spawn_store_host(
    port: int, world_size: int, *, idle_timeout_s: float = 60.0, use_libuv: bool = True,
    start_timeout_s: float = 120.0,
) -> StoreHostProcess:
    """Start the store host (fork + exec of a fresh interpreter) and wait until it serves.

    Raises RuntimeError naming the port when the server cannot start (the
    port is taken, for instance) and leaves no process behind.
    """
    read_fd, write_fd = os.pipe()
    argv = [
        sys.executable, "-m", "inprocess.processes.store_host", "--port", str(port), "--world-size", str(world_size),
        "--ready-fd", str(write_fd), "--parent-pid", str(os.getpid()),
        "--idle-timeout-s", repr(float(idle_timeout_s)), "--libuv", str(int(use_libuv)),
    ]
    try:
        popen = subprocess.Popen(argv, pass_fds=[write_fd], stdin=subprocess.DEVNULL)
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    os.close(write_fd)
    try:
        line = _read_line(read_fd, start_timeout_s)
    finally:
        os.close(read_fd)
    if line.startswith(_READY + " "):
        return StoreHostProcess(popen, int(line.split()[1]))
    host = StoreHostProcess(popen, port)
    host.stop()
    why = line or f"no answer within {start_timeout_s:g}s (exit code {popen.returncode})"
    raise RuntimeError(f"the TCPStore host process for port {port} did not start: {why}")


def _read_line(fd: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
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


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The server's threads are torch's: leave without tearing them down under the interpreter.
    os._exit(code)
