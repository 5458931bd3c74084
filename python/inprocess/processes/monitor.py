"""The monitor process: one per rank, spawned, watching the rank from outside.

Run as ``python -m inprocess.processes.monitor`` or ``inprocess-monitor``, with the
options of :class:`inprocess.processes.contract.MonitorConfig` (the rank starts it
with :meth:`~inprocess.processes.contract.HelperProcess.start`). The monitor

- sees the rank's death at once through a pidfd (no poll interval),
- enforces the hard timeout written on the rank's heartbeat page
  (SIGTERM + SIGCONT, grace, SIGKILL, in the native
  :class:`inprocess._native.HardTimeoutGuard`, which needs no Python),
- when the rank died in the middle of the job, records the fault in the store
  and arrives at the next barrier as terminated on the rank's behalf, so that
  the other ranks restart without it,
- exits when the rank exits; it never outlives it.

It imports no torch (it stays around 20 MB instead of 220 MB): the store is
reached with :class:`inprocess.control.tcpstore_client.TCPStoreClient`, the restart
protocol is :mod:`inprocess.control.protocol`. It connects to the store only when it
has something to write (or to heartbeat), so a job whose ranks never fail
costs the store no connection per rank.

What the monitor does with a dead rank: nothing if its page says it had left
the wrapper (phase DONE or TERMINATED: it told the store itself). Otherwise it
counts the rank out at the first barrier the rank was not counted at (its
seat in the store says which: see :mod:`inprocess.control.protocol`): it records the
fault for the iteration before that barrier, requests the restart, and arrives
there as terminated for the rank (expected = that barrier's membership size,
read from the previous decision). The seat's compare_set makes the count exact
even when the rank died in the middle of its own arrival. If that iteration had
completed instead, the monitor leaves the job for the rank.

Exit codes: 0 the rank exited and everything needed was recorded (or nothing
was needed), or the monitor was told to stop (SIGTERM/SIGHUP); 2 bad
arguments; 3 the store could not be updated; 4 internal error; 5 the rank
could not be signalled after a hard timeout (it may still be alive).
SIGINT is ignored: a Ctrl-C reaches the rank's whole process group, and the
rank decides what to do with it; the monitor follows the rank.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from .. import _native
from ..control import phases, seats
from ..control.counting_out import count_out, members_at
from ..control.join_records import ADMITTED, GONE, Outcome
from ..control.joining import JoinKeys
from ..control.protocol import FaultRecord, RestartProtocol, monitor_heartbeat_key
from ..control.tcpstore_client import StoreConnectionError, TCPStoreClient
from .contract import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, MonitorConfig, StopRequest, run_helper
from .process_status import describe_status, exit_status, start_time

EXIT_STORE = 3
EXIT_UNKILLABLE = 5

_FOREVER_S = 10 * 365 * 24 * 3600.0
_MARK_GONE_CONNECT_S = 2.0  # a monitor that must reconnect to say it leaves does not wait longer
_DYING_WITH_IT_S = 2.0  # stopped from outside while its rank is in the job: how long it looks for the rank's death
_FINISHED = phases.finished()
# Where a rank may be counted healthy at a barrier whose decision is not out (it may lead it).
_IN_BARRIER = phases.counted_in_barrier()

log = logging.getLogger("inprocess.processes.monitor")


# -- the monitor ------------------------------------------------------------------


HEARTBEAT_GONE = 1 << 40  # added to a monitor's counter when it stops on purpose
WATCHED_PEERS = 8  # a node of 8 ranks lost at once is counted out within one heartbeat_timeout


class PeerWatch:
    """The heartbeat counters of the next WATCHED_PEERS ranks (in initial rank
    order, wrapping around), read with one ``multi_get`` per interval.

    A counter that stands still for ``timeout_s`` of THIS host's monotonic
    clock means the peer's monitor (or node) is lost: no clock of another host
    is compared. So does a counter that never appears within ``timeout_s`` of
    this watcher's first look: the watcher looks only once its own rank passed
    the initial barrier, which every peer's rank reached with its monitor
    started, and a monitor adds to its counter as soon as it starts. (A node
    cut off right after the job started, before its monitors' first heartbeat
    reached the store, was otherwise never counted out: the others waited at
    the restart barrier until barrier_timeout, and left the job.) Every rank is
    watched by up to WATCHED_PEERS monitors; its seat makes only the first to
    count it out do so.

    A counter is a seat's, not one process's: once its monitor stopped on
    purpose (it added HEARTBEAT_GONE) or was counted lost, the counter is
    *dormant*, not timed, and still read. When it moves again, the monitor of
    a process that joins the seat (:mod:`inprocess.control.joining`) beats on
    it, and the watch resumes: a joiner, waiting or admitted, is watched like
    any rank.
    """

    def __init__(self, call: int, rank: int, world_size: int, timeout_s: float, incarnation: str = ""):
        width = min(WATCHED_PEERS, world_size - 1)
        self.peers = [(rank + k) % world_size for k in range(1, width + 1)]
        self.call = call
        self.incarnation = incarnation
        self.timeout_s = timeout_s
        self.last: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last changed)
        self.dormant: set[int] = set()  # gone on purpose, or counted lost: not timed until it moves
        self.exists: set[int] = set()
        self.first_look: float | None = None  # the silence of a counter never seen is timed from here

    def _confirm(self, store: Any) -> None:
        """multi_get waits for missing keys: read only counters known to exist.
        A monitor creates its counter when it starts; until then the peer is
        checked, one ``check`` for all of them in the usual case."""
        missing = [p for p in self.peers if p not in self.exists]
        if not missing:
            return
        keys = [monitor_heartbeat_key(self.call, p, self.incarnation) for p in missing]
        if store.check(keys):
            self.exists.update(missing)
            return
        for peer, key in zip(missing, keys, strict=True):
            if store.check([key]):
                self.exists.add(peer)

    def poll(self, store: Any) -> list[tuple[int, float, int]]:
        """Read the watched counters; returns the peers silent for too long (once per silence),
        each as (peer, seconds silent, the counter's value: 0 for one never seen)."""
        if self.first_look is None:
            self.first_look = time.monotonic()
        self._confirm(store)
        lost = []
        now = time.monotonic()
        for peer in self.peers:
            if peer not in self.exists and peer not in self.dormant and now - self.first_look > self.timeout_s:
                self.dormant.add(peer)
                lost.append((peer, now - self.first_look, 0))
        peers = [p for p in self.peers if p in self.exists]
        if not peers:
            return lost
        values = store.multi_get([monitor_heartbeat_key(self.call, p, self.incarnation) for p in peers])
        now = time.monotonic()
        for peer, raw in zip(peers, values, strict=True):
            value = int(raw)
            seen = self.last.get(peer)
            if seen is None or seen[0] != value:
                self.last[peer] = (value, now)
                if value // HEARTBEAT_GONE > (0 if seen is None else seen[0] // HEARTBEAT_GONE):
                    self.dormant.add(peer)  # a monitor of the seat stopped on purpose
                else:
                    self.dormant.discard(peer)  # beating: its monitor, or a joiner's
            elif peer not in self.dormant and now - seen[1] > self.timeout_s:
                self.dormant.add(peer)
                lost.append((peer, now - seen[1], value))
        return lost


def _ns(seconds: float) -> int:
    """Seconds as the nanoseconds of the native guard's interface (its only unit)."""
    return int(seconds * 1_000_000_000)


class Monitor:
    def __init__(self, args: MonitorConfig, stop: StopRequest):
        self.args = args
        self.stop = stop  # set by SIGTERM/SIGHUP, or by the guard's waiter once the guard has an event
        self.rank: int = args.rank
        self.pid: int = args.pid
        self.page: _native.HeartbeatPage | None = None
        self.pidfd = -1
        self.guard: _native.HardTimeoutGuard | None = None
        self._protocol: RestartProtocol | None = None
        self._stop_heartbeat = threading.Event()
        self.watch: PeerWatch | None = None
        if args.heartbeat_interval_s > 0 and args.heartbeat_timeout_s > 0 and args.world_size:
            self.watch = PeerWatch(args.call, args.rank, args.world_size, args.heartbeat_timeout_s,
                                   args.incarnation)
        self._heartbeat_thread: threading.Thread | None = None
        self._beating = False  # this monitor added to its seat's counter (a joiner's waits for a free seat)
        self._event: _native.GuardEvent | None = None
        self._start_time: int | None = None
        self._gone_on_purpose = True  # its seat's counter is marked gone when it stops (_mark_gone)

    # store ------------------------------------------------------------------

    def _connect(self) -> Any:
        # Its rank reached the server before it started this monitor: a refusal means the
        # server is gone (the job is ending), never worth a retry until the timeout.
        timeout = self.args.store_timeout_s
        return TCPStoreClient(self.args.store_host, self.args.store_port, timeout=timeout, connect_timeout=timeout,
                              retry_refused=False)

    @property
    def protocol(self) -> RestartProtocol:
        if self._protocol is None:
            self._protocol = RestartProtocol(self._connect(), self.args.call, incarnation=self.args.incarnation,
                                             initial_world_size=self.args.world_size)  # its seats: short_count
        return self._protocol

    def _heartbeat_loop(self) -> None:
        """Every heartbeat interval: one ``add`` to this monitor's counter, and
        one ``multi_get`` of the counters of the peers it watches."""
        key = monitor_heartbeat_key(self.args.call, self.rank, self.args.incarnation)
        store = None
        failing = 0  # heartbeats failed in a row: the first is a warning, the rest say how many at debug level
        while True:
            try:
                if store is None:
                    store = self._connect()
                if self._seat_free_for_beats(store):
                    beat = store.add(key, 1)
                    if not self._beating:
                        self._beating = True
                        if self.args.join_token:
                            JoinKeys(RestartProtocol(store, self.args.call, incarnation=self.args.incarnation).counted,
                                     self.args.call, self.args.incarnation).mark_watched(self.args.join_token, beat)
                if self.watch is not None and self._rank_passed_first_barrier():
                    for peer, silent_s, counter in self.watch.poll(store):
                        self._declare_lost(peer, silent_s, counter)
                if failing:
                    log.warning("heartbeat to the store works again after %d failed", failing)
                    failing = 0
            except Exception as e:  # the store is down or slow: try again next interval
                failing += 1
                log.log(logging.WARNING if failing == 1 else logging.DEBUG, "heartbeat to the store failed (%d in a "
                        "row; retried every %gs): %s: %s", failing, self.args.heartbeat_interval_s, type(e).__name__, e)
                if store is not None:
                    store.close()
                store = None
            if self._stop_heartbeat.wait(self.args.heartbeat_interval_s):
                break
        self._mark_gone(store)
        if store is not None:
            store.close()

    def _seat_free_for_beats(self, store: Any) -> bool:
        """Whether this monitor may add to its seat's counter: always, but for a joiner's while
        another process holds its seat (a running rank, whose counter it must not keep moving):
        from the seat's being counted out, or the joiner's admission, on. Two reads per interval
        while a joiner waits for a seat held."""
        if self._beating or not self.args.join_token:
            return True
        protocol = RestartProtocol(store, self.args.call, incarnation=self.args.incarnation)
        held = protocol.read_seat(self.rank)
        if held is None or seats.parse(held).counted_out:
            return True
        outcome = JoinKeys(protocol.counted, self.args.call, self.args.incarnation).read_outcome(self.args.join_token)
        return outcome is not None and outcome.kind == ADMITTED

    def _rank_passed_first_barrier(self) -> bool:
        # Every monitor has created its counter before its rank could count
        # itself in at barrier 0: from then on, every watched key exists.
        snap = self._page_snapshot()
        return snap is not None and snap.world_size > 0

    def _declare_lost(self, peer: int, silent_s: float, counter: int) -> None:
        """A peer's monitor went silent for heartbeat_timeout: its node is lost,
        or its monitor is. The joiners waiting for its seat whose monitor beat
        on the counter are withdrawn, the process holding the seat is counted
        out; on a thread of its own (it may wait for a decision), so that this
        monitor's own heartbeat goes on."""
        message = (f"the monitor of rank {peer} sent no heartbeat for {silent_s:.1f}s "
                   f"(heartbeat_timeout={self.args.heartbeat_timeout_s:g}s), seen by the monitor of rank {self.rank}")
        log.warning("%s: counting rank %d out", message, peer)

        def run() -> None:
            try:
                self._withdraw_lost_joiners(peer, counter, message)
            except Exception as e:
                log.error("could not withdraw the lost joiners of seat %d: %s: %s", peer, type(e).__name__, e)
            try:
                self.count_out(peer, "unresponsive", "HeartbeatTimeout", message, self._connect())
            except Exception as e:
                log.error("could not count out lost rank %d: %s: %s", peer, type(e).__name__, e)

        threading.Thread(target=run, name=f"inprocess-monitor-lost-{peer}", daemon=True).start()

    def _withdraw_lost_joiners(self, seat: int, counter: int, message: str) -> None:
        if counter == 0:
            return  # a counter never seen: no joiner's monitor beat on it
        store = self._connect()
        try:
            keys = JoinKeys(RestartProtocol(store, self.args.call, incarnation=self.args.incarnation).counted,
                            self.args.call, self.args.incarnation)
            for token in keys.withdraw_silent(seat, counter, f"its node is lost: {message}"):
                log.warning("joiner %s, waiting for seat %d, withdrawn: %s", token, seat, message)
        finally:
            store.close()

    def _mark_gone(self, store: Any) -> None:
        """Tell the peers' monitors that this one stops on purpose (not lost), on
        the heartbeat's own connection (a new one if it had none): at the end of
        a job the store host may be gone already, and then there is nobody left
        to tell, which is no reason to wait or to warn. A joiner's monitor that
        never beat leaves the counter alone: it is the running holder's."""
        if (self.args.join_token and not self._beating) or not self._gone_on_purpose:
            return
        try:
            if store is None:
                timeout = min(self.args.store_timeout_s, _MARK_GONE_CONNECT_S)
                store = TCPStoreClient(self.args.store_host, self.args.store_port, timeout=self.args.store_timeout_s,
                                       connect_timeout=timeout, retry_refused=False)
            store.add(monitor_heartbeat_key(self.args.call, self.rank, self.args.incarnation), HEARTBEAT_GONE)
        except StoreConnectionError as e:
            log.info("the store is gone (the job is over): nothing to mark (%s)", e)
        except Exception as e:
            log.warning("could not mark this monitor gone in the store: %s: %s", type(e).__name__, e)

    # lifecycle ----------------------------------------------------------------

    def run(self) -> int:
        original_parent = os.getppid()
        try:
            self.page = _native.HeartbeatPage.attach(self.args.heartbeat_fd)
        except (OSError, ValueError, RuntimeError) as e:
            log.error("cannot attach the heartbeat page on fd %d: %s", self.args.heartbeat_fd, e)
            return EXIT_USAGE
        os.close(self.args.heartbeat_fd)  # the page holds its own duplicate
        snap = self.page.snapshot()
        if snap.pid != self.pid:
            log.error("the heartbeat page belongs to pid %d, not to --pid %d", snap.pid, self.pid)
            return EXIT_USAGE
        self._start_time = start_time(self.pid)
        try:
            self.pidfd = _native.pidfd_open(self.pid)
        except OSError as e:
            log.warning("rank %d (pid %d) is gone before its monitor started (%s)", self.rank, self.pid, e)
            return self.handle_death(None)
        if self.pid == original_parent and os.getppid() != original_parent:
            # Re-parented: the rank died before the pidfd was opened, and the
            # pidfd may name a process that reused its pid.
            log.warning("rank %d (pid %d) died before its monitor started", self.rank, self.pid)
            return self.handle_death(None)
        self.guard = _native.HardTimeoutGuard(
            self.page.fd, self.pidfd, _ns(self.args.grace_s), _ns(self.args.kill_wait_s)
        )
        self.guard.start()
        waiter = threading.Thread(target=self._wait_guard, name="inprocess-monitor-guard", daemon=True)
        waiter.start()
        if self.args.heartbeat_interval_s > 0:
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat_loop, name="inprocess-monitor-heartbeat", daemon=True
            )
            self._heartbeat_thread.start()
        if self.args.pidfile:
            # Written once the rank is watched: the file's existence means so.
            _write_pidfile(self.args.pidfile)
        log.info("watching rank %d (pid %d), phase %s", self.rank, self.pid, snap.phase.name)
        self.stop.wait()
        if self.stop.signal is not None:
            return self._stopped_by_signal(self.stop.signal)
        waiter.join()
        if self._event is None:
            log.error("the hard-timeout guard ended without an event")
            return EXIT_INTERNAL
        return self.handle_event(self._event)

    def _stopped_by_signal(self, sig: signal.Signals) -> int:
        """Told to stop. Its rank stops it so at the end of the call, once its page says it left the
        wrapper: then the seat is marked gone on purpose. Stopped while the rank is still in the job
        (a node being torn down, a job-wide signal), the seat must not look left on purpose: if the rank
        dies within the grace it is counted out here, as any death; otherwise the peers' monitors count
        it out once its counter stood still for heartbeat_timeout."""
        snap = self._page_snapshot()
        if snap is None or snap.phase in _FINISHED:
            log.info("stopped by %s; rank %d (pid %d) left as it is", sig.name, self.rank, self.pid)
            return EXIT_OK
        self._gone_on_purpose = False
        if _native.wait_for_exit(self.pidfd, _ns(min(self.args.grace_s, _DYING_WITH_IT_S))):
            log.warning("stopped by %s while rank %d (pid %d) was in phase %s; the rank died meanwhile",
                        sig.name, self.rank, self.pid, snap.phase.name)
            return self.handle_death(None)
        log.warning("stopped by %s while rank %d (pid %d) is in phase %s: it is left unwatched, and its seat is not "
                    "marked left (its peers count it out if it goes silent)", sig.name, self.rank, self.pid,
                    snap.phase.name)
        return EXIT_OK

    def _wait_guard(self) -> None:
        assert self.guard is not None
        try:
            self._event = self.guard.wait_event(_ns(_FOREVER_S))
        finally:
            self.stop.set()

    def close(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(self.args.store_timeout_s)  # it marks this monitor gone on its way out
        if self.guard is not None:
            self.guard.stop(_ns(self.args.kill_wait_s + self.args.grace_s + 1.0))
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        if self._protocol is not None:
            close = getattr(self._protocol.store, "close", None)
            if close is not None:
                close()
        if self.page is not None:
            self.page.close()

    # what happened ------------------------------------------------------------

    def handle_event(self, event: _native.GuardEvent) -> int:
        if event.kind == _native.GuardEventKind.HARD_TIMEOUT:
            kill = event.kill
            outcome = kill.outcome if kill is not None else None
            waited = (event.detected_ns - event.last_progress_ns) / 1e9
            log.warning(
                "rank %d (pid %d): no progress for %.3fs in iteration %d, phase %s: %s",
                self.rank, self.pid, waited, event.iteration, event.phase.name,
                outcome.name if outcome is not None else "no kill",
            )
            detail = f"no progress for {waited:.3f}s; kill: {outcome.name if outcome is not None else '?'}"
            if outcome == _native.KillOutcome.SIGNAL_FAILED:
                self.record_only("hard_timeout", "KillFailed", detail + f" (errno {kill.error})")  # type: ignore[union-attr]
                return EXIT_UNKILLABLE
            return self.handle_death(("hard_timeout", "HardTimeout", detail))
        return self.handle_death(None)

    def _page_snapshot(self) -> _native.HeartbeatSnapshot | None:
        return self.page.snapshot() if self.page is not None and not self.page.closed else None

    def record_only(self, kind: str, type_: str, message: str) -> None:
        snap = self._page_snapshot()
        iteration = snap.iteration if snap is not None else 0
        try:
            self.protocol.report_fault(
                FaultRecord(self.rank, iteration, kind, type_, message, t_ns=time.monotonic_ns())
            )
        except Exception as e:
            log.error("could not record the fault of rank %d: %s: %s", self.rank, type(e).__name__, e)

    def handle_death(self, cause: tuple[str, str, str] | None) -> int:
        """The rank is dead (or was killed): tell the others what they need."""
        snap = self._page_snapshot()
        if snap is None:
            log.error("no heartbeat page: cannot tell where rank %d died", self.rank)
            return EXIT_INTERNAL
        phase, iteration = snap.phase, snap.iteration
        if cause is None:
            status = exit_status(self.pid, self._start_time, self.pidfd)
            kind, type_ = describe_status(status)
            message = f"rank process {self.pid} died"
            if status is None:
                message += " (exit status unknown: its parent reaped it before its monitor could read it)"
        else:
            kind, type_, message = cause
        message = f"{message} in iteration {iteration}, phase {phase.name}"
        if phase in _FINISHED:
            log.info("rank %d (pid %d) exited after leaving the wrapper (%s): nothing to do", self.rank, self.pid,
                     phase.name)
            return EXIT_OK
        log.warning("rank %d: %s (%s, %s)", self.rank, message, kind, type_)
        life: int | None = 0
        if self.args.join_token:
            try:
                admitted = self._withdraw_joiner(message)
            except Exception as e:
                log.error("rank %d: could not withdraw its join: %s: %s", self.rank, type(e).__name__, e)
                return EXIT_STORE
            if admitted is None:
                return EXIT_OK
            life = admitted.life
            self._await_admitting_decision(admitted)
        try:
            self.count_out(self.rank, kind, type_, message, in_barrier=phase in _IN_BARRIER, life=life)
        except Exception as e:
            log.error("rank %d: could not update the store: %s: %s", self.rank, type(e).__name__, e)
            return EXIT_STORE
        return EXIT_OK

    def _withdraw_joiner(self, message: str) -> Outcome | None:
        """A rank that joined a running job died: withdraw it if it was not admitted yet
        (None: nothing more to do), else its admission."""
        keys = JoinKeys(self.protocol.counted, self.args.call, self.args.incarnation)
        outcome = keys.resolve(self.args.join_token, Outcome(GONE, why=message))
        if outcome.kind == ADMITTED:
            return outcome
        log.info("rank %d died while it waited to join (%s): withdrawn", self.rank, outcome.kind)
        return None

    def _await_admitting_decision(self, admitted: Outcome) -> None:
        """A joiner that died admitted, perhaps before its leader moved the seat into its life
        (the seat still holds the previous life's count-out, which counting out leaves alone):
        the seat is moved once the admitting barrier's decision is out. Waited for here, so that
        the count-out finds it moved and the next barrier does not wait for the dead joiner.
        Not waited for once the seat is in its life: the decision is out then, and its keys may
        be deleted since (a joiner that dies iterations after its admission)."""
        held = self.protocol.read_seat(self.rank)
        if held is not None and seats.parse(held).life >= admitted.life:
            return
        try:
            self.protocol.wait_decision(admitted.barrier, self.args.barrier_timeout_s)
        except Exception as e:  # counted out where the seat stands, as before
            log.warning("rank %d: no decision of barrier %d, which admitted it (%s: %s)", self.rank,
                        admitted.barrier, type(e).__name__, e)

    def count_out(
        self, rank: int, kind: str, type_: str, message: str, store: Any = None, *, in_barrier: bool = True,
        life: int | None = None,
    ) -> int | None:
        """Count ``rank`` out at the first barrier it has not been counted at
        (its seat says which), recording the fault and requesting the restart;
        or, lost inside a barrier before its decision (perhaps leading it), by
        that barrier's decision. ``in_barrier`` False: its page says it had
        left its last barrier (unknown for a peer: True)."""

        def fault(iteration: int) -> FaultRecord:
            return FaultRecord(rank, iteration, kind, type_, message, t_ns=time.monotonic_ns())

        protocol = (self.protocol if store is None
                    else RestartProtocol(store, self.args.call, incarnation=self.args.incarnation))

        # --world-size not given: a rank lost before the initial barrier cannot be counted out there.
        world_size = None if self.args.world_size is None else int(self.args.world_size)
        expected_at = members_at(protocol, rank, world_size, self.args.barrier_timeout_s)

        try:
            barrier = count_out(
                protocol, rank, fault, expected_at, timeout=self.args.barrier_timeout_s, who=f"m{self.args.rank}",
                in_barrier=in_barrier, life=life,
            )
        finally:
            if store is not None:
                store.close()
        if barrier is None:
            log.info("rank %d needed no counting out (counted already, not a member, or the job completed)", rank)
        else:
            log.info("counted rank %d out at barrier %d", rank, barrier)
        return barrier


# -- entry point -----------------------------------------------------------------


def _write_pidfile(path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)


def _remove_pidfile(path: str) -> None:
    try:
        with open(path) as f:
            mine = f.read().strip() == str(os.getpid())
        if mine:
            os.unlink(path)
    except OSError:
        pass


def _serve(config: MonitorConfig, stop: StopRequest) -> int:
    monitor = Monitor(config, stop)
    try:
        return monitor.run()
    finally:
        try:
            monitor.close()
        finally:
            if config.pidfile:
                _remove_pidfile(config.pidfile)
            if os.environ.get("INPROCESS_MONITOR_REPORT_MODULES"):
                # Test hook: proves that no torch was imported.
                log.info("modules: torch=%s", "torch" in sys.modules)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``inprocess-monitor`` and ``python -m inprocess.processes.monitor``."""
    run_helper(MonitorConfig, _serve, argv)


if __name__ == "__main__":
    main()
