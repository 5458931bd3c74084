"""What a joiner and the job write of a join (:mod:`inprocess.control.joining`), as plain data:
the joiner's :class:`Announcement`, its :class:`Outcome` as its record holds it, the
:class:`ResolvedMark` of the announcements a leader looked at, and the configuration a joiner
must share with the job (:func:`config_difference`). This module imports no torch."""

from __future__ import annotations

import dataclasses
import json
import secrets

from ..exception import InternalError
from .records import MAX_MESSAGE, loads_strict

ADMITTED = "admitted"
REFUSED = "refused"
GONE = "gone"
CLOSED = "closed"
_OUTCOMES = (ADMITTED, REFUSED, GONE, CLOSED)
PENDING = "pending"  # a joiner's record from its announcement until somebody resolves it
ENDED = "ended:"  # the value of ``running`` once the job ended: "ended:<incarnation>"


@dataclasses.dataclass(frozen=True)
class Announcement:
    """What a joiner says about itself (plain data)."""

    token: str
    seat: int  # the initial rank it asks for
    host: str
    pid: int
    config: dict[str, str]  # what must equal the job's: see :func:`config_difference`
    keys: list[list[str]] | None = None  # its topology keys, for assignments that group ranks

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Announcement:
        d = loads_strict(line)
        if not isinstance(d, dict):
            raise ValueError("expected a JSON object")
        token, seat, host, pid, config = d["token"], d["seat"], d["host"], d["pid"], d["config"]
        keys = d.get("keys")
        if not isinstance(token, str) or not token or "/" in token:
            raise ValueError(f"token={token!r:.80}")
        if type(seat) is not int or type(pid) is not int or not isinstance(host, str):
            raise ValueError("seat, pid: expected integers; host: a string")
        if not isinstance(config, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in config.items()):
            raise ValueError("config: expected an object of strings")
        if keys is not None and not (isinstance(keys, list) and all(
                isinstance(row, list) and all(isinstance(k, str) for k in row) for row in keys)):
            raise ValueError("keys: expected lists of strings")
        return cls(token, seat, host, pid, config, keys)


def _writer_tag() -> str:
    return secrets.token_hex(4)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A joiner's outcome, parsed.

    ``by`` tags the write (``<kind>/<by>:...``, random per outcome made): the
    compare_set that writes an outcome answers the value written both to the
    writer that won and to another that wrote the same outcome (two live
    leaders admitting the same joiner, two monitors withdrawing it), and only
    the winner may count the joiner resolved. Outcomes compare without it.
    """

    kind: str  # one of ADMITTED, REFUSED, GONE, CLOSED
    barrier: int = -1  # ADMITTED: the barrier whose decision admits it
    seat: int = -1
    life: int = 0
    why: str = ""
    by: str = dataclasses.field(default_factory=_writer_tag, compare=False)

    def encode(self) -> str:
        if self.kind == ADMITTED:
            return f"{ADMITTED}/{self.by}:{self.barrier}:{self.seat}:{self.life}"
        return f"{self.kind}/{self.by}:{self.why[:MAX_MESSAGE]}"

    @classmethod
    def parse(cls, value: str) -> Outcome | None:
        """None for a pending joiner (:data:`PENDING`)."""
        if value == PENDING:
            return None
        head, _, rest = value.partition(":")
        kind, _, by = head.partition("/")
        if kind not in _OUTCOMES:
            raise InternalError(f"joiner outcome {value[:120]!r}: expected one of {', '.join(_OUTCOMES)}")
        if kind != ADMITTED:
            return cls(kind, why=rest, by=by)
        try:
            barrier, seat, life = (int(v) for v in rest.split(":"))
        except ValueError:
            raise InternalError(
                f"joiner outcome {value[:120]!r}: expected admitted/<writer>:<barrier>:<seat>:<life>") from None
        return cls(kind, barrier, seat, life, by=by)


def config_difference(job: dict[str, str], joiner: dict[str, str]) -> str | None:
    """What makes a joiner unfit for the job, named; None when their configurations agree."""
    for name in sorted(set(job) | set(joiner)):
        mine, theirs = job.get(name), joiner.get(name)
        if mine != theirs:
            return f"{name} differs: the job has {mine!r}, this process has {theirs!r}"
    return None




@dataclasses.dataclass(frozen=True)
class ResolvedMark:
    """How far the announcements need no look any more (``joiners.resolved``: ``settled:looked:barrier``).

    Lines before ``settled`` are resolved for good. Lines before ``looked``
    are too once the decision of ``barrier`` is out: the ones in between are
    admitted at ``barrier`` (or resolved for good), and a leader that takes
    the lead of ``barrier`` over must list those admissions again. A leader
    of a later barrier knows that decision is out, so it starts at
    ``looked`` without reading them.
    """

    settled: int = 0
    looked: int = 0
    barrier: int = -1

    def start(self, barrier: int) -> int:
        """The first line a leader of ``barrier`` looks at."""
        return self.looked if barrier > self.barrier else self.settled

    def encode(self) -> str:
        return f"{self.settled}:{self.looked}:{self.barrier}"

    @classmethod
    def parse(cls, value: str) -> ResolvedMark:
        try:
            settled, looked, barrier = (int(v) for v in value.split(":"))
        except ValueError:
            raise InternalError(f"joiners.resolved {value[:80]!r}: expected <settled>:<looked>:<barrier>") from None
        if not 0 <= settled <= looked:
            raise InternalError(f"joiners.resolved {value[:80]!r}: expected 0 <= settled <= looked")
        return cls(settled, looked, barrier)
