"""What the restart protocol writes to the store: fault records and decisions.

Plain data with their JSON form (no pickle): every rank, the monitors and
the node agents read them, and none of them may run code from the store.
This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from typing import Any, Callable, Optional

from ..exception import InternalError
from .membership import Membership

MAX_FAULTS_IN_DECISION = 32
MAX_MESSAGE = 300

HOST = socket.gethostname()  # where a fault's CLOCK_MONOTONIC stamp is meaningful


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """What one rank reports about a fault it saw (plain data, no pickle)."""

    rank: int  # initial rank
    iteration: int
    kind: str  # "exception", "terminated", "health_check", "killed", ...
    type: str
    message: str
    host: str = HOST
    t_ns: int = 0  # CLOCK_MONOTONIC of the host above

    @classmethod
    def from_exception(cls, rank: int, iteration: int, kind: str, exc: BaseException) -> "FaultRecord":
        return cls(rank, iteration, kind, type(exc).__name__, str(exc)[:MAX_MESSAGE], HOST, time.monotonic_ns())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FaultRecord":
        return cls(
            int(d["rank"]), int(d["iteration"]), str(d["kind"]), str(d["type"]),
            str(d["message"]), str(d.get("host", "")), int(d.get("t_ns", 0)),
        )

    @classmethod
    def parse_lines(cls, raw: str, iteration: int) -> list["FaultRecord"]:
        """The records of a faults key (JSON lines); a line that does not parse
        becomes an "unreadable" record instead of failing the barrier."""
        out = []
        for line in raw.splitlines():
            if line:
                try:
                    out.append(cls.from_dict(json.loads(line)))
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
    abort: Optional[str] = None  # set when the job cannot go on
    t_ns: int = 0
    host: str = HOST
    assignment_ns: int = 0  # how long the rank assignment took on the leader

    def to_json(self) -> str:
        return json.dumps(
            {
                "i": self.iteration,
                "n": self.membership.initial_world_size,
                "ws": self.membership.world_size,  # lets a node agent see the job's end without decoding runs
                "runs": self.membership.encode(),
                "terminated": self.terminated,
                "faults": [dataclasses.asdict(f) for f in self.faults[:MAX_FAULTS_IN_DECISION]],
                "n_faults": self.n_faults,
                "leader": self.leader,
                "abort": self.abort,
                "t_ns": self.t_ns,
                "host": self.host,
                "assignment_ns": self.assignment_ns,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: bytes) -> "Decision":
        try:
            d = json.loads(raw)
            return cls(
                iteration=int(d["i"]),
                membership=Membership.decode(d["runs"], int(d["n"])),
                terminated=[int(r) for r in d["terminated"]],
                faults=[FaultRecord.from_dict(f) for f in d["faults"]],
                n_faults=int(d["n_faults"]),
                leader=int(d["leader"]),
                abort=d["abort"],
                t_ns=int(d["t_ns"]),
                host=str(d["host"]),
                assignment_ns=int(d.get("assignment_ns", 0)),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InternalError(f"corrupted decision record {raw[:200]!r}: {e}") from e


# The leader's computation: (terminated initial ranks, faults of i-1, leader) -> decision.
DecideFn = Callable[[set[int], list[FaultRecord], int], Decision]
