"""What the restart protocol writes to the store: fault records and decisions.

Plain data with their JSON form (no pickle): every rank, the monitors and
the node agents read them, and none of them may run code from the store.
This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import time
from collections.abc import Callable
from typing import Any

from ..exception import InternalError
from .membership import Membership

MAX_FAULTS_IN_DECISION = 32
MAX_MESSAGE = 300

HOST = socket.gethostname()  # where a fault's CLOCK_MONOTONIC stamp is meaningful
# The kind of a fault that ends the job on every rank: a RestartAbort raised on a rank (a RetryController's,
# or the user's). The next barrier's leader turns it into a decision that ends the job (Decision.abort).
ENDS_JOB = "restart_abort"


MAX_JSON_BYTES = 1 << 24  # a decision of MAX_FAULTS_IN_DECISION records is a few kB
MAX_WORLD_SIZE = 1 << 22  # initial ranks a decision may describe (the simulator goes to 16,384)
_INT64 = (-(1 << 63), (1 << 63) - 1)
# The head of Decision.to_json: group 1 the world size, group 2 present when abort is null.
_HEAD = re.compile(rb'\{"i":-?\d+,"n":\d+,"ws":(-?\d+),"abort":(null[,}])?')


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number the protocol writes")


def loads_strict(raw: bytes | str) -> Any:
    """JSON as the protocol writes it: no NaN/Infinity, bounded size and depth
    (a deeply nested document is a ValueError, not a RecursionError)."""
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{len(raw)} bytes: more than any record the protocol writes")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deeply for a record the protocol writes") from None


def field_int(d: dict[str, Any], name: str, low: int = _INT64[0], high: int = _INT64[1]) -> int:
    """``d[name]``, a JSON integer (not a bool, float or string) in low..high."""
    value = d[name]
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name}={value!r:.80}: expected an integer in {low}..{high}")
    return value


def field_str(d: dict[str, Any], name: str, default: str | None = None) -> str:
    value = d.get(name, default) if default is not None else d[name]
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r:.80}: expected a string")
    return value


def _fields(d: object, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(d).__name__}")
    return d


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """What one rank reports about a fault it saw (plain data, no pickle)."""

    rank: int  # initial rank
    iteration: int
    kind: str  # "exception", "terminated", "health_check", "killed", ENDS_JOB, ...
    type: str
    message: str
    host: str = HOST
    t_ns: int = 0  # CLOCK_MONOTONIC of the host above

    @classmethod
    def from_exception(cls, rank: int, iteration: int, kind: str, exc: BaseException) -> FaultRecord:
        return cls(rank, iteration, kind, type(exc).__name__, str(exc)[:MAX_MESSAGE], HOST, time.monotonic_ns())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultRecord:
        """Strict: each field of the type the protocol writes (ValueError/KeyError otherwise).
        A rank of -1 is a record nobody could attribute (an unreadable line)."""
        d = _fields(d, "fault record")
        return cls(
            field_int(d, "rank", -1), field_int(d, "iteration", 0), field_str(d, "kind"), field_str(d, "type"),
            field_str(d, "message"), field_str(d, "host", ""), field_int(d, "t_ns", 0) if "t_ns" in d else 0,
        )

    @classmethod
    def parse_lines(cls, raw: str, iteration: int) -> list[FaultRecord]:
        """The records of a faults key (JSON lines); a line that does not parse
        becomes an "unreadable" record instead of failing the barrier."""
        out = []
        for line in raw.splitlines():
            if line:
                try:
                    out.append(cls.from_dict(loads_strict(line)))
                except (ValueError, KeyError, TypeError):
                    out.append(cls(-1, iteration, "unreadable", "InternalError", line[:MAX_MESSAGE]))
        return out


@dataclasses.dataclass
class Decision:
    """The outcome of barrier i, identical on every rank."""

    iteration: int
    membership: Membership
    terminated: list[int]  # initial ranks terminated at this barrier
    faults: list[FaultRecord]  # up to MAX_FAULTS_IN_DECISION of iteration i-1
    n_faults: int
    leader: int
    abort: str | None = None  # set when the job cannot go on
    t_ns: int = 0
    host: str = HOST
    assignment_ns: int = 0  # how long the rank assignment took on the leader
    term: int = 0  # 0: decided by the barrier's first leader; t > 0: by the t-th to take the lead over
    # (seat, life) of every process admitted into a free seat (control/joining.py): applied to the
    # previous membership as spares before this decision's table
    joined: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # What the leader measured of the iteration that failed (engine/storm.py: stalls, steps, ran_ms,
    # restart_ms): the storm brake's one judgement, read alike by every rank; None at barrier 0
    progress: dict[str, int] | None = None

    def to_json(self) -> str:
        fields: dict[str, Any] = {
            "i": self.iteration,
            "n": self.membership.initial_world_size,
            # ws and abort first: ends_job reads them from the head, without parsing the runs
            "ws": self.membership.world_size,
            "abort": self.abort,
            "runs": self.membership.encode(),
            "terminated": self.terminated,
            "faults": [dataclasses.asdict(f) for f in self.faults[:MAX_FAULTS_IN_DECISION]],
            "n_faults": self.n_faults,
            "leader": self.leader,
            "t_ns": self.t_ns,
            "host": self.host,
            "assignment_ns": self.assignment_ns,
        }
        if self.term:  # only after a takeover (inprocess.control.leadership): a plain decision is unchanged
            fields["term"] = self.term
        if self.joined:  # only when joiners were admitted: a plain decision is unchanged
            fields["joined"] = [list(pair) for pair in self.joined]
        if self.progress is not None:
            fields["progress"] = self.progress
        return json.dumps(fields, separators=(",", ":"))

    @staticmethod
    def ends_job(raw: bytes) -> bool:
        """Whether the encoded decision ends the job (it aborts it, or leaves no rank active).

        A node agent relays every decision and a waiting joiner looks at each:
        at 16,384 ranks parsing the whole document cost them ~85 us, reading
        the head that :meth:`to_json` writes first ~1 us. Any other layout
        (another writer's field order) is parsed in full.
        """
        head = _HEAD.match(raw)
        if head is not None:
            return head.group(2) is None or int(head.group(1)) <= 0
        fields = json.loads(raw)
        return fields.get("abort") is not None or int(fields.get("ws", 1)) <= 0

    @classmethod
    def from_json(cls, raw: bytes) -> Decision:
        try:
            d = _fields(loads_strict(raw), "decision")
            n = field_int(d, "n", 0, MAX_WORLD_SIZE)
            terminated, faults, abort = d["terminated"], d["faults"], d["abort"]
            if not isinstance(terminated, list) or not isinstance(faults, list):
                raise ValueError("terminated and faults: expected lists")
            if abort is not None and not isinstance(abort, str):
                raise ValueError(f"abort={abort!r:.80}: expected null or a string")
            return cls(
                iteration=field_int(d, "i", 0),
                membership=Membership.decode(d["runs"], n),
                terminated=[field_int({"terminated": r}, "terminated", 0, n - 1) for r in terminated],
                faults=[FaultRecord.from_dict(f) for f in faults],
                n_faults=field_int(d, "n_faults", 0),
                leader=field_int(d, "leader", 0, max(n - 1, 0)),
                abort=abort,
                t_ns=field_int(d, "t_ns"),
                host=field_str(d, "host"),
                assignment_ns=field_int(d, "assignment_ns", 0) if "assignment_ns" in d else 0,
                # Each term after the first needs a rank of the job lost: never more terms than ranks.
                term=field_int(d, "term", 0, n) if "term" in d else 0,
                joined=_joined(d.get("joined", []), n),
                progress=_progress(d.get("progress")),
            )
        except (ValueError, KeyError, TypeError, InternalError) as e:
            raise InternalError(f"corrupted decision record {raw[:200]!r}: {e}") from e


def _joined(raw: object, n: int) -> list[tuple[int, int]]:
    if not isinstance(raw, list):
        raise ValueError(f"joined={raw!r:.80}: expected a list")
    out = []
    for pair in raw:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"joined entry {pair!r:.80}: expected [seat, life]")
        seat, life = pair
        out.append((field_int({"seat": seat}, "seat", 0, n - 1), field_int({"life": life}, "life", 1)))
    return out


def _progress(raw: object) -> dict[str, int] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > 8:
        raise ValueError(f"progress={raw!r:.80}: expected an object of at most 8 integers")
    return {field_str({"name": name}, "name"): field_int(raw, name) for name in raw}


# The leader's computation: (terminated initial ranks, faults of i-1, leader) -> decision.
DecideFn = Callable[[set[int], list[FaultRecord], int], Decision]
