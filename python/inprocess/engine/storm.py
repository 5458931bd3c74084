"""A brake on restart storms: restart after restart, in quick succession, with no progress in between.

A restart here takes tens of milliseconds. A job whose every iteration fails
at once (a store hosted by a rank that died, a file that is missing, a step
that never pings) would restart hundreds of times a second and fill its log,
where nvidia_resiliency_ext's restarts, a second or more each, merely
repeated. Nothing ends such a job by default (as there: the default has no
iteration limit), so this module slows it down and says why. Independent
faults with training in between (different ranks or nodes failing within a
minute of each other on a large cluster) are no storm and are never braked.

* **Progress.** An iteration made progress when its function reported at
  least ``MIN_STEPS`` steps on a rank (``ping()``, ``atomic()`` and
  ``safe_point()`` each report one: one whole step, whichever end of a step
  the function reports at), or when it ran at least ``MIN_RUN_S`` and at
  least ``run_ratio`` times as long as the restart that ended it took (a
  function that reports no steps: it ran longer than it restarted). "Ran" is
  from the iteration's start to the moment the restart reached the main
  thread; "the restart" from there to the decision.
* **One measure, every rank alike.** Before the barrier, each of the first
  ``REPORTERS`` active ranks that made progress adds 1 to the failed
  iteration's ``progress`` key (at most ``REPORTERS`` store calls per
  restart, whatever the world size). The barrier's leader reads the count,
  measures the iteration on itself (its own steps, how long it ran, how long
  the restart took), judges, and writes the result into the decision
  (``Decision.progress``). Every rank, a process admitted at that barrier
  included, reads the same and reaches the same verdict: all back off by the
  same amount and none waits at a rendezvous for another. (One rank's count
  would not do: NVRx's examples report a step only on rank 0, under
  ``atomic()``, and the leader is often the rank that failed.)
* **Stall.** A restart without progress whose decision came at most
  ``within_s`` after the previous decision (the initial barrier's for the
  first restart), the back-off excluded, on the same leader host (two hosts'
  monotonic clocks cannot be compared: then the pace is not judged).
* **Storm.** ``repeats`` stalls in a row, whatever their causes. From then
  on every rank waits before its next iteration: ``first_backoff_s``,
  doubling with each further stall, up to ``max_backoff_s``, until an
  iteration makes progress. The job goes on; it is not ended, as
  nvidia_resiliency_ext's would not be: to end it, give the ``Wrapper`` an
  ``initialize=RetryController(max_iterations=N)``, which ends it at that
  iteration whatever the cause.
* **Logs.** The lowest active rank logs one WARNING when a storm starts,
  saying what was seen (the steps, how long each iteration ran against its
  restart, whether the cause and the rank were the same every time), what
  the cause means where it is recognised, and the remedies. While it lasts,
  the per-restart lines (every rank's INFO line, the summary WARNING) go to
  DEBUG, and a reminder with the count is logged at most once per
  ``report_every_s``. A restart that made progress is logged as usual.

Restarts with the same cause are counted too, whatever the pace and the
progress, and a restart's summary says so (``the same cause 4 times in a
row``): each cause (``RestartRecord.causes``) is reduced to a signature (its
kind, an exception out after the restart began counting as an exception; its
exception type; the shape of its message, numbers, addresses and pids
replaced by ``#``). A function blocked past ``soft_timeout`` on every
iteration restarts every ``soft_timeout`` for ever, which is too slow for a
storm but worth saying.

``INPROCESS_RESTART_STORM`` overrides the limits:
``repeats=3,within=60s,backoff=1s..30s,report=300s,run=1x`` (any subset), or
``off`` (no back-off, no quieting; the repeat count stays in the summary).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from ..control.phases import Phase
from ..control.protocol import RestartProtocol
from ..control.records import HOST, Decision, FaultRecord
from ..state import Mode, State
from .restart_record import RestartRecord, is_communication_error

log = logging.getLogger("inprocess")

ENV_VAR = "INPROCESS_RESTART_STORM"
MIN_STEPS = 2  # steps reported on a rank in an iteration that make it progress (module docstring)
MIN_RUN_S = 0.1  # and run_ratio: how long an iteration without steps must run to have progressed
REPORTERS = 8  # the first active ranks, which tell the leader whether they made progress

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
    """When restarts without progress are a storm, and how hard the brake is (module docstring)."""

    repeats: int = 3
    within_s: float = 60.0
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    report_every_s: float = 300.0
    run_ratio: float = 1.0
    enabled: bool = True

    def __post_init__(self) -> None:
        repeats: object = self.repeats  # checked at run time too: the dataclass takes anything
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 2:
            raise ValueError(f"repeats={self.repeats!r}: expected an integer >= 2 (restarts in a row)")
        for name in ("within_s", "first_backoff_s", "max_backoff_s", "report_every_s", "run_ratio"):
            value: object = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{name}={value!r}: expected a finite number >= 0")
        if self.first_backoff_s > self.max_backoff_s:
            raise ValueError(f"backoff={self.first_backoff_s:g}s..{self.max_backoff_s:g}s: the first back-off "
                             "is longer than the longest")

    def backoff_s(self, stalls: int) -> float:
        """The wait before the next iteration after ``stalls`` restarts in a row without progress."""
        if not self.enabled or stalls < self.repeats:
            return 0.0
        doublings = min(stalls - self.repeats, 64)
        return float(min(self.max_backoff_s, self.first_backoff_s * 2.0 ** doublings))

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> StormLimits:
        """The limits ``INPROCESS_RESTART_STORM`` sets (the defaults when unset); ValueError naming a bad part."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        if not text:
            return cls()
        if text.lower() == "off":
            return cls(enabled=False)
        fields: dict[str, float | int] = {}
        for part in (p.strip() for p in text.split(",")):
            name, _, value = part.partition("=")
            try:
                fields.update(_limit_field(name.strip().lower(), value))
            except ValueError as e:
                raise ValueError(f"{ENV_VAR}={text!r}: {part!r}: {e}") from None
        try:
            return cls(**fields)  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"{ENV_VAR}={text!r}: {e}") from None


def _limit_field(name: str, value: str) -> dict[str, float | int]:
    """The field(s) one ``name=value`` part of ``INPROCESS_RESTART_STORM`` sets."""
    if name == "repeats":
        return {"repeats": int(value)}
    if name == "within":
        return {"within_s": _seconds(value)}
    if name == "report":
        return {"report_every_s": _seconds(value)}
    if name == "run":
        ratio = value.strip().removesuffix("x").strip()
        try:
            return {"run_ratio": float(ratio)}
        except ValueError:
            raise ValueError(f"{value.strip()!r} is not a ratio (e.g. 1x, 0.5x)") from None
    if name == "backoff":
        first, _, longest = value.partition("..")
        return {"first_backoff_s": _seconds(first), "max_backoff_s": _seconds(longest or first)}
    raise ValueError("expected repeats=N, within=DURATION, backoff=DURATION..DURATION, report=DURATION, "
                     "run=RATIO (e.g. 1x), or the whole value 'off'")


_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m)?\s*")


def _seconds(text: str) -> float:
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text.strip()!r} is not a duration (e.g. 500ms, 2s, 1.5m)")
    unit = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]
    return float(match.group(1)) * unit


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a restart's leader measured of the iteration that failed, and its judgement; the decision
    carries it (``Decision.progress``) so that every rank reads the same."""

    stalls: int  # restarts in a row without progress, this one included (0: this one made progress)
    reported: int  # of the first REPORTERS active ranks, how many made progress
    steps: int  # steps the leader reported in the iteration (-1: it was a spare, it ran no function)
    ran_ms: int  # from the iteration's start to the restart reaching the leader's main thread
    restart_ms: int  # from there to the decision

    def fields(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any] | None) -> Progress | None:
        """From a decision's ``progress`` (None when it has none: a decision of barrier 0)."""
        if fields is None:
            return None
        try:
            return cls(**{f.name: int(fields[f.name]) for f in dataclasses.fields(cls)})
        except (KeyError, TypeError, ValueError):
            return None

    def describe(self) -> str:
        steps = "a spare" if self.steps < 0 else f"{self.steps} step{'s' if self.steps != 1 else ''}"
        return f"ran {_ms(self.ran_ms)} ({steps}), restart {_ms(self.restart_ms)}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the brake makes of one restart."""

    repeats: int  # restarts in a row with this restart's cause, this one included (any pace, any progress)
    stalls: int  # restarts in a row without progress, this one included
    backoff_s: float  # the wait before the next iteration
    log: str  # "usual" (the usual lines), "storm" (the storm starts), "reminder", or "quiet"
    causes: tuple[FaultRecord, ...]  # the causes the run of repeats shares (one per signature)


@dataclasses.dataclass
class _Stall:
    """One restart of a run without progress, as the storm warning describes it."""

    progress: Progress
    signatures: frozenset[Signature]
    ranks: frozenset[int]
    causes: tuple[FaultRecord, ...]


def progress_key(protocol: RestartProtocol, iteration: int) -> str:
    """``<i>/progress``: how many reporters made progress in iteration i (deleted with i's keys)."""
    return protocol.key(iteration, "progress")


class StormBrake:
    """Follows the restarts of one call on one rank; every rank reaches the same verdicts.

    The rank measures its own iterations (:meth:`step`, :meth:`phase_entered`);
    as a barrier's leader it judges the iteration that failed (:meth:`judge`)
    for the decision, and every rank then takes the decision's judgement
    (:meth:`observe`).
    """

    def __init__(self, limits: StormLimits):
        self.limits = limits
        # The same cause, restart after restart (the summary's count).
        self._common: frozenset[Signature] = frozenset()
        self._ranks: frozenset[int] = frozenset()  # the ranks the shared cause was on, every time
        self._repeats = 0
        # This rank's measure of the iteration running now.
        self._steps = 0
        self._active = False
        self._reporter = False  # one of the first REPORTERS active ranks
        self._started_ns = 0
        self._restart_ns = 0
        # The judgement, as the last decision carried it.
        self._stalls = 0
        self._run: collections.deque[_Stall] = collections.deque(maxlen=limits.repeats)
        self._previous: tuple[str, int] | None = None  # (host, t_ns) of the last decision
        self._backoff_s = 0.0  # the back-off that followed the last decision
        self._storm_since = 0.0  # time.monotonic() of this rank when the storm was declared
        self._last_report = 0.0
        self._quiet = 0  # per-restart lines sent to DEBUG since the last report

    @property
    def backoff_s(self) -> float:
        """The wait that follows the last decision (0 outside a storm)."""
        return self._backoff_s

    @property
    def in_storm(self) -> bool:
        return self.limits.enabled and self._stalls >= self.limits.repeats

    # -- this rank's measure ----------------------------------------------------------------

    def step(self) -> None:
        """The function reported a step (``ping()``, ``atomic()``, ``safe_point()``)."""
        self._steps += 1

    def phase_entered(self, phase: Phase, state: State, protocol: RestartProtocol | None) -> None:
        """The rank entered ``phase``: RUNNING starts an iteration (the function, or a spare's wait),
        ABORTING is the restart reaching the main thread, and at RESTART_BARRIER a reporter that made
        progress says so in ``protocol``'s store."""
        if phase == Phase.RUNNING:
            self._steps, self._started_ns, self._restart_ns = 0, time.monotonic_ns(), 0
            self._active = state.mode == Mode.ACTIVE
            self._reporter = self._active and state.active_rank is not None and state.active_rank < REPORTERS
        elif phase == Phase.ABORTING and not self._restart_ns:
            self._restart_ns = time.monotonic_ns()
        elif phase == Phase.RESTART_BARRIER and protocol is not None and self._reporter \
                and self._steps >= MIN_STEPS:
            self._reporter = False  # once per iteration
            try:
                protocol.counted.add(progress_key(protocol, state.iteration), 1)
            except Exception as e:  # the store is gone: the barrier says so
                log.debug("could not report progress of iteration %d: %s", state.iteration, e)

    def judge(self, protocol: RestartProtocol | None = None, iteration: int = 0, host: str = HOST,
              t_ns: int | None = None) -> Progress:
        """The iteration ``iteration`` that failed, as the reporters (read in ``protocol``'s store) and
        this rank measured it, judged against the decision of (``host``, ``t_ns``), by default one this
        rank makes now: the leader's entry for its decision."""
        reported = protocol.counted.add(progress_key(protocol, iteration), 0) if protocol is not None else 0
        now = time.monotonic_ns()
        restart_at = self._restart_ns or now
        ran_ns = max(0, restart_at - self._started_ns) if self._started_ns else 0
        steps = self._steps if self._active else -1
        return self.judge_measured(reported, steps, ran_ns, max(0, now - restart_at), host,
                                   now if t_ns is None else t_ns)

    def judge_measured(self, reported: int, steps: int, ran_ns: int, restart_ns: int, host: str,
                       t_ns: int) -> Progress:
        """The judgement of an iteration in which ``reported`` reporters made progress, that reported
        ``steps`` here (-1: a spare's), ran ``ran_ns`` and restarted in ``restart_ns``, for a decision of
        ``host`` at ``t_ns`` (its monotonic clock)."""
        ran_long = ran_ns >= max(MIN_RUN_S * 1e9, self.limits.run_ratio * restart_ns)
        progressed = reported > 0 or steps >= MIN_STEPS or ran_long
        stalls = 0 if progressed or not self._is_quick(host, t_ns) else self._stalls + 1
        return Progress(stalls, reported, steps, ran_ns // 1_000_000, restart_ns // 1_000_000)

    # -- the decisions ------------------------------------------------------------------------

    def started(self, decision: Decision) -> None:
        """The decision this rank entered the job with (barrier 0's, or a joiner's admission):
        the first restart's pace is counted from it, and a joiner takes the job's stall count."""
        self._previous = (decision.host, decision.t_ns)
        progress = Progress.from_fields(decision.progress)
        if progress is not None:
            self._stalls = progress.stalls
            self._backoff_s = self.limits.backoff_s(progress.stalls)
            self._storm_since = self._last_report = time.monotonic()  # declared before it came: a reminder later

    def observe(self, record: RestartRecord, decision: Decision) -> Verdict:
        """After each restart's decision, on every rank: the verdict, from what every rank reads alike."""
        progress = Progress.from_fields(decision.progress) or self.judge(host=decision.host, t_ns=decision.t_ns)
        self._previous = (decision.host, decision.t_ns)
        was_storm = self.in_storm
        self._stalls = progress.stalls
        causes = self._count_repeats(record)
        if progress.stalls:
            self._run.append(_Stall(progress, signatures(record), frozenset(f.rank for f in record.causes),
                                    tuple(record.causes)))
        else:
            self._run.clear()
        self._backoff_s = self.limits.backoff_s(progress.stalls)
        record.backoff_s = self._backoff_s
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
        return Verdict(self._repeats, progress.stalls, self._backoff_s, kind, causes)

    def _count_repeats(self, record: RestartRecord) -> tuple[FaultRecord, ...]:
        """Restarts in a row with this one's cause (the summary's note): the causes the run shares."""
        sigs = signatures(record)
        shared = self._common & sigs
        if self._repeats and shared:
            self._common = shared
            self._repeats += 1
        else:
            self._common, self._repeats = sigs, 1
            self._ranks = frozenset(f.rank for f in record.causes)
        causes = tuple({signature(f): f for f in reversed(record.causes) if signature(f) in self._common}.values())
        self._ranks &= {f.rank for f in causes}
        record.repeats = self._repeats
        record.repeated_on_rank = next(iter(self._ranks)) if len(self._ranks) == 1 else None
        return causes

    def _is_quick(self, host: str, t_ns: int) -> bool:
        if self._previous is None or not t_ns or self._previous[0] != host or not self._previous[1]:
            return True  # the leaders' clocks cannot be compared: the progress alone counts
        gap_s = (t_ns - self._previous[1]) / 1e9 - self._backoff_s
        return gap_s <= self.limits.within_s

    # -- logs and the wait ------------------------------------------------------------------

    def log_restart(self, verdict: Verdict, record: RestartRecord, initial_rank: int, summary: str | None) -> None:
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
            last = self._run[-1].causes if self._run else ()
            log.warning("restart storm goes on: %d restarts in a row without progress (the last: %s) in %.1f min, "
                        "%d of them not logged since the last report; waiting %s before each restart",
                        verdict.stalls, describe_causes(last), minutes, self._quiet, _duration(verdict.backoff_s))
            self._quiet = 0
        else:
            self._quiet += 1

    def storm_warning(self, verdict: Verdict) -> str:
        limits = self.limits
        run = list(self._run)
        return (f"restart storm: {verdict.stalls} restarts in a row without progress, each within "
                f"{_duration(limits.within_s)} of the last: {describe_run(run)}. {remedy_for_run(run)} Until an "
                f"iteration makes progress, every rank now waits {_duration(verdict.backoff_s)} before the next "
                f"restart, doubling up to {_duration(limits.max_backoff_s)}, and each restart is logged at DEBUG "
                f"level (a reminder every {_duration(limits.report_every_s)}). To end the job instead, give the "
                f"Wrapper initialize=inprocess.initialize.RetryController(max_iterations=N); {ENV_VAR} sets these "
                "limits (README, \"Configuration and timeouts\").")

    def wait(self, verdict: Verdict) -> None:
        """The back-off, before the next iteration (every rank waits the same)."""
        if verdict.backoff_s > 0:
            time.sleep(verdict.backoff_s)


def describe_run(run: list[_Stall]) -> str:
    """What a run of restarts without progress looked like: the steps, how long each iteration ran
    against its restart, and whether the cause and the rank were the same each time."""
    if not run:
        return "no restart recorded"
    spares = all(s.progress.steps < 0 for s in run)
    steps = (f"no rank reported {MIN_STEPS} steps (ping(), atomic(), safe_point()) in any of them" +
             (" (the leaders were spares)" if spares else ""))
    times = ", ".join(f"{_ms(s.progress.ran_ms)} against {_ms(s.progress.restart_ms)}" for s in run)
    text = (f"{steps}, and each iteration ran for less than {_duration(MIN_RUN_S)} or less time than its restart "
            f"took ({times})")
    common = frozenset.intersection(*(s.signatures for s in run))
    ranks = frozenset.union(*(s.ranks for s in run))
    last = run[-1].causes
    if common:
        same = tuple(f for f in last if signature(f) in common)
        where = f"on rank {next(iter(ranks))} each time" if len(ranks) == 1 else \
            f"on ranks {', '.join(map(str, sorted(ranks)))}"
        return f"{text}; the same cause each time, {where}: {describe_causes(same)}"
    return f"{text}; different causes (on ranks {', '.join(map(str, sorted(ranks))) or 'none'}), the last: " \
           f"{describe_causes(last)}"


def describe_causes(causes: tuple[FaultRecord, ...]) -> str:
    if not causes:
        return "no fault recorded"
    return "; ".join(f"rank {f.rank} {signature(f)[0]}: {f.type}: {f.message[:200]}" for f in causes)


def remedy_for_run(run: list[_Stall]) -> str:
    """What a user can do about a run of restarts without progress."""
    if run and frozenset.intersection(*(s.signatures for s in run)):
        return remedy(run[-1].causes)
    return ("Every iteration fails before the function gets anywhere, each time for another reason: the first "
            "cause is the one to fix.")


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


def _ms(ms: int) -> str:
    return f"{ms} ms" if ms < 10_000 else f"{ms / 1e3:.1f} s"
