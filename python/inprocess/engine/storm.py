"""A brake on restart storms: the same cause, restart after restart, in quick succession.

A restart here takes tens of milliseconds. A job whose every iteration fails
at once for the same reason (a store hosted by a rank that died, a file that
is missing, a step that never pings) would restart hundreds of times a second
and fill its log, where nvidia_resiliency_ext's restarts, a second or more
each, merely repeated. Nothing ends such a job by default (as there: the
default has no iteration limit), so this module slows it down and says why:

* **Same cause.** Each cause of a restart (``RestartRecord.causes``) is
  reduced to a signature: its kind (an exception out after the restart began
  counts as an exception), its exception type, and the shape of its message
  (numbers, addresses and pids replaced by ``#``). Two restarts have the
  same cause when their signatures share one; a run is a sequence of
  restarts, one after the other, sharing a signature. The rank is not part
  of it: a dead store fails whichever rank reaches it first.
* **Quick succession.** A restart is quick when its decision came at most
  ``within_s`` after the previous decision (the initial barrier's for the
  first restart), the back-off excluded. Both times are the leaders'
  monotonic clocks as written in the decisions, which every rank reads
  alike: every rank reaches the same verdict, so all of them back off by the
  same amount and none waits at a rendezvous for another.
* **Storm.** ``repeats`` quick restarts in a row with the same cause. From
  then on every rank waits before its next iteration: ``first_backoff_s``,
  doubling with each further quick repeat, up to ``max_backoff_s``, for as
  long as the cause repeats. The job goes on; it is not ended, as
  nvidia_resiliency_ext's would not be: to end it, give the ``Wrapper`` an
  ``initialize=RetryController(max_iterations=N)``, which ends it at that
  iteration whatever the cause.
* **Logs.** The lowest active rank logs one WARNING when a storm starts,
  naming the cause, what it means where it is recognised, and the remedies.
  While it lasts, the per-restart lines (every rank's INFO line, the summary
  WARNING) go to DEBUG, and a reminder with the count is logged at most once
  per ``report_every_s``. A restart with another cause is logged as usual.

``repeats`` of the same cause are counted whatever the pace, and a restart's
summary says so (``the same cause 4 times in a row``): a function blocked
past ``soft_timeout`` on every iteration restarts every ``soft_timeout`` for
ever, which is too slow for a storm but worth saying.

``INPROCESS_RESTART_STORM`` overrides the limits:
``repeats=3,within=60s,backoff=1s..30s,report=300s`` (any subset), or
``off`` (no back-off, no quieting; the repeat count stays in the summary).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
from typing import Mapping, Optional

from ..control.records import FaultRecord
from .restart_record import RestartRecord, is_communication_error

log = logging.getLogger("inprocess")

ENV_VAR = "INPROCESS_RESTART_STORM"

Signature = tuple[str, str, str]  # kind, exception type, message shape

_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|[0-9]+(?:\.[0-9]+)?")
_SHAPE_CHARS = 160


def message_shape(message: str) -> str:
    """``message`` without what differs between two occurrences of one error (numbers, pids, ports, addresses)."""
    return " ".join(_NUMBERS.sub("#", message).split())[:_SHAPE_CHARS]


def signature(fault: FaultRecord) -> Signature:
    kind = "exception" if fault.kind == "after_restart" else fault.kind
    return kind, fault.type, message_shape(fault.message)


def signatures(record: RestartRecord) -> frozenset[Signature]:
    """The signatures of a restart's causes; a restart without a recorded cause has one of its own."""
    causes = record.causes
    if causes and all(f.kind == "grow" for f in causes):
        return frozenset()  # a grow (engine/grow.py) is no fault: it never counts, and ends a run of repeats
    if not causes:
        return frozenset({("none recorded", "", "")})
    return frozenset(signature(f) for f in causes)


@dataclasses.dataclass(frozen=True)
class StormLimits:
    """When a run of restarts is a storm, and how hard the brake is (module docstring)."""

    repeats: int = 3
    within_s: float = 60.0
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    report_every_s: float = 300.0
    enabled: bool = True

    def __post_init__(self) -> None:
        repeats: object = self.repeats  # checked at run time too: the dataclass takes anything
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 2:
            raise ValueError(f"repeats={self.repeats!r}: expected an integer >= 2 (restarts in a row)")
        for name in ("within_s", "first_backoff_s", "max_backoff_s", "report_every_s"):
            value: object = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name}={value!r}: expected a finite number of seconds >= 0")
        if self.first_backoff_s > self.max_backoff_s:
            raise ValueError(f"backoff={self.first_backoff_s:g}s..{self.max_backoff_s:g}s: the first back-off "
                             "is longer than the longest")

    def backoff_s(self, quick_repeats: int) -> float:
        """The wait before the next iteration after ``quick_repeats`` quick restarts in a row with one cause."""
        if not self.enabled or quick_repeats < self.repeats:
            return 0.0
        doublings = min(quick_repeats - self.repeats, 64)
        return float(min(self.max_backoff_s, self.first_backoff_s * 2.0 ** doublings))

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> "StormLimits":
        """The limits ``INPROCESS_RESTART_STORM`` sets (the defaults when unset); ValueError naming a bad part."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        if not text:
            return cls()
        if text.lower() == "off":
            return cls(enabled=False)
        fields: dict[str, float | int] = {}
        for part in (p.strip() for p in text.split(",")):
            name, _, value = part.partition("=")
            name = name.strip().lower()
            try:
                if name == "repeats":
                    fields["repeats"] = int(value)
                elif name == "within":
                    fields["within_s"] = _seconds(value)
                elif name == "report":
                    fields["report_every_s"] = _seconds(value)
                elif name == "backoff":
                    first, _, longest = value.partition("..")
                    fields["first_backoff_s"] = _seconds(first)
                    fields["max_backoff_s"] = _seconds(longest) if longest else fields["first_backoff_s"]
                else:
                    raise ValueError("expected repeats=N, within=DURATION, backoff=DURATION..DURATION, "
                                     "report=DURATION, or the whole value 'off'")
            except ValueError as e:
                raise ValueError(f"{ENV_VAR}={text!r}: {part!r}: {e}") from None
        try:
            return cls(**fields)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"{ENV_VAR}={text!r}: {e}") from None


_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m)?\s*")


def _seconds(text: str) -> float:
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text.strip()!r} is not a duration (e.g. 500ms, 2s, 1.5m)")
    unit = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]
    return float(match.group(1)) * unit


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the brake makes of one restart."""

    repeats: int  # restarts in a row with this restart's cause, this one included (any pace)
    quick_repeats: int  # of those, the last ones in quick succession
    backoff_s: float  # the wait before the next iteration
    log: str  # "usual" (the usual lines), "storm" (the storm starts), "reminder", or "quiet"
    causes: tuple[FaultRecord, ...]  # the causes the run shares (one per signature)


class StormBrake:
    """Follows the restarts of one call on one rank (every rank reaches the same verdicts)."""

    def __init__(self, limits: StormLimits):
        self.limits = limits
        self._common: frozenset[Signature] = frozenset()
        self._ranks: frozenset[int] = frozenset()  # the ranks the shared cause was on, every time
        self._repeats = 0
        self._quick = 0
        self._previous: Optional[tuple[str, int]] = None  # (host, t_ns) of the last decision
        self._backoff_s = 0.0  # the back-off that followed the last decision
        self._storm_since = 0.0  # time.monotonic() of this rank when the storm was declared
        self._last_report = 0.0
        self._quiet = 0  # per-restart lines sent to DEBUG since the last report

    @property
    def in_storm(self) -> bool:
        return self.limits.enabled and self._quick >= self.limits.repeats

    def started(self, decision_host: str, decision_t_ns: int) -> None:
        """The initial barrier's decision: the first restart's pace is counted from it."""
        self._previous = (decision_host, decision_t_ns)

    def observe(self, record: RestartRecord, decision_host: str, decision_t_ns: int) -> Verdict:
        """After each restart's decision, on every rank: the verdict, from what every rank reads alike."""
        sigs = signatures(record)
        quick = self._is_quick(decision_host, decision_t_ns)
        self._previous = (decision_host, decision_t_ns)
        shared = self._common & sigs
        was_storm = self.in_storm
        if self._repeats and shared:
            self._common = shared
            self._repeats += 1
            self._quick = self._quick + 1 if quick else 1
        else:
            self._common, self._repeats, self._quick = sigs, 1, 1
            self._ranks = frozenset(f.rank for f in record.causes)
        self._backoff_s = self.limits.backoff_s(self._quick)
        causes = tuple({signature(f): f for f in reversed(record.causes) if signature(f) in self._common}.values())
        self._ranks &= {f.rank for f in causes}
        record.repeats = self._repeats
        record.backoff_s = self._backoff_s
        record.repeated_on_rank = next(iter(self._ranks)) if len(self._ranks) == 1 else None
        now = time.monotonic()
        if not self.in_storm:
            kind = "usual"
        elif not was_storm:
            kind = "storm"
            self._storm_since = self._last_report = now
            self._quiet = 0
        elif now - self._last_report >= self.limits.report_every_s:
            kind = "reminder"
            self._last_report = now
        else:
            kind = "quiet"
        return Verdict(self._repeats, self._quick, self._backoff_s, kind, causes)

    def _is_quick(self, host: str, t_ns: int) -> bool:
        if self._previous is None or not t_ns or self._previous[0] != host or not self._previous[1]:
            return True  # the leaders' clocks cannot be compared: the repeat alone counts
        gap_s = (t_ns - self._previous[1]) / 1e9 - self._backoff_s
        return gap_s <= self.limits.within_s

    def log_restart(self, verdict: Verdict, record: RestartRecord, initial_rank: int, summary: Optional[str]) -> None:
        """The restart's lines on this rank: ``summary`` is the restart's WARNING (lowest active rank only)."""
        phases = ", ".join(f"{k.replace('_', ' ')} {v:.0f} ms" for k, v in record.phases_ms().items())
        line = (f"rank {initial_rank}: restarted after iteration {record.iteration} in "
                f"{record.duration_s * 1e3:.0f} ms ({phases})")
        quiet = verdict.log in ("quiet", "reminder", "storm") and self.limits.enabled
        log.log(logging.DEBUG if quiet else logging.INFO, "%s", line)
        if summary is None:
            return
        if not quiet:
            log.warning("%s", summary)
            return
        log.debug("%s", summary)
        if verdict.log == "storm":
            log.warning("%s", self.storm_warning(verdict))
        elif verdict.log == "reminder":
            minutes = (time.monotonic() - self._storm_since) / 60
            log.warning("restart storm goes on: %d restarts in a row with the same cause (%s) in %.1f min, "
                        "%d of them not logged since the last report; waiting %s before each restart",
                        verdict.repeats, describe_causes(verdict.causes), minutes, self._quiet,
                        _duration(verdict.backoff_s))
            self._quiet = 0
        else:
            self._quiet += 1

    def storm_warning(self, verdict: Verdict) -> str:
        limits = self.limits
        return (f"restart storm: {verdict.repeats} restarts in a row with the same cause, each within "
                f"{_duration(limits.within_s)} of the last: {describe_causes(verdict.causes)}. "
                f"{remedy(verdict.causes)} Until the cause changes, every rank now waits "
                f"{_duration(verdict.backoff_s)} before the next restart, doubling up to "
                f"{_duration(limits.max_backoff_s)}, and each restart is logged at DEBUG level (a reminder every "
                f"{_duration(limits.report_every_s)}). To end the job instead, give the Wrapper "
                f"initialize=inprocess.initialize.RetryController(max_iterations=N); {ENV_VAR} sets these limits "
                "(README, \"Configuration and timeouts\").")

    def wait(self, verdict: Verdict) -> None:
        """The back-off, before the next iteration (every rank waits the same)."""
        if verdict.backoff_s > 0:
            time.sleep(verdict.backoff_s)


def describe_causes(causes: tuple[FaultRecord, ...]) -> str:
    if not causes:
        return "no fault recorded"
    return "; ".join(f"rank {f.rank} {signature(f)[0]}: {f.type}: {f.message[:200]}" for f in causes)


def remedy(causes: tuple[FaultRecord, ...]) -> str:
    """What a user can do about a cause that repeats, where the cause is recognised."""
    if causes and all(f.kind == "soft_timeout" for f in causes):
        return ("The function makes no progress for soft_timeout on every iteration: call call_wrapper.ping() "
                "within long steps, or raise soft_timeout.")
    if any(_is_store_lost(f) for f in causes):
        return ("A store the function reaches is gone: a store hosted by one rank (a torch TCPStore created with "
                "is_master=True in that rank's process) dies with that rank, and no restart brings it back; use "
                "call_wrapper.store, served by the store host process, which outlives any rank.")
    return "The function fails the same way every time it starts: no restart will fix that; fix the cause."


def _is_store_lost(fault: FaultRecord) -> bool:
    text = f"{fault.type} {fault.message}".lower()
    return is_communication_error(fault.type, fault.message) and (
        "store" in text or "refused" in text or "broken pipe" in text)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:g} s"
