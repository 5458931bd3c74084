"""NVRx's fault injector (``nvidia_resiliency_ext.inprocess.tools.inject_fault``) on :mod:`inprocess.faults`.

The names NVRx users import from there: :class:`Fault` (the same twelve
members and values), :class:`InjectedException` (the class
:mod:`inprocess.faults` raises), :func:`inject_fault`,
:func:`maybe_raise_workload_exception`, :func:`clear_workload_exception`,
:func:`register_fault` and :func:`dispatch_fault_injection`.

``inject_fault(faults, num_faults, keep_alive, delay, seed, callback)``
draws from ``random.Random(seed)`` in NVRx's order: the delay (when a
range), how many ranks, which ranks among ``keep_alive .. WORLD_SIZE-1``, and
one fault for all of them. A seed therefore picks the same ranks, fault and
delay as NVRx does. On a chosen rank (``RANK``) the fault happens once,
``delay`` seconds later, in the background.

Differences from NVRx:

* ``SIGNAL_EXC`` raises :class:`InjectedException` through
  :data:`inprocess.faults.DELIVERY_SIGNAL`, not SIGUSR1 (schedulers and
  users own SIGUSR1); the signal faults are sent by a thread of the rank, not
  by a forked process;
* ``register_fault("name", handler)`` returns a :class:`CustomFault` to pass
  in ``faults`` instead of adding a member to :class:`Fault`;
* bad arguments raise ``ValueError`` naming them; a GPU fault chosen for a
  rank without CUDA raises :class:`inprocess.faults.FaultUnavailable`;
* ``delay`` may be an ``int`` as well as a ``float``.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..environment import env_int
from ..faults.actions import InjectedException
from ..faults.arming import ArmedFaults, raise_in_thread
from ..faults.plan import FaultPlan, FaultSpec, Kind, Ranks

log = logging.getLogger("inprocess.faults")


class Fault(enum.Enum):
    GPU_ERROR = 1
    GPU_SLEEP = 2
    WORKLOAD_EXC = 3
    ASYNC_EXC = 4
    SIGNAL_EXC = 5
    OS_ABORT = 6
    LOCK_GIL = 7
    SEGFAULT = 8
    SIGINT = 9
    SIGKILL = 10
    SIGTERM = 11
    SIGSTOP = 12


@dataclasses.dataclass(frozen=True)
class CustomFault:
    """A fault added with :func:`register_fault` under a name of its own."""

    name: str


AnyFault = Fault | CustomFault
Handler = Callable[[float, Callable[[], Any] | None], Any]

# The faults inprocess.faults performs as they are (timed by an ArmedFaults).
_KINDS = {
    Fault.GPU_ERROR: Kind.GPU_ERROR,
    Fault.GPU_SLEEP: Kind.GPU_SLEEP,
    Fault.SIGNAL_EXC: Kind.EXCEPTION,
    Fault.OS_ABORT: Kind.ABORT,
    Fault.LOCK_GIL: Kind.GIL_HANG,
    Fault.SEGFAULT: Kind.SEGFAULT,
    Fault.SIGINT: Kind.SIGINT,
    Fault.SIGKILL: Kind.SIGKILL,
    Fault.SIGTERM: Kind.SIGTERM,
    Fault.SIGSTOP: Kind.SIGSTOP,
}

_handlers: dict[AnyFault, Handler] = {}
_workload_raise = threading.Event()
_injections = itertools.count()


def register_fault(fault_name_or_enum: object, handler: Handler) -> AnyFault:
    """Make ``handler(delay, callback)`` do a fault: replace a :class:`Fault`'s, or add one under a new name.

    The handler is called on each chosen rank and does its own waiting (NVRx's
    contract): it should return at once and act ``delay`` seconds later.
    """
    if not callable(handler):
        raise ValueError(f"handler={handler!r}: expected a callable handler(delay, callback)")
    if isinstance(fault_name_or_enum, Fault):
        fault: AnyFault = fault_name_or_enum
    elif isinstance(fault_name_or_enum, str) and fault_name_or_enum.isidentifier():
        if fault_name_or_enum in Fault.__members__:
            fault = Fault[fault_name_or_enum]
        else:
            fault = CustomFault(fault_name_or_enum)
    else:
        raise ValueError(f"fault_name_or_enum={fault_name_or_enum!r}: expected a Fault or a name (an identifier)")
    _handlers[fault] = handler
    return fault


def dispatch_fault_injection(fault: AnyFault, delay: float, callback: Callable[[], Any] | None) -> None:
    """Start ``fault`` on this rank: it happens ``delay`` seconds from now, after ``callback()``."""
    if fault in _handlers:
        _handlers[fault](delay, callback)
    elif fault in _KINDS:
        assert isinstance(fault, Fault)
        _arm_once(_KINDS[fault], delay, callback)
    elif fault is Fault.WORKLOAD_EXC:
        _later(delay, callback, _workload_raise.set)
    elif fault is Fault.ASYNC_EXC:
        main = threading.main_thread().ident
        assert main is not None
        _later(delay, callback, lambda: raise_in_thread(main, InjectedException))
    else:
        raise ValueError(f"fault {fault!r}: not a Fault, and not registered with register_fault")


def maybe_raise_workload_exception() -> None:
    """Call in the training loop: raises :class:`InjectedException` once a ``WORKLOAD_EXC`` fault is due."""
    if _workload_raise.is_set():
        _workload_raise.clear()
        raise InjectedException("injected fault: WORKLOAD_EXC")


def clear_workload_exception() -> None:
    """Forget a ``WORKLOAD_EXC`` fault that is due and has not been raised."""
    _workload_raise.clear()


def inject_fault(
    faults: Sequence[AnyFault],
    num_faults: int | tuple[int, int],
    keep_alive: int,
    delay: float | tuple[float, float],
    seed: int,
    callback: Callable[[], Any] | None = None,
) -> None:
    """On ``num_faults`` ranks (an int, or an inclusive range drawn from the seed) among ranks
    ``keep_alive .. WORLD_SIZE-1``, one fault drawn from ``faults`` happens after ``delay``
    seconds (a number, or a range drawn from the seed). ``callback()`` runs just before it."""
    choices = _check_faults(faults)
    low, high = _check_num_faults(num_faults)
    if not _is_int(keep_alive) or keep_alive < 0:
        raise ValueError(f"keep_alive={keep_alive!r}: expected the number of leading ranks to spare, >= 0")
    if not _is_int(seed):
        raise ValueError(f"seed={seed!r}: expected an integer")
    if callback is not None and not callable(callback):
        raise ValueError(f"callback={callback!r}: expected a callable or None")
    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    rng = random.Random(seed)
    if _is_number(delay):
        delay_s = float(delay)  # type: ignore[arg-type]
        if delay_s < 0:
            raise ValueError(f"delay={delay!r}: expected seconds >= 0")
    else:
        lo, hi = _check_delay_range(delay)
        delay_s = rng.uniform(lo, hi)
    count = max(0, min(rng.randint(low, high), world_size - keep_alive))
    chosen = rng.sample(range(keep_alive, world_size), count) if count else []
    fault = rng.sample(choices, 1)[0]
    if rank in chosen:
        log.info("inject_fault: seed=%d ranks=%s fault=%s delay=%.3fs", seed, sorted(chosen), fault, delay_s)
        dispatch_fault_injection(fault, delay_s, callback)


# -- helpers -----------------------------------------------------------------


def _arm_once(kind: Kind, delay_s: float, callback: Callable[[], Any] | None) -> None:
    rank = env_int("RANK", 0)
    delay_ms = round(delay_s * 1000)
    spec = FaultSpec(kind, Ranks(listed=(rank,)), after_ms=(delay_ms, delay_ms))
    ArmedFaults(FaultPlan((spec,)), rank, rank + 1, 0, callback=callback, persistent=True,
                key=f"inject_fault#{next(_injections)}")


def _later(delay_s: float, callback: Callable[[], Any] | None, action: Callable[[], Any]) -> None:
    def run() -> None:
        time.sleep(delay_s)
        if callback is not None:
            callback()
        action()

    threading.Thread(target=run, name="inprocess-inject-fault", daemon=True).start()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_faults(faults: object) -> tuple[AnyFault, ...]:
    if isinstance(faults, (str, bytes)) or not isinstance(faults, Sequence) or not faults:
        raise ValueError(f"faults={faults!r}: expected a non-empty tuple of Fault members")
    checked: list[AnyFault] = []
    for f in faults:
        if not isinstance(f, (Fault, CustomFault)) or (isinstance(f, CustomFault) and f not in _handlers):
            raise ValueError(f"faults: {f!r} is not a Fault member nor a fault added with register_fault")
        checked.append(f)
    return tuple(checked)


def _check_num_faults(num_faults: object) -> tuple[int, int]:
    if _is_int(num_faults):
        pair: tuple[Any, ...] = (num_faults, num_faults)
    elif isinstance(num_faults, Sequence) and len(num_faults) == 2:
        pair = tuple(num_faults)
    else:
        raise ValueError(f"num_faults={num_faults!r}: expected an int or a (min, max) pair")
    if not all(_is_int(n) and n >= 0 for n in pair) or pair[0] > pair[1]:
        raise ValueError(f"num_faults={num_faults!r}: expected counts >= 0 with min <= max")
    return pair[0], pair[1]


def _check_delay_range(delay: object) -> tuple[float, float]:
    if not isinstance(delay, Sequence) or isinstance(delay, (str, bytes)) or len(delay) != 2:
        raise ValueError(f"delay={delay!r}: expected seconds, or a (min, max) pair of seconds")
    lo, hi = delay
    if not (_is_number(lo) and _is_number(hi)) or not 0 <= lo <= hi:
        raise ValueError(f"delay={delay!r}: expected 0 <= min <= max seconds")
    return float(lo), float(hi)


__all__ = [
    "CustomFault",
    "Fault",
    "InjectedException",
    "clear_workload_exception",
    "dispatch_fault_injection",
    "inject_fault",
    "maybe_raise_workload_exception",
    "register_fault",
]
