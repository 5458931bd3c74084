"""The job's TCPStore server, in a process of its own.

Run as ``python -m inprocess.processes.store_host`` or ``inprocess-store-host``, with the
options of :class:`inprocess.processes.contract.StoreHostConfig` (the rank that hosts
the store, rank 0 by default, starts it from :class:`inprocess.store.TCPStore`
with :meth:`~inprocess.processes.contract.HelperProcess.start`, and waits for
its ready line, which carries the port it serves on). Why a process of its own: a server inside
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
  ``idle_timeout_s``: the job is gone without a word (killed by its
  scheduler), and a server nobody uses must not stay behind;
- SIGTERM/SIGINT stop it at once.

Memory: it imports torch for the server (about 220 MB RSS once per job, not
per rank). Under torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True`` the agent
already hosts a server that outlives the training processes: where the store is
that one (no ``port`` in ``store_kwargs``, or MASTER_PORT), no store host is
started; an explicit port elsewhere gets one (inprocess.store.uses_agent_store).

Where no rank should host it (SLURM: the batch host of
``examples/slurm/train_store_apart.sbatch``), it is started by hand, ``--port`` the job's
MASTER_PORT, and the ranks are told that the store is served already
(``TORCHELASTIC_USE_AGENT_STORE=True``: every rank is its client). No rank then
binds it to a call, so it waits for the idle timeout (or a stop signal) to end.

Exit codes: 0 done or stopped, 2 bad arguments, 3 the server could not start
(the reason is written to the ready pipe and the log), 4 internal error.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from ..control import keys
from ..control.host_names import numeric_host_names
from ..control.incarnation import job_incarnation
from ..control.protocol import done_key, is_timeout, monitor_heartbeat_key
from ..control.tcpstore_client import TCPStoreClient
from .contract import EXIT_OK, StopRequest, StoreHostConfig, run_helper, tell_failed, tell_ready

log = logging.getLogger("inprocess.processes.store_host")

CALL_KEY = keys.STORE_HOST_CALL
EXIT_SERVER = 3


class _JobLiveness:
    """Is any monitor of the job still heartbeating? Read a few times per idle
    timeout, with one ``multi_get`` of the counters known to exist (plus one
    ``check`` per counter not seen yet): never O(N) requests."""

    def __init__(self, store: Any, world_size: int, idle_timeout_s: float, incarnation: str = ""):
        self.store = store
        self.incarnation = incarnation
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
                if self.store.check([monitor_heartbeat_key(call, rank, self.incarnation)]):
                    self.unknown.discard(rank)
                    self.known.append(rank)
                    self.last_progress = now  # a counter that appeared is news
            if self.known:
                values = self.store.multi_get([monitor_heartbeat_key(call, r, self.incarnation) for r in self.known])
                if values != self.values:
                    self.last_progress = now
                self.values = values
        return now - self.last_progress


def _parent_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    return os.getppid() == pid


def serve(config: StoreHostConfig, stop: StopRequest) -> int:
    import torch.distributed as dist

    # Forked from a rank it inherits this; exec'd it must do it itself: no client's
    # connection may wait for a reverse DNS lookup on the server's only thread.
    numeric_host_names()
    try:
        server = dist.TCPStore(
            "127.0.0.1", config.port, None, True, datetime.timedelta(seconds=60),
            wait_for_workers=False, use_libuv=config.libuv,
        )
    except Exception as e:
        message = f"cannot serve on port {config.port}: {type(e).__name__}: {e}"
        log.error("%s", message)
        tell_failed(config, message)
        return EXIT_SERVER
    tell_ready(config, str(server.port))
    log.info("serving on port %d for %d ranks", server.port, config.world_size)
    # Its own waits go through the torch-free client: torch's client logs a warning
    # on every wait that times out, once per check interval for the whole job.
    client = TCPStoreClient("127.0.0.1", server.port, timeout=config.check_interval_s)

    def end_the_wait_on_stop() -> None:
        # A stop signal ends the wait below at once (closing its connection), not after check_interval_s.
        stop.wait()
        client.close()

    threading.Thread(target=end_the_wait_on_stop, name="inprocess-store-stop", daemon=True).start()
    # Started by hand (a SLURM batch host, examples/slurm/train.sbatch) it has no --incarnation: the launcher's
    # variables it shares with the ranks give it (control/incarnation.py); a rank passes its own, the same.
    incarnation = config.incarnation or job_incarnation()
    liveness = _JobLiveness(client, config.world_size, config.idle_timeout_s, incarnation)
    call: int | None = None
    while not stop.is_set():
        if client.closed:
            # Its own connection gave up on a reply (this process was stopped or starved past the
            # wait's timeout: the chaos runner's slow store did it): a new one, or the job would lose its
            # store the next time it looks at the monitors (issue 31's long chaos run did).
            client = TCPStoreClient("127.0.0.1", server.port, timeout=config.check_interval_s)
            liveness.store = client
        try:
            # Blocking waits: the server wakes this client the moment the key is set.
            if call is None:
                client.wait([CALL_KEY], config.check_interval_s)
                call = int(client.get(CALL_KEY))
                continue
            client.wait([done_key(call, incarnation)], config.check_interval_s)
            log.info("call %d is done", call)
            return EXIT_OK
        except Exception as e:
            if stop.is_set():
                break
            if not is_timeout(e):  # the server itself answers these: only a bug lands here
                log.error("lifetime check failed: %s: %s", type(e).__name__, e)
                time.sleep(config.check_interval_s)
        if not _parent_alive(config.parent_pid):
            try:
                idle = liveness.idle_s(call if call is not None else 0)
            except Exception as e:  # its connection broke: looked at again with a new one
                log.warning("could not read the monitors' heartbeats: %s: %s", type(e).__name__, e)
                continue
            if idle > config.idle_timeout_s:
                log.warning("the process that started this store is gone and no monitor heartbeat "
                            "advanced for %.0fs: the job is gone", idle)
                return EXIT_OK
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``inprocess-store-host`` and ``python -m inprocess.processes.store_host``."""
    run_helper(StoreHostConfig, serve, argv)


if __name__ == "__main__":
    main()
