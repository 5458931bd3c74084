"""A fault plan: which fault, on which initial ranks, at which step or after which delay, in which iterations.

The compact text form (what ``INPROCESS_FAULTS`` holds)::

    plan     := entry (";" entry)*
    entry    := "seed=" INT  |  KIND "@" field ("," field)*
    field    := "rank=" RANKS | "step=" STEPS | "after=" DELAY | "phase=" PHASE | "iteration=" ITERATIONS
              | "code=" INT          (os_exit only: the exit status, 0..255; default 1)
              | "for=" DURATION      (hang, gil_hang, gpu_sleep: how long; default until killed)
    RANKS    := INT ("|" INT)*  |  "*"  |  "random"  |  "random:" INT
    STEPS    := INT  |  INT ".." INT
    DELAY    := DURATION  |  DURATION ".." DURATION
    ITERATIONS := INT ("|" INT)*  |  "*"          (default 0: the first iteration only)
    PHASE    := "entry" | "initialize" | "abort" | "finalize" | "health_check" | "barrier" | "reassignment"
              | "takeover"
    DURATION := DIGITS ["." DIGITS] ("ms" | "s" | "m" | "h")

``rank`` and exactly one of ``step``, ``after`` or ``phase`` are required.
A ``phase`` fault fires when the rank enters that phase of the wrapper
(:data:`PHASES` says when each one is), in the thread that enters it; its
iteration is the rank's iteration at that moment (a restart's phases carry
the number of the iteration that failed). Ranks are *initial*
ranks (``RANK`` at launch), which a restart never renumbers. A range
(``step=10..20``, ``after=1s..5s``) and ``rank=random[:K]`` are drawn from the
plan's seed (``seed=N``, default 0), so every rank computes the same choice.
Whitespace around separators is ignored; names are case-insensitive. Anything
else is a ``ValueError`` naming the part that is wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable
from random import Random

from ..control import phases as phase_table

MAX_RANK = 2**31 - 1
MAX_STEP = 10**15
MAX_ITERATION = 2**31 - 1
MAX_DURATION_MS = 10**10  # about 115 days: above it, thread timeouts overflow on some platforms


def _is_int_in(value: object, low: int, high: int) -> bool:
    """A real int (not a bool) in low..high: dataclass fields are checked at run time too."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


class Kind(str, enum.Enum):
    """What an injected fault does to the rank."""

    EXCEPTION = "exception"  # raise InjectedException in the main thread
    HANG = "hang"  # the main thread sleeps with the GIL released
    GIL_HANG = "gil_hang"  # a C call sleeps holding the GIL: no Python runs in the process
    SIGKILL = "sigkill"
    SIGTERM = "sigterm"
    SIGINT = "sigint"
    SIGSTOP = "sigstop"
    OS_EXIT = "os_exit"  # os._exit(code): no cleanup, no exception
    ABORT = "abort"  # os.abort(): SIGABRT
    SEGFAULT = "segfault"  # a read of address 0: SIGSEGV
    GPU_ERROR = "gpu_error"  # a device-side assertion (out-of-bounds index): needs CUDA
    GPU_SLEEP = "gpu_sleep"  # a kernel that spins on the GPU: needs CUDA

    def __str__(self) -> str:
        return self.value


# Faults whose action must run in the thread that runs the training code.
MAIN_THREAD_KINDS = frozenset({Kind.EXCEPTION, Kind.HANG})
GPU_KINDS = frozenset({Kind.GPU_ERROR, Kind.GPU_SLEEP})
KINDS_WITH_DURATION = frozenset({Kind.HANG, Kind.GIL_HANG, Kind.GPU_SLEEP})

# The phases a fault may name (phase=NAME), and when a rank enters each: the wrapper's, from the
# phase table (control/phases.py), and two steps of a barrier that only its leader goes through.
PHASES = {
    **phase_table.fault_names(),
    "reassignment": "the barrier's leader (only) computes the decision, before the rank assignment runs",
    "takeover": "a rank that took the lead over from a leader lost before its decision computes it instead",
}


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The initial ranks a fault is for: listed ones, all of them, or ``random`` ones drawn from the seed."""

    listed: tuple[int, ...] = ()
    every: bool = False
    random: int = 0

    def __post_init__(self) -> None:
        modes = int(bool(self.listed)) + int(self.every) + int(self.random != 0)
        if modes != 1:
            raise ValueError(f"{self!r}: expected exactly one of listed ranks, every=True or random=K")
        if self.listed:
            for r in self.listed:
                if not _is_int_in(r, 0, MAX_RANK):
                    raise ValueError(f"rank {r!r}: expected an integer in 0..{MAX_RANK}")
            if list(self.listed) != sorted(set(self.listed)):
                raise ValueError(f"ranks {self.listed}: expected distinct ranks in increasing order")
        if self.random and not _is_int_in(self.random, 1, MAX_RANK):
            raise ValueError(f"random={self.random!r}: expected a number of ranks in 1..{MAX_RANK}")

    def __str__(self) -> str:
        if self.every:
            return "*"
        if self.random:
            return "random" if self.random == 1 else f"random:{self.random}"
        return "|".join(str(r) for r in self.listed)

    def choose(self, world_size: int, rng: Random) -> tuple[int, ...]:
        if self.every:
            return tuple(range(world_size))
        if self.random:
            if self.random > world_size:
                raise ValueError(f"rank=random:{self.random}: the job has only WORLD_SIZE={world_size} ranks")
            return tuple(sorted(rng.sample(range(world_size), self.random)))
        too_big = [r for r in self.listed if r >= world_size]
        if too_big:
            raise ValueError(
                f"rank={too_big[0]}: the job has WORLD_SIZE={world_size} (initial ranks 0..{world_size - 1})")
        return self.listed


def format_duration(ms: int) -> str:
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _check_range(name: str, value: tuple[int, int], top: int, render: Callable[[int], str] = str) -> None:
    lo, hi = value
    for v in value:
        if not _is_int_in(v, 0, top):
            raise ValueError(f"{name}={v!r}: expected a value in 0..{render(top)}")
    if lo > hi:
        raise ValueError(f"{name}={render(lo)}..{render(hi)}: the range's start is after its end")


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """One entry of a plan. ``step``/``after_ms`` are inclusive ranges (equal ends: a fixed value)."""

    kind: Kind
    ranks: Ranks
    step: tuple[int, int] | None = None
    after_ms: tuple[int, int] | None = None
    iterations: tuple[int, ...] | None = (0,)  # None: every iteration
    code: int | None = None
    for_ms: int | None = None
    phase: str | None = None  # one of PHASES

    def __post_init__(self) -> None:
        kind: object = self.kind
        if not isinstance(kind, Kind):
            raise ValueError(f"kind {kind!r}: expected an inprocess.faults.Kind")
        ranks: object = self.ranks
        if not isinstance(ranks, Ranks):
            raise ValueError(f"ranks {ranks!r}: expected an inprocess.faults.Ranks")
        if (self.step is not None) + (self.after_ms is not None) + (self.phase is not None) != 1:
            raise ValueError(
                f"{self.kind.value}: expected exactly one of step=N, after=DURATION or phase=NAME (when to inject it)")
        if self.phase is not None and self.phase not in PHASES:
            raise ValueError(f"phase={self.phase!r}: expected one of {', '.join(PHASES)}")
        if self.step is not None:
            _check_range("step", self.step, MAX_STEP)
        if self.after_ms is not None:
            _check_range("after", self.after_ms, MAX_DURATION_MS, format_duration)
        if self.iterations is not None:
            if not self.iterations or list(self.iterations) != sorted(set(self.iterations)):
                raise ValueError(f"iterations {self.iterations!r}: expected distinct iterations in increasing order")
            for i in self.iterations:
                if not _is_int_in(i, 0, MAX_ITERATION):
                    raise ValueError(f"iteration={i!r}: expected an integer in 0..{MAX_ITERATION}")
        self._check_options()

    def _check_options(self) -> None:
        if self.code is not None:
            if self.kind is not Kind.OS_EXIT:
                raise ValueError(f"code={self.code}: only os_exit takes an exit code, not {self.kind.value}")
            if not _is_int_in(self.code, 0, 255):
                raise ValueError(f"code={self.code!r}: expected an exit status in 0..255")
        if self.for_ms is not None:
            if self.kind not in KINDS_WITH_DURATION:
                names = ", ".join(sorted(k.value for k in KINDS_WITH_DURATION))
                raise ValueError(f"for={self.for_ms!r}ms: only {names} take a duration, not {self.kind.value}")
            if not _is_int_in(self.for_ms, 1, MAX_DURATION_MS):
                top = format_duration(MAX_DURATION_MS)
                raise ValueError(f"for={self.for_ms!r}ms: expected a duration of 1ms..{top}")

    def __str__(self) -> str:
        fields = [f"rank={self.ranks}"]
        if self.step is not None:
            lo, hi = self.step
            fields.append(f"step={lo}" if lo == hi else f"step={lo}..{hi}")
        if self.after_ms is not None:
            lo, hi = self.after_ms
            fields.append(f"after={format_duration(lo)}" + ("" if lo == hi else f"..{format_duration(hi)}"))
        if self.phase is not None:
            fields.append(f"phase={self.phase}")
        if self.iterations is None:
            fields.append("iteration=*")
        elif self.iterations != (0,):
            fields.append("iteration=" + "|".join(str(i) for i in self.iterations))
        if self.code is not None:
            fields.append(f"code={self.code}")
        if self.for_ms is not None:
            fields.append(f"for={format_duration(self.for_ms)}")
        return f"{self.kind.value}@" + ",".join(fields)


@dataclasses.dataclass(frozen=True)
class ScheduledFault:
    """A fault due on this rank in this iteration: at ``step`` (``maybe_inject``), ``delay_s`` after
    arming, or on entering ``spec.phase`` (``enter_phase``)."""

    index: int  # the entry's position in the plan
    spec: FaultSpec
    iteration: int
    step: int | None
    delay_s: float | None


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    faults: tuple[FaultSpec, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        specs: tuple[object, ...] = self.faults
        if not specs or not all(isinstance(f, FaultSpec) for f in specs):
            raise ValueError(f"faults={self.faults!r}: expected a non-empty tuple of FaultSpec")
        if not _is_int_in(self.seed, 0, 2**64 - 1):
            raise ValueError(f"seed={self.seed!r}: expected an integer in 0..2**64-1")

    @classmethod
    def parse(cls, text: str, source: str = "INPROCESS_FAULTS") -> FaultPlan:
        return _parse_plan(text, source)

    def __str__(self) -> str:
        entries = [str(f) for f in self.faults]
        return ";".join(([f"seed={self.seed}"] if self.seed else []) + entries)

    def schedule(self, rank: int, world_size: int, iteration: int) -> list[ScheduledFault]:
        """The faults due on initial ``rank`` in ``iteration`` of a job of ``world_size`` initial ranks.

        Random choices of entry *i* in iteration *n* come from
        ``random.Random(f"{seed}:{i}:{n}")`` only (a string seed hashes the
        same in every process), in the order ranks, step, delay: every rank
        draws the same values.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: expected an initial rank in 0..world_size-1={world_size - 1}")
        due = []
        for index, spec in enumerate(self.faults):
            if spec.iterations is not None and iteration not in spec.iterations:
                continue
            rng = Random(f"{self.seed}:{index}:{iteration}")
            if rank not in spec.ranks.choose(world_size, rng):
                continue
            step = delay = None
            if spec.step is not None:
                lo, hi = spec.step
                step = lo if lo == hi else rng.randint(lo, hi)
            if spec.after_ms is not None:
                lo, hi = spec.after_ms
                delay = (lo if lo == hi else rng.randint(lo, hi)) / 1000.0
            due.append(ScheduledFault(index, spec, iteration, step, delay))
        return due


# -- parsing -----------------------------------------------------------------

_INT = re.compile(r"[0-9]{1,20}")
_DURATION = re.compile(r"([0-9]{1,12})(?:\.([0-9]{1,9}))?(ms|s|m|h)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
_FIELDS = ("rank", "step", "after", "phase", "iteration", "code", "for")


class _BadPart(ValueError):
    def __init__(self, part: str, problem: str):
        super().__init__(problem)
        self.part = part
        self.problem = problem


def _int(text: str, name: str, top: int) -> int:
    if not _INT.fullmatch(text):
        raise _BadPart(text, f"{name}: expected a non-negative integer (digits only)")
    value = int(text)
    if value > top:
        raise _BadPart(text, f"{name}: expected at most {top}")
    return value


def _duration_ms(text: str, name: str) -> int:
    m = _DURATION.fullmatch(text.lower())
    if not m:
        raise _BadPart(text, f"{name}: expected a duration with a unit, like 500ms, 5s, 1.5m or 2h")
    whole, frac, unit = m.groups()
    scale = _UNIT_MS[unit]
    frac = frac or ""
    # Exact decimal arithmetic: the value must be a whole number of milliseconds.
    numerator = int(whole + frac) * scale
    denominator = 10 ** len(frac)
    if numerator % denominator:
        raise _BadPart(text, f"{name}: expected a whole number of milliseconds")
    ms = int(numerator // denominator)
    if ms > MAX_DURATION_MS:
        raise _BadPart(text, f"{name}: expected at most {format_duration(MAX_DURATION_MS)}")
    return ms


def _positive_duration_ms(text: str, name: str) -> int:
    ms = _duration_ms(text, name)
    if ms == 0:
        raise _BadPart(text, f"{name}: expected a duration of at least 1ms")
    return ms


def _range(text: str, name: str, one: Callable[[str, str], int]) -> tuple[int, int]:
    lo_text, dots, hi_text = text.partition("..")
    if not lo_text.strip() or (dots and not hi_text.strip()):
        raise _BadPart(text, f"{name}: a range needs both ends, like 10..20")
    lo = one(lo_text.strip(), name)
    hi = one(hi_text.strip(), name) if dots else lo
    if lo > hi:
        raise _BadPart(text, f"{name}: the range's start is after its end")
    return lo, hi


def _listed(text: str, name: str, top: int) -> tuple[int, ...]:
    pieces = [v.strip() for v in text.split("|")]
    if not all(pieces):
        raise _BadPart(text, f"{name}: an empty value in a list, like 1||2 or 1|")
    values = [_int(v, name, top) for v in pieces]
    if len(set(values)) != len(values):
        raise _BadPart(text, f"{name}: a value is listed twice")
    return tuple(sorted(values))


def _ranks(text: str) -> Ranks:
    low = text.lower()
    if low == "*":
        return Ranks(every=True)
    if low == "random":
        return Ranks(random=1)
    if low.startswith("random:"):
        count = _int(low[len("random:"):].strip(), "rank=random:K", MAX_RANK)
        if count == 0:
            raise _BadPart(text, "rank=random:K: expected K >= 1")
        return Ranks(random=count)
    return Ranks(listed=_listed(text, "rank", MAX_RANK))


def _phase(text: str) -> str:
    name = text.lower()
    if name not in PHASES:
        raise _BadPart(text, f"phase: expected one of {', '.join(PHASES)}")
    return name


def _parse_fields(fields_text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for raw in fields_text.split(","):
        part = raw.strip()
        name, eq, value = part.partition("=")
        name = name.strip().lower()
        if not part:
            raise _BadPart(raw, "empty field (nothing after '@', or ',' twice in a row or at an end)")
        if not eq or not value.strip():
            raise _BadPart(raw, "expected NAME=VALUE")
        if name not in _FIELDS:
            raise _BadPart(raw, f"unknown field {name!r}; expected one of {', '.join(_FIELDS)}")
        if name in fields:
            raise _BadPart(raw, f"{name} is given twice")
        fields[name] = value.strip()
    return fields


def _parse_spec(entry: str) -> FaultSpec:
    kind_text, at, fields_text = entry.partition("@")
    kind_name = kind_text.strip().lower()
    try:
        kind = Kind(kind_name)
    except ValueError:
        raise _BadPart(kind_text, f"unknown fault kind; expected one of {', '.join(k.value for k in Kind)}") from None
    if not at:
        raise _BadPart(entry, f"expected {kind.value}@rank=...,step=N (or after=DURATION, or phase=NAME)")
    fields = _parse_fields(fields_text)
    try:
        # Each value first, so that a malformed one is named rather than reported missing.
        ranks = _ranks(fields["rank"]) if "rank" in fields else None
        step = _range(fields["step"], "step", lambda t, n: _int(t, n, MAX_STEP)) if "step" in fields else None
        after_ms = _range(fields["after"], "after", _duration_ms) if "after" in fields else None
        phase = _phase(fields["phase"]) if "phase" in fields else None
        iterations: tuple[int, ...] | None = (0,)
        if "iteration" in fields:
            text = fields["iteration"]
            iterations = None if text == "*" else _listed(text, "iteration", MAX_ITERATION)
        code = _int(fields["code"], "code", 255) if "code" in fields else None
        for_ms = _positive_duration_ms(fields["for"], "for") if "for" in fields else None
        if ranks is None:
            raise _BadPart(entry, "rank=... is missing (which initial ranks: 2, 1|3, *, random or random:K)")
        if (step is not None) + (after_ms is not None) + (phase is not None) != 1:
            raise _BadPart(entry, "expected exactly one of step=N, after=DURATION or phase=NAME (when to inject)")
        return FaultSpec(kind, ranks, step=step, after_ms=after_ms, iterations=iterations, code=code, for_ms=for_ms,
                         phase=phase)
    except _BadPart:
        raise
    except ValueError as e:
        raise _BadPart(entry, str(e)) from None


def _parse_plan(text: object, source: str) -> FaultPlan:
    if not isinstance(text, str):
        raise ValueError(f"{source}={text!r}: expected a string")
    specs: list[FaultSpec] = []
    seed: int | None = None
    for number, raw in enumerate(text.split(";"), 1):
        entry = raw.strip()
        where = f"{source}: entry {number} {entry!r}"
        try:
            if not entry:
                raise _BadPart(raw, "empty entry (';' twice in a row, or at an end)")
            name, eq, value = entry.partition("=")
            if "@" not in entry and name.strip().lower() == "seed":
                if seed is not None:
                    raise _BadPart(entry, "seed is given twice")
                seed = _int(value.strip(), "seed", 2**64 - 1)
                continue
            specs.append(_parse_spec(entry))
        except _BadPart as e:
            part = e.part.strip()
            named = f" {part!r}:" if part and part != entry else ""
            raise ValueError(f"{where}:{named} {e.problem}") from None
    if not specs:
        raise ValueError(f"{source}={text!r}: expected at least one fault, like exception@rank=1,step=10")
    return FaultPlan(tuple(specs), seed or 0)
