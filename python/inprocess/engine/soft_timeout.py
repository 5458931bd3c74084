"""A soft timeout seen by the watchdog becomes a fault of this rank: the whole job restarts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..control.protocol import FaultRecord, RestartProtocol
from ..exception import TimeoutError
from ..state import State

log = logging.getLogger("inprocess")


def report_soft_timeout(
    protocol: RestartProtocol, state: State, event: Any, soft_timeout_s: float, emit: Callable[..., None]
) -> None:
    """Record the fault (the store wakes every rank's restart trigger) and emit its event.

    ``event`` is the watchdog's (:class:`inprocess._native.SoftTimeoutEvent`): when progress was last
    seen, when the timeout was detected, and whether progress was manual (``ping``)."""
    since = (event.detected_ns - event.last_progress_ns) / 1e9
    clock = "manual (ping)" if event.manual else "automatic"
    e = TimeoutError(f"no {clock} progress for {since:.1f}s (soft_timeout={soft_timeout_s:g}s)")
    log.warning("rank %d: soft timeout in iteration %d: %s", state.initial_rank, state.iteration, e)
    try:
        record = FaultRecord.from_exception(state.initial_rank, state.iteration, "soft_timeout", e)
        protocol.report_fault(record)
        emit("fault", record.t_ns, iteration=state.iteration, fault="soft_timeout", type=record.type,
             message=record.message)
    except Exception as err:  # the store is gone: the hard timeout is the next line of defence
        log.error("rank %d could not report its soft timeout: %s", state.initial_rank, err)
