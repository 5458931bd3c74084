"""The node agent's relay in C++: :class:`NativeNodeRelay`, same steps as :class:`NodeRelay`.

At 16,384 ranks a node agent's Python relay (``benchmarks/node_relay_cpu.py``)
spends ~80 % of its CPU in the interpreter and ~20 % in the kernel's round
trips. :class:`inprocess._native.NodeRelay` runs each step (``forward``,
``relay_decision``, ``relay_event``) as one C++ call without the GIL, over a
:class:`inprocess._native.StoreConnection` (the wire of
:class:`~inprocess.control.tcpstore_client.TCPStoreClient`), with the same
store requests and the same board effects.

The C++ code defines no key name and no seat value: :func:`relay_layout`
computes them as templates by calling the wire schema's key builders
(:class:`inprocess.control.keys.CallKeys`: ``iteration``, ``seat``,
``term_outcome``) and the protocol's own value functions
(:meth:`RestartProtocol._seat_move`, :meth:`RestartProtocol._set_ready`) with
marker numbers, and checks, each time it builds them, that the native
expansion of every template gives what the Python function gives; a change to
:mod:`inprocess.control.keys`, :mod:`inprocess.control.protocol` or
:mod:`inprocess.control.seats` that the templates cannot follow raises instead
of writing other keys.

Where it differs from :class:`NodeRelay` over a ``TCPStoreClient``, on purpose
or not yet:

* a wait asks ``cancelled()`` between chunks of ``store_ops.WAIT_CHUNK_S``
  with the GIL taken back for the call; inside a chunk no Python runs (nor
  its signal handlers: the agent's relays run in worker threads);
* the protocol's :class:`~inprocess.control.leadership.Terms` do not learn the
  terms the relay read (``saw``): only its ``delete`` uses them, which an
  agent never calls;
* :class:`inprocess._native.StoreConnection` serves what the relay and
  :class:`~inprocess.control.store_ops.CountingStore`'s reads and waits need
  (set, append, add, compare_set and its pipelined batches, check, wait,
  get), not ``multi_get``, ``multi_set``, ``delete_key`` or ``ping``; a
  handshake the server closes is a plain ``StoreConnectionError`` (the Python
  client says ``StoreHandshakeClosedError``).

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _native
from ..control import seat_table, store_ops
from ..control.keys import CallKeys
from ..control.leadership import LOST_MARK, parse_lost_mark
from ..control.protocol import COMPLETE, RESTART, TERMINATED_UNIT, RestartProtocol
from ..control.records import Decision
from ..exception import InternalError
from .node_relay import NodeRelay

__all__ = ["NativeNodeRelay", "relay_layout"]

# Marker numbers for the templates' holes: long enough that no prefix holds one by chance
# (the check below would catch it). BARRIER - 1 is the hole {p} (the previous barrier).
_BARRIER = 900000001
_RANK = 700000003
_LIFE = 800000005
_TERM = 600000007
_HOLES = {str(_BARRIER): "{b}", str(_BARRIER - 1): "{p}", str(_RANK): "{r}", str(_LIFE): "{l}", str(_TERM): "{t}"}
# Where each template is checked against the protocol: barrier 0 and later ones, life 0 and later ones.
_CHECK_BARRIERS = (0, 1, 2, 9, 10, 123)
_CHECK_LIVES = (0, 1, 7)
_CHECK_TERMS = (0, 1, 2, 11)


# Layouts built and checked in this process, per key prefix and seats per key: a simulator runs
# thousands of relays.
_CHECKED: dict[tuple[str, int], Any] = {}


class _Recorder:
    """A store that records what the protocol writes: how ``ready`` is set, without a second definition."""

    def __init__(self) -> None:
        self.sets: list[tuple[str, str]] = []

    def set(self, key: str, value: str) -> None:
        self.sets.append((key, value))


def _template(text: str) -> str:
    if "{" in text or "}" in text:
        raise InternalError(f"cannot template {text!r} for the native relay: it holds a brace")
    for marker, hole in _HOLES.items():
        text = text.replace(marker, hole)
    return text


def relay_layout(p: RestartProtocol, seats_per_key: int = 1) -> dict[str, Any]:
    """The templates of what the relay sends for protocol ``p``'s call (see the module's doc),
    for :class:`inprocess._native.RelayLayout`; ``seats_per_key``: the call's
    (:attr:`SeatTable.per_key <inprocess.control.seat_table.SeatTable.per_key>`)."""
    recorder = _Recorder()
    RestartProtocol(recorder, p.call, incarnation=p.incarnation)._set_ready(_BARRIER)
    [(ready_key, ready_value)] = recorder.sets
    if TERMINATED_UNIT & (TERMINATED_UNIT - 1):
        raise InternalError(f"TERMINATED_UNIT {TERMINATED_UNIT}: not a power of two, the native relay splits on a bit")

    def seat_moves(first: bool, life0: bool) -> tuple[str, str]:
        expected, desired = RestartProtocol._seat_move(0 if first else _BARRIER, 0 if life0 else _LIFE)
        return _template(expected), _template(desired)

    moves = [[seat_moves(first, life0) for life0 in (False, True)] for first in (False, True)]
    keys = CallKeys(p.prefix)
    return {
        "arrivals": _template(keys.iteration(_BARRIER, "arrivals")),
        "ready": _template(ready_key),
        "ready_value": ready_value,
        "event": _template(keys.iteration(_BARRIER, "event")),
        "restart": RESTART,
        "complete": COMPLETE,
        "seat": _template(keys.seat(_RANK)),  # {r}: the key's index
        "seats_per_key": seat_table.check_per_key(seats_per_key, "seats per key"),
        "seat_attempts": seat_table.attempts(seats_per_key),
        "seat_separator": seat_table.SEPARATOR,
        "seat_expected": [[m[0] for m in row] for row in moves],
        "seat_desired": [[m[1] for m in row] for row in moves],
        "outcome_first": _template(keys.term_outcome(_BARRIER, 0)),
        "outcome_later": _template(keys.term_outcome(_BARRIER, _TERM)),
        "lost_mark": LOST_MARK.decode(),
        "terminated_shift": TERMINATED_UNIT.bit_length() - 1,
    }


def check_layout(relay: Any, p: RestartProtocol) -> None:
    """Raise :class:`InternalError` unless ``relay`` (a native relay) expands every template as ``p`` computes it."""
    recorder = _Recorder()
    ready = RestartProtocol(recorder, p.call, incarnation=p.incarnation)
    keys = CallKeys(p.prefix)
    wrong = []

    def same(name: str, native: str, python: str) -> None:
        if native != python:
            wrong.append(f"{name}: native {native!r}, protocol {python!r}")

    for b in _CHECK_BARRIERS:
        ready._set_ready(b)
        same(f"ready({b})", relay.expand("ready", b), recorder.sets[-1][0])
        same(f"arrivals({b})", relay.expand("arrivals", b), keys.iteration(b, "arrivals"))
        same(f"event({b})", relay.expand("event", b), keys.iteration(b, "event"))
        for life in _CHECK_LIVES:
            expected, desired = RestartProtocol._seat_move(b, life)
            same(f"seat move({b}, life {life})", relay.expand("seat_expected", b, life=life), expected)
            same(f"seat move({b}, life {life})", relay.expand("seat_desired", b, life=life), desired)
        for t in _CHECK_TERMS:
            same(f"outcome({b}, {t})", relay.expand("outcome", b, term=t), keys.term_outcome(b, t))
    for index in (0, 1, 2047):
        same(f"seat key({index})", relay.expand("seat", 0, rank=index), keys.seat(index))
    if wrong:
        more = f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise InternalError("the native relay's templates diverge from the protocol: " + "; ".join(wrong[:3]) + more)


class NativeNodeRelay:
    """:class:`NodeRelay`'s interface; its steps run in C++ when the protocol's store is a
    :class:`inprocess._native.StoreConnection`, in :class:`NodeRelay` otherwise.

    ``forward`` and the broadcast steps (``relay_decision``, ``relay_event``)
    each run in their own thread in the agent, so each has a native relay of
    its own: the forward one holds the slots' state, and each counts its own
    store calls into the protocol that made them.
    """

    def __init__(self, board: Any):
        self.board = board
        self.python = NodeRelay(board)  # where the protocol's store is not a StoreConnection
        self._forwarder: tuple[str, Any] | None = None  # (the protocol's prefix, native relay)
        self._broadcaster: tuple[str, Any] | None = None

    def _native_for(self, p: RestartProtocol, which: tuple[str, Any] | None, *, seats: bool) -> Any:
        """The native relay of ``p``'s call; ``seats``: one that moves seats (it asks the
        call's seats per key, once per protocol: the broadcast steps move none)."""
        if which is not None and which[0] == p.prefix:
            return which[1]
        per_key = p.seat_table.per_key if seats else 1
        layout = _CHECKED.get((p.prefix, per_key))
        if layout is None:
            layout = _native.RelayLayout(relay_layout(p, per_key))
            check_layout(_native.NodeRelay(self.board, layout), p)
            _CHECKED[(p.prefix, per_key)] = layout
        return _native.NodeRelay(self.board, layout)

    @property
    def adds(self) -> int:
        """Batches forwarded (one store add each), by either relay."""
        return self.python.adds + (self._forwarder[1].adds if self._forwarder is not None else 0)

    @property
    def forwarded(self) -> list[int]:
        """The last barrier forwarded per slot."""
        return list(self._forwarder[1].forwarded) if self._forwarder is not None else list(self.python.forwarded)

    def forward(self, p: RestartProtocol) -> int:
        """:meth:`NodeRelay.forward`."""
        if not isinstance(p.store, _native.StoreConnection):
            if self._forwarder is not None:
                self.python.forwarded = list(self._forwarder[1].forwarded)
            n = self.python.forward(p)
            if self._forwarder is not None:
                self._forwarder[1].forwarded = self.python.forwarded
            return n
        relay = self._native_for(p, self._forwarder, seats=True)
        if self._forwarder is None or self._forwarder[1] is not relay:
            relay.forwarded = self.forwarded
            self._forwarder = (p.prefix, relay)
        return int(self._counted(p, relay, lambda: relay.forward(p.store)))

    def relay_decision(self, p: RestartProtocol, barrier: int, cancelled: Callable[[], bool]) -> bool:
        """:meth:`NodeRelay.relay_decision`."""
        if not isinstance(p.store, _native.StoreConnection):
            return self.python.relay_decision(p, barrier, cancelled)
        relay = self._broadcast_relay(p)
        # parse_lost_mark refuses a corrupted mark (InternalError) before it is posted, as in NodeRelay.
        raw = self._counted(p, relay, lambda: relay.relay_decision(p.store, barrier, cancelled,
                                                                   store_ops.WAIT_CHUNK_S, parse_lost_mark))
        return not Decision.ends_job(raw)

    def relay_event(self, p: RestartProtocol, iteration: int, cancelled: Callable[[], bool]) -> bool:
        """:meth:`NodeRelay.relay_event`."""
        if not isinstance(p.store, _native.StoreConnection):
            return self.python.relay_event(p, iteration, cancelled)
        relay = self._broadcast_relay(p)
        value = self._counted(p, relay, lambda: relay.relay_event(p.store, iteration, cancelled,
                                                                  store_ops.WAIT_CHUNK_S)).decode()
        if value not in (RESTART, COMPLETE):
            raise InternalError(f"iteration {iteration} event holds {value!r}, expected {RESTART!r} or {COMPLETE!r}")
        return value != COMPLETE

    def _broadcast_relay(self, p: RestartProtocol) -> Any:
        relay = self._native_for(p, self._broadcaster, seats=False)
        self._broadcaster = (p.prefix, relay)
        return relay

    @staticmethod
    def _counted(p: RestartProtocol, relay: Any, step: Callable[[], Any]) -> Any:
        """Run ``step`` and count its store calls into ``p`` (as CountingStore counts them), also when it raises."""
        calls, requests = relay.calls, relay.requests
        try:
            return step()
        finally:
            p.counted.calls += relay.calls - calls
            p.counted.requests += relay.requests - requests
