"""Grow: a restart on purpose, at a point every rank marks as safe, to take waiting joiners in.

A job that lost processes runs smaller until its next restart, where waiting
joiners (:mod:`inprocess.control.joining`) are admitted. With a
:class:`GrowPolicy`, the job makes that restart itself, but only at a *safe
point*: the end of a ``CallWrapper.atomic()`` block, or a call of
``CallWrapper.safe_point()`` (an iteration boundary of the user's loop),
never in the middle of a step.

**Where.** Every active rank counts its safe points in the iteration. Each
``check_every``-th one is a *look*: active rank 0 first decides whether to
grow (joiners wait, seats are empty, the policy allows it) and, if so, names
the look after the next as the grow point (``<i>/grow_at``, compare_set: once
per iteration). Every rank reads ``grow_at`` at each look. The ranks of a
training job advance in lockstep (each step has collectives), so every rank
reads at the next look after rank 0 wrote at this one: all of them stop at
the same safe point.

**How.** A rank at the grow point adds itself to ``<i>/grow_arrivals`` and
waits there, interruptible. The last to arrive records the cause (a fault
record of kind ``grow``, naming the joiners waiting) and requests the restart:
every rank is then interrupted where it waits, at its safe point. A real
fault meanwhile restarts the job as usual. The restart is an ordinary one
whose leader admits the joiners; its summary says "grow", and the storm brake
does not count it.

**Cost.** One ``peek`` per rank per look (``check_every`` safe points), plus
two counter reads on active rank 0; a grow adds one ``add`` per rank. The two
keys are deleted by the rank that scheduled the grow, when its next iteration
begins or, if the call ends before the grow point, on the call's way out; and
by the next barrier's leader with the iteration's other keys (two calls per
restart), should that rank have died first.
This module imports no torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ..control.joining import JoinKeys
from ..control.protocol import RestartProtocol
from ..control.records import FaultRecord
from .config import GrowPolicy

log = logging.getLogger("inprocess")

GROW = "grow"  # the kind of a grow's fault record


class GrowPoints:
    """One rank's safe points in one iteration, and what they decide (module docstring)."""

    def __init__(self, policy: GrowPolicy | None, protocol: RestartProtocol):
        self.policy = policy
        self.protocol = protocol
        self.count = 0
        self.iteration = -1
        self.last_grow_s = -float("inf")
        self.scheduled_in: int | None = None  # the iteration in which this rank scheduled a grow

    def begin(self, iteration: int) -> None:
        self._delete_keys()
        self.count = 0
        self.iteration = iteration

    def end(self) -> None:
        """The call ends (returned, or left the job): a grow scheduled in its last iteration never
        came, and no next iteration deletes its keys; they go now. Best effort: the store may be
        gone with the job."""
        try:
            self._delete_keys()
        except Exception as e:
            log.debug("grow: could not delete the keys of the grow scheduled in iteration %s: %s: %s",
                      self.scheduled_in, type(e).__name__, e)

    def _delete_keys(self) -> None:
        if self.scheduled_in is not None:
            # Only the rank that scheduled a grow deletes its keys (the iteration keys every restart
            # deletes would cost every job two calls per restart for a feature most do not use).
            for name in ("grow_at", "grow_arrivals"):
                self.protocol.counted.delete_key(self.protocol.key(self.scheduled_in, name))
            self.scheduled_in = None

    def reached(self, active_rank: int | None, active_world_size: int, world_size: int,
                initial_world_size: int, initial_rank: int, wait: Callable[[], None]) -> None:
        """The main thread is at a safe point (outside any ``atomic()`` block)."""
        policy = self.policy
        if policy is None or active_rank is None:
            return
        self.count += 1
        if self.count % policy.check_every:
            return
        p = self.protocol
        key = p.key(self.iteration, "grow_at")
        if active_rank == 0 and world_size < initial_world_size:
            self._maybe_schedule(policy, key)
        raw = p.counted.peek(key)
        if raw is None or int(raw) != self.count:
            return
        arrived = p.counted.add(p.key(self.iteration, "grow_arrivals"), 1)
        if arrived == active_world_size:
            waiting = self.waiting()
            record = FaultRecord.from_exception(initial_rank, self.iteration, GROW, Grow(
                f"{waiting} joiner{'s' if waiting != 1 else ''} waiting, {initial_world_size - world_size} "
                f"seat{'s' if initial_world_size - world_size != 1 else ''} empty"))
            p.report_fault(record)
        self.last_grow_s = time.monotonic()
        wait()  # interrupted by the restart, here, at the safe point

    def waiting(self) -> int:
        p = self.protocol
        return JoinKeys(p.counted, p.call, p.incarnation).waiting()

    def _maybe_schedule(self, policy: GrowPolicy, key: str) -> None:
        if time.monotonic() - self.last_grow_s < policy.min_interval_s:
            return
        waiting = self.waiting()
        if waiting < policy.min_waiting:
            return
        at = str(self.count + policy.check_every)
        self.scheduled_in = self.iteration
        if self.protocol.counted.compare_set(key, "", at).decode() == at:
            log.info("grow: %d joiner(s) wait; the job restarts to take them in at safe point %s of iteration %d",
                     waiting, at, self.iteration)


class Grow(Exception):
    """The cause of a grow, as a fault record names it."""

    def __init__(self, message: str, *args: Any):
        super().__init__(message, *args)
