"""Stores the restart engine coordinates through (``store_factory``).

``store_factory(**store_kwargs)`` is called once per rank; the engine opens
extra client connections with :func:`clone` (its restart trigger blocks on
one, the wrapped function's own rendezvous uses another).

Where the TCPStore server lives: rank ``tcp_store_host_rank`` (default 0)
starts it in a process of its own (:mod:`inprocess.processes.store_host`) and connects
to it like every other rank, so that a SIGKILL of that rank's training process
leaves the server, and the job, running. The store host exits once the last
rank left the wrapped call. Under torchrun with its shared agent store
(``TORCHELASTIC_USE_AGENT_STORE=True``) the store at MASTER_ADDR:MASTER_PORT
is the server in the torchrun agent, which outlives the training processes
already: when that is the store the keywords name (no ``port``, or
MASTER_PORT), every rank is its client and no store host is started. An
explicit ``port`` (or ``host_name``) elsewhere is the user's own store, as in
nvidia_resiliency_ext's examples (``store_kwargs={'port': MASTER_PORT + 1}``):
the host rank serves it there. ``host_process=False`` keeps the server inside
the host rank's process (it then dies with it).
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import socket
import time
from typing import Any

import torch.distributed as dist

from .control.host_names import numeric_host_names
from .control.incarnation import job_incarnation
from .control.joining import join_requested
from .control.tcpstore_client import StoreError, StoreHandshakeClosedError, TCPStoreClient
from .engine import sockets
from .environment import env_int
from .exception import BarrierError as BarrierError  # NVRx's names for a barrier's failures
from .exception import BarrierOverflow as BarrierOverflow
from .exception import BarrierTimeout as BarrierTimeout
from .processes import store_host
from .processes.contract import StoreHostConfig, rank_log_format
from .processes.forked import fork_helper
from .processes.helper_process import HelperProcess

log = logging.getLogger("inprocess")

# How long a rank gives what listens at MASTER_ADDR:MASTER_PORT to answer a store's handshake.
PROBE_S = 10.0
_REACH_RETRY_S = 0.005  # between handshakes that a server going away closed


class StoreMixin:
    """Base of the stores a ``store_factory`` builds, as in nvidia_resiliency_ext.

    A custom factory derives from it and from a torch.distributed store, e.g.
    ``class MyStore(inprocess.store.StoreMixin, torch.distributed.TCPStore)``.
    The engine needs only torch's Store methods (set, get, add, compare_set,
    append, check, wait, delete_key; ``multi_get`` and the TCPStore's wire for
    the monitor processes); it never calls a method of this mixin on the
    store, so nothing here needs overriding.
    """

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        """Initial ranks whose process serves this store: they leave the call last."""
        return ()


class TCPStore(dist.TCPStore, StoreMixin):
    """torch's TCPStore, configured from the environment like torch.distributed.

    ``host_name``/``port``/``world_size`` default to MASTER_ADDR, MASTER_PORT
    and WORLD_SIZE. Rank ``tcp_store_host_rank`` starts the server: in a store
    host process (``host_process=True``, the default) or in its own process.
    ``host_idle_timeout_s``: once the host rank is gone, the store host also
    exits after this long without any monitor heartbeat (the job is gone).
    """

    TCP_STORE_HOST_RANK = 0

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """ValueError naming the first keyword of ``kwargs`` that ``__init__`` would refuse
        (unknown, or of the wrong type or range), so a Wrapper refuses it when it is built."""
        for name, value in kwargs.items():
            rule = _KWARG_RULES.get(name)
            if rule is None:
                raise ValueError(f"store_kwargs: {cls.__name__} has no keyword {name!r}; "
                                 f"expected one of {', '.join(sorted(_KWARG_RULES))}")
            expected, ok = rule
            if not ok(value):
                raise ValueError(f"store_kwargs[{name!r}]={value!r} ({type(value).__name__}): expected {expected}")

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        use_libuv: bool = True,
        tcp_store_host_rank: int | None = None,
        host_process: bool = True,
        host_idle_timeout_s: float = 60.0,
    ):
        numeric_host_names()  # before the first connection: no reverse DNS lookup in torch (control/host_names.py)
        host_source = "MASTER_ADDR" if host_name is None else "store_kwargs host_name"
        use_agent_store = uses_agent_store(host_name, port)
        origin = _address_origin(host_name, port, use_agent_store)
        if host_name is None:
            host_name = os.environ.get("MASTER_ADDR")
            if host_name is None:
                raise ValueError("MASTER_ADDR is not set and no host_name was given")
        if port is None:
            port = env_int("MASTER_PORT")
        if world_size is None:
            world_size = env_int("WORLD_SIZE")
        rank = env_int("RANK")
        address = _resolve(host_name, port, host_source)  # before anything starts: a bad address fails now, by name
        self.tcp_store_host_rank = self.TCP_STORE_HOST_RANK if tcp_store_host_rank is None else tcp_store_host_rank
        self.uses_agent_store = use_agent_store
        if use_agent_store:
            log.debug("store: torchrun's agent store at %s:%d (%s), every rank its client", host_name, port, origin)
        elif _under_agent_store():
            log.debug("store: served by initial rank %d at %s:%d (%s), not torchrun's agent store at "
                      "MASTER_ADDR:MASTER_PORT = %s:%s", self.tcp_store_host_rank, host_name, port, origin,
                      os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        else:
            log.debug("store: served by initial rank %d at %s:%d (%s)", self.tcp_store_host_rank, host_name, port,
                      origin)
        # A process that joins a running job (INPROCESS_JOIN=1) finds the store served already.
        self.is_host = rank == self.tcp_store_host_rank and not use_agent_store and not join_requested()
        self.host_process: HelperProcess | None = None
        # On every rank: the server runs in a store host, which exits once the call is done.
        self.served_by_store_host = bool(host_process) and not use_agent_store
        serve_here = self.is_host
        if self.is_host and host_process:
            config = StoreHostConfig(port=port, world_size=world_size, idle_timeout_s=host_idle_timeout_s,
                                     parent_pid=os.getpid(), libuv=bool(use_libuv), incarnation=job_incarnation(),
                                     log_format=rank_log_format())
            # Forked, not exec'd: the rank has imported torch already, a fresh interpreter
            # would import it again before the first barrier (processes/forked.py).
            self.host_process = fork_helper(config, store_host.serve, ready_timeout_s=timeout.total_seconds(),
                                            name="inprocess-store")
            port, serve_here = int(self.host_process.ready), False  # its ready line is the port it serves
        if not self.is_host:
            joining = join_requested()
            # A joiner comes to a running job: its store listens already, or the job is over.
            reach_s = min(timeout.total_seconds(), JOINER_REACH_S) if joining else timeout.total_seconds()
            try:
                _reach_store(address, host_name, port, reach_s, origin)
            except TimeoutError as e:
                if not joining:
                    raise
                # A respawned process that came too late (the job ended, and its store with it), or one started
                # for no running job: one line and status 1, not a traceback; only a launcher sets INPROCESS_JOIN.
                raise SystemExit(f"inprocess: rank {rank}: INPROCESS_JOIN=1, but the job it would join is not "
                                 f"running ({e}): this process leaves") from None
        try:
            super().__init__(
                host_name,
                port,
                world_size,
                serve_here,
                timeout,
                wait_for_workers=wait_for_workers,
                multi_tenant=multi_tenant,
                use_libuv=use_libuv,
            )
        except BaseException:
            if self.host_process is not None:
                self.host_process.stop()
            raise

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        # A store host process outlives the rank that started it: no rank is critical then.
        return (self.tcp_store_host_rank,) if self.is_host and self.host_process is None else ()


# How long a process that joins a running job (INPROCESS_JOIN=1) waits for the job's store to answer.
JOINER_REACH_S = 10.0


def _under_agent_store() -> bool:
    """torchrun told its workers that MASTER_ADDR:MASTER_PORT is its agent's store, shared with them."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def uses_agent_store(host_name: str | None, port: int | None) -> bool:
    """The store that ``host_name``/``port`` name (None: from MASTER_ADDR/MASTER_PORT) is torchrun's agent
    store, which every rank joins as a client; else the host rank serves it.

    Only under torchrun's shared agent store (``TORCHELASTIC_USE_AGENT_STORE=True``), and only where the
    keywords point at it: no port or MASTER_PORT, and no host or one that resolves to MASTER_ADDR's
    address. Any other port is the user's choice, honoured as nvidia_resiliency_ext honours it (its
    examples put the Wrapper's store on MASTER_PORT + 1, next to torchrun's).
    """
    if not _under_agent_store():
        return False
    master_port = os.environ.get("MASTER_PORT")
    if port is not None and str(port) != master_port:
        return False
    master_addr = os.environ.get("MASTER_ADDR")
    if host_name is None or host_name == master_addr:
        return True
    return master_addr is not None and bool(_addresses(host_name) & _addresses(master_addr))


def _addresses(host: str) -> set[str]:
    """The IP addresses ``host`` resolves to (empty when it does not resolve)."""
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def _address_origin(host_name: str | None, port: int | None, agent_store: bool) -> str:
    """Where the store's address comes from, for the errors and the log: the keywords or the environment."""
    host = "MASTER_ADDR" if host_name is None else "store_kwargs host_name"
    where = f"{host}, {'MASTER_PORT' if port is None else 'store_kwargs port'}"
    return f"torchrun's agent store; {where}" if agent_store else where


def _resolve(host: str, port: int, host_source: str = "MASTER_ADDR") -> tuple[Any, ...]:
    """The first address of ``host:port`` (family, type, proto, canonname, sockaddr); ValueError naming
    the host, and where it came from, when it does not resolve."""
    try:
        return tuple(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0])
    except (OSError, UnicodeError) as e:
        raise ValueError(f"the store's address {host!r} ({host_source}) does not resolve: {e}; expected a host "
                         f"name or an IP address of the node whose rank 0 hosts the store") from None


def _reach_store(address: tuple[Any, ...], host: str, port: int, timeout_s: float,
                 origin: str = "MASTER_ADDR, MASTER_PORT") -> None:
    """Return once a torch TCPStore server answers at ``host:port``; a clear error, within
    ``timeout_s``, when nothing listens there or what listens is not a store. ``origin`` says where
    the address came from (the keywords or the environment), for the errors."""
    deadline = time.monotonic() + timeout_s
    while True:
        # torch's client backs off for about half a second when the server is not listening
        # yet; ranks that start before the store host would all pay it before the first barrier.
        _await_listener(address, host, port, timeout_s, deadline=deadline, origin=origin)
        probe_s = max(min(deadline - time.monotonic(), PROBE_S), 0.001)
        try:
            TCPStoreClient(host, port, timeout=probe_s, connect_timeout=probe_s).close()
            return
        except StoreHandshakeClosedError as e:
            # A server going away answers so: the store host of the previous wrapped call
            # still has its port for a few ms after it closed this rank's connection (the
            # kernel accepts into its backlog until then), and the next call's host listens
            # on the same port right after. A listener that keeps closing connections is
            # named at the store's timeout.
            if time.monotonic() + _REACH_RETRY_S >= deadline:
                raise ConnectionError(f"{host}:{port} ({origin}) is not a torch TCPStore server: {e}") from None
            time.sleep(_REACH_RETRY_S)
        except StoreError as e:
            raise ConnectionError(f"{host}:{port} ({origin}) is not a torch TCPStore server: {e}") from None


def _await_listener(address: tuple[Any, ...], host: str, port: int, timeout_s: float, poll_s: float = 0.005,
                    *, deadline: float | None = None, origin: str = "MASTER_ADDR, MASTER_PORT") -> None:
    """Return once something accepts connections at the address; ``deadline`` (monotonic) ends the
    wait before ``timeout_s`` (which the error names) when the caller spent some of it already."""
    family, kind, proto, _, sockaddr = address
    if deadline is None:
        deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(family, kind, proto) as probe:
            probe.settimeout(max(min(1.0, deadline - time.monotonic()), 0.001))
            try:
                probe.connect(sockaddr)
                return
            except (ConnectionResetError, ConnectionAbortedError):
                return  # something listens, and reset the probe: the handshake tells what it is
            except ConnectionRefusedError:
                pass
            except OSError as e:
                raise ConnectionError(f"the store at {host}:{port} ({origin}) cannot be reached: {e}") from None
        if time.monotonic() + poll_s >= deadline:
            raise TimeoutError(f"nothing listens at {host}:{port} ({origin}) after {timeout_s:g}s: "
                               "expected the store that the host rank serves (is it running, and is this its "
                               "port?)")
        time.sleep(poll_s)


def _int_in(low: int, high: int | None = None) -> Any:
    return lambda v: type(v) is int and v >= low and (high is None or v <= high)


# TCPStore's keywords: (what is expected, the check). None means "from the environment".
_KWARG_RULES: dict[str, tuple[str, Any]] = {
    "host_name": ("a host name (str) or None", lambda v: v is None or (isinstance(v, str) and v != "")),
    "port": ("a TCP port (int in 1..65535) or None", lambda v: v is None or _int_in(1, 65535)(v)),
    "world_size": ("an int >= 1 or None", lambda v: v is None or _int_in(1)(v)),
    "timeout": ("a datetime.timedelta > 0", lambda v: isinstance(v, datetime.timedelta) and v.total_seconds() > 0),
    "wait_for_workers": ("True or False", lambda v: isinstance(v, bool)),
    "multi_tenant": ("True or False", lambda v: isinstance(v, bool)),
    "use_libuv": ("True or False", lambda v: isinstance(v, bool)),
    "tcp_store_host_rank": ("an initial rank (int >= 0) or None", lambda v: v is None or _int_in(0)(v)),
    "host_process": ("True or False", lambda v: isinstance(v, bool)),
    "host_idle_timeout_s": ("a number of seconds > 0",
                            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
}


class FileStore(dist.FileStore, StoreMixin):
    """torch's FileStore, for jobs on a single host (a path every rank can open)."""

    def __init__(self, file_name: str | None = None, world_size: int = -1):
        if file_name is None:
            file_name = os.environ.get("INPROCESS_FILE_STORE")
            if not file_name:
                raise ValueError("FileStore needs file_name= or INPROCESS_FILE_STORE set")
        self.file_name = file_name
        super().__init__(file_name, world_size)


class PrefixStore(dist.PrefixStore, StoreMixin):
    """A view of ``store`` whose keys are scoped to one iteration."""

    def __init__(self, iteration: int, store: dist.Store):
        self.base_store = store
        self.iteration = iteration
        super().__init__(f"_inprocess_{iteration}", store)


def check_store_kwargs(store_factory: Any, store_kwargs: dict[str, Any]) -> None:
    """Refuse, when the Wrapper is built, ``store_kwargs`` that ``store_factory`` cannot take."""
    check = getattr(store_factory, "check_kwargs", None)
    if check is not None:
        check(store_kwargs)
        return
    try:
        inspect.signature(store_factory).bind_partial(**store_kwargs)
    except TypeError as e:
        raise ValueError(f"store_kwargs={store_kwargs!r} for {getattr(store_factory, '__name__', store_factory)}: "
                         f"{e}") from None
    except ValueError:
        pass  # no signature to check against (a builtin): the factory says at call time


def clone(store: Any, store_factory: Any, store_kwargs: dict[str, Any]) -> dist.Store:
    """A second client connection to the same store."""
    if isinstance(store, dist.TCPStore):
        cloned: dist.Store = store.clone()  # type: ignore[attr-defined]  # torch's stubs lack clone()
        return cloned
    if isinstance(store, dist.FileStore):
        return dist.FileStore(getattr(store, "path", None) or store.file_name, -1)  # type: ignore[attr-defined]
    # A custom store without clone(): ask the factory for another client.
    client: dist.Store = store_factory(**store_kwargs)
    return client


def tracked_clone(store: Any, store_factory: Any, store_kwargs: dict[str, Any]) -> tuple[dist.Store, dict[int, str]]:
    """A new client connection, with the sockets it opened (to release it later)."""
    before = sockets.socket_fds()
    client = clone(store, store_factory, store_kwargs)
    return client, sockets.new_since(before)


def is_host(store: Any) -> bool:
    """This rank's process holds the server (it must outlive the other ranks' use of it)."""
    return bool(getattr(store, "is_host", False)) and host_process(store) is None


def host_process(store: Any) -> HelperProcess | None:
    return getattr(store, "host_process", None)
