"""What a rank records of each restart it went through (``CallWrapper.restarts``),
and which of the restart's faults caused it.

Causes and consequences: when a rank fails, its peers often fail too, because
of it: a collective whose peer died raises on every other rank, and a rank
interrupted by the abort may raise on its way out. Those are consequences,
and a log that lists them beside the cause points the reader at the wrong
rank. The rule, applied to the faults a decision carries:

* a fault recorded after the restart was requested (kind ``after_restart``)
  is a consequence, with one exception below;
* a rank's death, seen by its monitor (``killed``, ``exited``,
  ``hard_timeout``, ``unresponsive``), is always a cause;
* in an iteration where a rank died, an exception on another rank that is a
  communication error (torch's ``DistNetworkError``/``DistBackendError``, or a
  message about a closed or reset connection, a timed-out send or receive) is
  a consequence of that death: it may have been recorded first, since the
  peers' connections break before the dead rank's monitor writes its record;
* when every fault recorded first-hand is a communication error and nobody
  died, an ``after_restart`` exception that is not a communication error is a
  cause, and the communication errors of the other ranks are its
  consequences. A communication error needs a peer that went wrong first, and
  a peer's own exception can reach its wrapper after the restart it caused:
  an exception raised just after ``ProcessGroupGloo(...)`` returned destroys
  the new group at once, its peers' first collective fails, and the restart
  they request reaches the rank while its exception is still on its way out
  of the function (seen with an injected exception, about 1 run in 4);
* every other fault is a cause.
"""

from __future__ import annotations

import dataclasses
import re

from ..control.protocol import FaultRecord

DEATHS = frozenset({"killed", "exited", "hard_timeout", "unresponsive"})
_COMMUNICATION_TYPES = frozenset({"DistNetworkError", "DistBackendError", "ConnectionResetError", "BrokenPipeError"})
_COMMUNICATION_TEXT = re.compile(
    r"connection (reset|closed|refused)|closed by peer|broken pipe|end of file|"
    r"timed out waiting .* for (send|recv)|read error|write error|socket",
    re.IGNORECASE,
)


def is_communication_error(type_name: str, message: str) -> bool:
    """An error of the kind a peer's failure causes (a closed or reset connection, a timed-out transfer)."""
    return type_name in _COMMUNICATION_TYPES or bool(_COMMUNICATION_TEXT.search(message))


def _is_communication(fault: FaultRecord) -> bool:
    return is_communication_error(fault.type, fault.message)


def _is_late_cause(fault: FaultRecord, faults: list[FaultRecord]) -> bool:
    """An ``after_restart`` fault that is the iteration's cause (module docstring: the rule)."""
    if fault.kind != "after_restart" or _is_communication(fault):
        return False
    first_hand = [f for f in faults if f.kind != "after_restart"]
    return all(f.kind == "exception" and _is_communication(f) for f in first_hand)


def is_consequence(fault: FaultRecord, faults: list[FaultRecord]) -> bool:
    """``fault`` was caused by another fault of ``faults`` (module docstring: the rule)."""
    if fault.kind == "after_restart":
        return not _is_late_cause(fault, faults)
    if fault.kind != "exception" or not _is_communication(fault):
        return False
    return any(f.rank != fault.rank and (f.kind in DEATHS or _is_late_cause(f, faults)) for f in faults)


def _cause_kind(fault: FaultRecord) -> str:
    return "exception (out after the restart began)" if fault.kind == "after_restart" else fault.kind


@dataclasses.dataclass
class RestartRecord:
    """One restart as this rank saw it (timestamps: CLOCK_MONOTONIC ns of this host).

    ``CallWrapper.restarts`` lists them, oldest first, for the function to read
    (the demo prints them). ``faults`` holds up to 32 of the failed
    iteration's fault records, ``n_faults`` how many there were;
    ``causes``/``consequences`` split them (module docstring).
    """

    iteration: int  # the iteration that failed
    faults: list[FaultRecord]
    n_faults: int
    terminated: list[int]  # initial ranks that left the job at this restart
    fault_ns: int = 0  # earliest fault recorded on this host, else 0
    detected_ns: int = 0  # this rank learnt of the restart
    aborted_ns: int = 0  # the abort hook returned
    finalized_ns: int = 0
    health_checked_ns: int = 0
    decided_ns: int = 0  # the new membership was known
    initialized_ns: int = 0  # initialize returned in the next iteration (0 on a spare)
    assignment_ns: int = 0  # duration of the rank assignment on the leader
    activated: list[int] = dataclasses.field(default_factory=list)  # spares (initial ranks) made active
    joined: list[int] = dataclasses.field(default_factory=list)  # seats (initial ranks) that new processes joined
    repeats: int = 1  # restarts in a row with the same cause, this one included (engine/storm.py)
    repeated_on_rank: int | None = None  # the one rank that cause was on every time, if one
    backoff_s: float = 0.0  # the wait before the next iteration: a restart storm (engine/storm.py)

    @property
    def duration_s(self) -> float:
        """Fault (or detection, for faults on other hosts) to resumption, in seconds (a restart storm's
        back-off, ``backoff_s``, included once the next iteration has started)."""
        start = self.fault_ns or self.detected_ns
        end = self.initialized_ns or self.decided_ns
        return max(0, end - start) / 1e9

    @property
    def causes(self) -> list[FaultRecord]:
        return [f for f in self.faults if not is_consequence(f, self.faults)]

    @property
    def consequences(self) -> list[FaultRecord]:
        return [f for f in self.faults if is_consequence(f, self.faults)]

    def phases_ms(self) -> dict[str, float]:
        """How long each phase of the restart took on this rank, in ms."""
        marks = [("abort", self.detected_ns, self.aborted_ns), ("finalize", self.aborted_ns, self.finalized_ns),
                 ("health_check", self.finalized_ns, self.health_checked_ns),
                 ("barrier", self.health_checked_ns, self.decided_ns)]
        return {name: max(0, end - start) / 1e6 for name, start, end in marks if start and end}

    def repeat_note(self) -> str:
        """How many times in a row this restart's cause came: from the second time when it was on one and
        the same rank every time, else from the third ("" before)."""
        rank = self.repeated_on_rank
        if self.repeats < (2 if rank is not None else 3):
            return ""
        if rank is not None and self.causes and all(f.kind == "soft_timeout" for f in self.causes):
            return f"the same rank ({rank}) timed out {self.repeats} times in a row"
        where = f" (on rank {rank} each time)" if rank is not None else ""
        return f"the same cause {self.repeats} times in a row{where}"

    def summary(self, active_world_size: int, world_size: int) -> str:
        """One line: the causes first, then consequences, who left, spares activated, time, slowest phase."""
        causes = "; ".join(f"rank {f.rank} {_cause_kind(f)}: {f.type}: {f.message}" for f in self.causes)
        causes = causes or "none recorded"
        grow = bool(self.causes) and all(f.kind == "grow" for f in self.causes)
        text = f"{'grow' if grow else 'restart'} after iteration {self.iteration}: cause: {causes}"
        if self.consequences:
            text += "; consequences (not causes): " + "; ".join(f"rank {f.rank} {f.type}" for f in self.consequences)
        if self.n_faults > len(self.faults):
            text += f" (+{self.n_faults - len(self.faults)} more fault records)"
        if self.repeat_note():
            text += f"; {self.repeat_note()}"
        text += f"; excluded: {self.terminated or 'none'}"
        if self.joined:
            text += f"; joined (new processes): {self.joined}"
        if self.activated:
            text += f"; spares activated: {self.activated}"
        text += f"; now {active_world_size} active of {world_size}; {self.duration_s * 1e3:.0f} ms to the decision"
        phases = self.phases_ms()
        if phases:
            slowest = max(phases, key=lambda name: phases[name])
            text += f" (slowest phase: {slowest.replace('_', ' ')}, {phases[slowest]:.0f} ms)"
        return text
