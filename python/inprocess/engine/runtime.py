"""The resources one rank holds for one wrapped call, opened in order and
closed in reverse through one :class:`contextlib.ExitStack`.

:class:`inprocess.CallWrapper` runs the restart state machine; this module
owns what the machine runs on: the heartbeat page, the store connections (and
the store host this rank may have started), the node agent link, the restart
protocol and trigger, the main-thread interrupter, the watchdog, the monitor
process, the per-iteration store client of the function's own rendezvous, and
the process environment the call changes (RANK, WORLD_SIZE, sys.excepthook).

Opening order (each step's undo is pushed on the stack as it succeeds, so a
failure half-way closes exactly what was opened)::

    event log ► heartbeat page (+ hang guard) ► interrupter ► store (+ store host) ► process-group
    tracker ► node link (+ agent) ► protocols ► trigger ► watchdog ► monitor

Closing runs the other way round: the monitor is stopped first (it marks
itself gone, so that its peers do not count this rank out), the heartbeat page
is unmapped last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import time
import typing
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .. import _native
from .. import store as store_mod
from ..control import keys
from ..control.host_names import numeric_host_names
from ..control.incarnation import job_incarnation
from ..control.node_link import NodeLayout, NodeLink, socket_name
from ..control.protocol import RestartProtocol, done_key
from ..control.recovery_plan import Resource
from ..control.seat_table import MAX_PER_KEY
from ..events import EventLog
from ..gpu import nccl_reaper
from ..gpu.errors import NcclAbortTimeout
from ..processes.contract import MonitorConfig, NodeAgentConfig, rank_log_format
from ..processes.helper_process import HelperProcess
from ..state import Mode, State
from . import pg_tracker, sockets
from .config import Settings
from .hang_guard import HangGuard
from .interrupt import MainThreadInterrupter
from .trigger import RestartTrigger

log = logging.getLogger("inprocess")

# A joiner's wait for its node's agent: one that runs accepts at once and sends its board within
# JOINER_AGENT_CONNECT_S; none (a replaced node) refuses at once, and the joiner stops asking after
# JOINER_AGENT_ABSENT_S: no rank of the node is starting one (joiners never do).
JOINER_AGENT_CONNECT_S = 2.0
JOINER_AGENT_ABSENT_S = 0.1


def _seconds(td: Any) -> float:
    return float(td.total_seconds())


class RankRuntime:
    """Everything one rank opened for one call; :meth:`close` releases it all.

    Built by :meth:`open`; every field is set once it returns. ``monitor`` is
    None only where the store is not a TCPStore (the monitor speaks its wire
    protocol), ``node_link`` only where no node agent is used.
    """

    heartbeat: _native.HeartbeatPage
    hang_guard: HangGuard
    interrupter: MainThreadInterrupter
    store: dist.Store
    node_link: NodeLink | None
    protocol: RestartProtocol
    trigger: RestartTrigger
    trigger_protocol: RestartProtocol  # the trigger thread's own connection
    watchdog: _native.Watchdog
    monitor: HelperProcess | None
    events: EventLog | None  # None unless events are on (Wrapper(events_dir=...), INPROCESS_EVENTS_DIR)

    def __init__(self, wrapper: Settings, state: State, call_index: int, join_token: str = ""):
        self._w = wrapper
        # This process joins a running job (control/joining.py): its node's agent if one runs, a monitor that knows it.
        self.join_token = join_token
        self._state = state
        self.call_index = call_index
        # The launcher's incarnation (torchrun's restart count, SLURM's job/step/restart): in every key.
        self.incarnation = job_incarnation()
        self._stack = contextlib.ExitStack()
        # The function's own rendezvous: a fresh client per iteration (open_iteration_store).
        self._user_client: dist.Store | None = None
        self._user_sockets: dict[int, str] = {}
        self._seats_per_key: int | None = None  # proposed for the call's seats (control/seat_table.py)
        self._node_agent: HelperProcess | None = None
        self._store_sockets: dict[int, str] = {}
        # Set by a rank leaving on the job's abort or after giving up at a barrier: no rank writes
        # "done" for such an ending, and the store host may have exited on its idle timeout already.
        self.store_may_be_gone = False

    @classmethod
    def open(
        cls,
        wrapper: Settings,
        state: State,
        call_index: int,
        *,
        on_soft_timeout: Callable[[Any], None],
        release_main_thread: Callable[[], None],
        leave_unreleasable: Callable[[RestartProtocol, int], None],
        join_token: str = "",
    ) -> RankRuntime:
        """Open the rank's resources in order; on any failure, close what was opened and re-raise."""
        rt = cls(wrapper, state, call_index, join_token)
        with rt._stack:
            rt._open(on_soft_timeout, release_main_thread, leave_unreleasable)
            rt._stack = rt._stack.pop_all()  # success: the stack now outlives the with block
        return rt

    def close(self) -> None:
        self._stack.close()

    # -- opening, in order ------------------------------------------------------

    def _open(
        self,
        on_soft_timeout: Callable[[Any], None],
        release_main_thread: Callable[[], None],
        leave_unreleasable: Callable[[RestartProtocol, int], None],
    ) -> None:
        t = self._w.timeouts
        stack = self._stack
        self._keep_environment()

        self.events = EventLog.open(self._w.events_dir, self._state.initial_rank, self.call_index)
        if self.events is not None:
            stack.callback(self.events.close)

        self.heartbeat = _native.HeartbeatPage.create()
        stack.callback(self.heartbeat.close)
        self.hang_guard = HangGuard(self.heartbeat, _seconds(t.soft_timeout), _seconds(t.hard_timeout))
        stack.callback(self.hang_guard.close)  # its stamps end before the page goes

        self.interrupter = MainThreadInterrupter()
        self.interrupter.install()
        stack.callback(self.interrupter.uninstall)

        self.store = self._open_store()
        stack.callback(self._wait_for_the_other_ranks)

        # init_process_group wraps sys.excepthook every time ("[rankN]:" prefixes):
        # restored at every restart (release_iteration) and at the end.
        saved_excepthook = sys.excepthook
        pg_tracker.install()
        stack.callback(self._release_process_groups, saved_excepthook)
        self.saved_excepthook = saved_excepthook

        self.node_link = self._open_node_link()
        stack.callback(self._close_node_link)

        world = self._state.initial_world_size
        self.protocol = RestartProtocol(self.store, self.call_index, self.node_link, initial_world_size=world,
                                        incarnation=self.incarnation, seats_per_key=self._seats_per_key)
        self.trigger_protocol = trigger_protocol = RestartProtocol(
            store_mod.clone(self.store, self._w.store_factory, self._w.store_kwargs), self.call_index, self.node_link,
            initial_world_size=world, incarnation=self.incarnation, seats_per_key=self._seats_per_key,
        )
        self.trigger = RestartTrigger(
            trigger_protocol,
            self.interrupter,
            release_main_thread,
            release_timeout=t.release_wait_s,
            leave=lambda iteration: leave_unreleasable(trigger_protocol, iteration),
        )
        stack.callback(self.trigger.stop)

        self.watchdog = _native.Watchdog(
            self.heartbeat.fd, int(_seconds(t.progress_watchdog_interval) * 1e9), on_soft_timeout
        )
        self.watchdog.start()
        stack.callback(self.watchdog.stop, 1_000_000_000)

        self.monitor = self._spawn_monitor()
        stack.callback(self._stop_monitor)

    def _keep_environment(self) -> None:
        """RANK and WORLD_SIZE follow the active rank while the call runs; restored at the end."""
        saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}

        def restore() -> None:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

        self._stack.callback(restore)

    def _open_store(self) -> dist.Store:
        store_kwargs = dict(self._w.store_kwargs)
        if self._w.store_factory is store_mod.TCPStore:
            # An orphaned store host waits one heartbeat_timeout of silence before it decides the job is gone.
            store_kwargs.setdefault("host_idle_timeout_s", self._w.timeouts.store_host_idle_s)
        numeric_host_names()  # whatever the factory builds, torch's connections make no reverse DNS lookup
        before = sockets.socket_fds()
        store = self._w.store_factory(**store_kwargs)
        self._store_sockets = sockets.new_since(before)  # this connection shows when its server is gone
        if store_mod.host_process(store) is not None:
            # The store host exits when this call is done: tell it which call that is.
            store.set(keys.STORE_HOST_CALL, str(self.call_index))
        return typing.cast(dist.Store, store)  # whatever store_factory made: used as a torch Store

    def _open_node_link(self) -> NodeLink | None:
        """This node's agent (local rank 0 starts it), or None: the store directly."""
        layout = NodeLayout.from_env()
        store = self.store
        wanted = self._w.node_agent
        if wanted is None:
            wanted = (
                layout is not None and 1 < layout.local_world_size < self._state.initial_world_size
                and isinstance(store, dist.TCPStore)
            )
        if not wanted:
            return None
        if layout is None:
            raise ValueError("Wrapper(node_agent=True): no node layout: set LOCAL_RANK, LOCAL_WORLD_SIZE "
                             "and GROUP_RANK (torchrun does), or launch with srun")
        # The node agents' seats per key (control/seat_table.py), whether or not this rank reaches its agent.
        self._seats_per_key = min(layout.local_world_size, MAX_PER_KEY)
        if not isinstance(store, dist.TCPStore):
            raise ValueError(f"Wrapper(node_agent=True): the node agent speaks TCPStore only, the store is "
                             f"{type(store).__name__}")
        t = self._w.timeouts
        if self.join_token:
            return self._join_node_agent(layout, store)
        if layout.local_rank == 0:
            self._node_agent = HelperProcess.start(NodeAgentConfig(
                store_host=store.host, store_port=store.port, call=self.call_index, incarnation=self.incarnation,
                node=layout.node,
                slots=layout.local_world_size, store_timeout_s=t.agent_store_op_s, connect_timeout_s=t.agent_connect_s,
            ))
        name = socket_name(store.host, store.port, self.call_index, layout.node)
        try:
            return NodeLink.connect(name, layout.local_rank, t.agent_connect_s)
        except (TimeoutError, OSError, RuntimeError) as e:
            log.warning("rank %d: no node agent (%s): this rank talks to the store directly",
                        self._state.initial_rank, e)
            return None

    def _join_node_agent(self, layout: NodeLayout, store: dist.TCPStore) -> NodeLink | None:
        """A joiner links to its node's agent, if one runs, in its local rank's slot.

        It never starts one: the agent of a node still running other ranks of the
        job serves their store traffic already (the joiner's link keeps it alive
        while it waits and runs), and a node whose every rank was replaced has
        none, and would get one per joiner otherwise. An agent that is there
        accepts at once; where none listens the joiner stops asking after
        JOINER_AGENT_ABSENT_S, not agent_connect_s (a first rank's wait for its
        local rank 0 to start one), and talks to the store directly. What the slot still holds of
        the process it replaces is older than anything the joiner posts: its
        first arrival is at the barrier after its admission, with its seat's
        new life (control/seats.py).
        """
        name = socket_name(store.host, store.port, self.call_index, layout.node)
        try:
            timeout = min(JOINER_AGENT_CONNECT_S, self._w.timeouts.agent_connect_s)
            link = NodeLink.connect(name, layout.local_rank, timeout, absent_s=JOINER_AGENT_ABSENT_S)
        except (TimeoutError, OSError, RuntimeError) as e:
            log.info("rank %d: no node agent runs on node %s (%s): this joiner talks to the store directly",
                     self._state.initial_rank, layout.node, e)
            return None
        log.info("rank %d: joins through node %s's agent (pid %d), slot %d",
                 self._state.initial_rank, layout.node, link.board.agent_pid, layout.local_rank)
        return link

    def _spawn_monitor(self) -> HelperProcess | None:
        """The per-rank monitor process: sees this rank's death through a pidfd,
        enforces hard_timeout, and reports for the rank when it cannot."""
        store = self.store
        if not isinstance(store, dist.TCPStore):
            log.info("no monitor process: it speaks TCPStore only (store is %s)", type(store).__name__)
            return None
        t = self._w.timeouts
        return HelperProcess.start(MonitorConfig(
            store_host=store.host, store_port=store.port, call=self.call_index, incarnation=self.incarnation,
            rank=self._state.initial_rank,
            heartbeat_fd=self.heartbeat.fd, pid=os.getpid(), world_size=self._state.initial_world_size,
            grace_s=_seconds(t.termination_grace_time),
            store_timeout_s=t.monitor_store_op_s,
            barrier_timeout_s=t.monitor_barrier_wait_s,
            heartbeat_interval_s=_seconds(t.heartbeat_interval),
            heartbeat_timeout_s=_seconds(t.heartbeat_timeout),
            logfile=self._w.monitor_process_logfile,
            pidfile=self._w.monitor_process_pidfile,
            # Without a log file the monitor shares the rank's stderr: warnings only, in the rank's format.
            log_level="INFO" if self._w.monitor_process_logfile else "WARNING",
            log_format=rank_log_format(),
            join_token=self.join_token,
        ))

    # -- per iteration --------------------------------------------------------

    def open_iteration_store(self) -> None:
        """A fresh client connection per iteration for the function's own
        rendezvous, so that a restart can release a rendezvous blocked on a
        peer that failed, by shutting this connection down."""
        self._user_client, self._user_sockets = store_mod.tracked_clone(
            self.store, self._w.store_factory, self._w.store_kwargs
        )

    def iteration_store(self, iteration: int) -> dist.Store:
        """The store the function's rendezvous uses in ``iteration`` (its keys are scoped to it)."""
        if self._user_client is None:
            raise RuntimeError("CallWrapper.store is available inside the wrapped function only")
        return dist.PrefixStore(self.user_prefix(iteration), self._user_client)

    def shut_down_iteration_store(self) -> None:
        """From the trigger thread, at a restart: releases a rendezvous blocked on a failed peer."""
        sockets.shutdown_connected(self._user_sockets)

    def release(self, resources: frozenset[Resource]) -> None:
        """In the main thread, after the abort: what a restart releases of the failed iteration
        at this moment (:data:`inprocess.control.recovery_plan.RELEASE_SCHEDULE`).

        Back in the main thread, the failed iteration's frames gone and its
        collectives ended, destroying the groups here can race neither with DDP
        nor deadlock on the gloo workers (see inprocess.engine.pg_tracker).
        While NCCL's teardown of them still runs, they are forgotten instead,
        kept alive by the reaper until it is over (inprocess.gpu.nccl_reaper).
        NCCL's teardown is waited for, bounded by the abort's NCCL timeout:
        past it, :class:`~inprocess.gpu.NcclAbortTimeout`; or, where the abort
        asked for it and the device has room, it goes on beside the next
        iteration (Stage 2) and the call's end waits for it.
        """
        if Resource.NCCL_TEARDOWN in resources:
            nccl_reaper.REAPER.gate()
        if Resource.PROCESS_GROUPS in resources:
            pg_tracker.release_groups(keep=nccl_reaper.REAPER.keep)
            sys.excepthook = self.saved_excepthook
        if Resource.ITERATION_STORE in resources:
            self._user_client, self._user_sockets = None, {}

    def emit(self, kind: str, t_ns: int | None = None, **fields: Any) -> None:
        """An event of this rank (:mod:`inprocess.events`), where events are on."""
        if self.events is not None:
            self.events.emit(kind, t_ns, **fields)

    def user_prefix(self, iteration: int) -> str:
        return self.protocol.keys.user_prefix(iteration)

    def delete_user_keys(self, iteration: int) -> None:
        """Delete the keys the function's own rendezvous wrote in ``iteration``."""
        client = self.store
        list_keys = getattr(client, "list_keys", None)
        if list_keys is None:
            return
        prefix = self.user_prefix(iteration)
        try:
            for key in list_keys():
                if key.startswith(prefix):
                    client.delete_key(key)
        except Exception as e:
            log.debug("could not delete keys of iteration %d: %s", iteration, e)

    # -- closing (each pushed on the stack by _open) ---------------------------

    def _stop_monitor(self) -> None:
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            # Stopped on purpose: the monitor only marks its heartbeat gone (so
            # that its peers do not count this rank out).
            monitor.stop()

    def _close_node_link(self) -> None:
        link, self.node_link = self.node_link, None
        if link is not None:
            link.close()  # the agent exits once every rank of its node closed its link
        agent, self._node_agent = self._node_agent, None
        if agent is not None:
            # Reaped if it has exited; the node's other ranks may still be inside the
            # call, and then the agent outlives this rank (nothing waits for it here).
            agent.poll()

    def _release_process_groups(self, saved_excepthook: Any) -> None:
        try:
            nccl_reaper.REAPER.wait()  # a teardown left beside the last iteration (Stage 2) ends with the call
        except NcclAbortTimeout as e:
            log.error("the call ends with an NCCL teardown that did not return: %s", e)
        pg_tracker.release_groups(keep=nccl_reaper.REAPER.keep)
        sys.excepthook = saved_excepthook

    def _call_is_done(self) -> bool:
        if getattr(self, "protocol", None) is not None and self.protocol.finished:
            return True  # ended here: the store host exits, and a request now would meet a closed server
        if self.store_may_be_gone:
            return False  # asked nothing: torch's client logs a C++ stack trace for a request to a closed server
        try:
            return bool(self.store.check([done_key(self.call_index, self.incarnation)]))
        except Exception:  # the server went away: so did the call
            return True

    def _wait_for_the_other_ranks(self) -> None:
        """Whoever serves the store keeps serving until every rank left the call."""
        terminated = self._state.mode == Mode.TERMINATED
        host = store_mod.host_process(self.store)
        completion_timeout = _seconds(self._w.timeouts.completion_timeout)
        if host is not None and terminated and self._call_is_done():
            # The job ended with this rank's leaving: the store host is exiting, reap it.
            host.wait_exit(completion_timeout)
        if host is not None and not terminated:
            # The store host exits once the last rank left; a terminated rank
            # leaves at once (the host outlives it, that is its purpose).
            if not host.wait_exit(completion_timeout):
                log.warning("store host (pid %d): the other ranks did not all leave within "
                            "completion_timeout; it stays until they do", host.pid)
        if host is None and not terminated and not store_mod.is_host(self.store):
            self._wait_for_the_store_host(completion_timeout)
        if store_mod.is_host(self.store) and hasattr(self, "protocol"):
            # The server lives in this process: keep it until every rank left.
            # A terminated host waits for the rest of the job, however long.
            try:
                self.protocol.wait_done(None if terminated else completion_timeout)
            except Exception as e:
                log.warning("store host: the other ranks did not all leave: %s", e)

    def _wait_for_the_store_host(self, timeout: float) -> None:
        """A store host serves one call and exits once the last rank left it. A rank
        that entered the next call before it was gone would connect to it (rank 0's
        next store host binds the same port only after it) and lose that connection
        with it: so the call ends here only once the server has closed this rank's
        connection. No request is in flight on it: readable means closed."""
        if not getattr(self.store, "served_by_store_host", False):
            return  # an agent's store, a server in the host rank, a store of another kind
        deadline = time.monotonic() + timeout
        poller = select.poll()
        watched = 0
        for fd, ident in self._store_sockets.items():
            if sockets.identity(fd) == ident:
                poller.register(fd, select.POLLIN | select.POLLRDHUP)
                watched += 1
        if watched == 0:
            return  # its connection is not known: nothing to watch
        remaining = timeout
        while remaining > 0 and poller.poll(remaining * 1000) == []:
            remaining = deadline - time.monotonic()
        if remaining <= 0:
            log.warning("rank %d: the store host of call %d still serves %gs after the call ended",
                        self._state.initial_rank, self.call_index, timeout)
