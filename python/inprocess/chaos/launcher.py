"""The chaos runner's launcher: ``inprocess.launch``'s job and supervisor, with a constant respawn delay.

``python -m inprocess.launch --respawn`` doubles the wait before each respawn of a seat, up to 30 s: a
real job needs that against a process that dies at once, every time. A chaos run kills each seat dozens
of times on purpose; doubled waits would leave its seats empty for 30 s each and the job shrinking to
its last rank (the first 520-fault run ended so, its last rank killed in its reassignment). Here every
respawn comes ``--respawn-delay`` after its death.

    python -m inprocess.chaos.launcher --nproc N [--ranks-per-node K] [--respawn-delay S] --timeout S \\
        script [args...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from ..launch import EVENTS_VAR, EventsReader, LocalJob, RespawnPolicy, Supervisor, elastic_env, summarize


@dataclasses.dataclass(frozen=True)
class ConstantRespawn(RespawnPolicy):
    """Every respawn ``backoff_s`` after the death that asks for it."""

    def delay(self, attempt: int) -> float:
        return self.backoff_s


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inprocess.chaos.launcher")
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--respawn-delay", type=float, default=0.2)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--events", required=True, help="the events directory (INPROCESS_EVENTS_DIR of every rank)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    events = EventsReader(ns.events)
    job = LocalJob([ns.script, *ns.args], ns.nproc, capture=False, ranks_per_node=ns.ranks_per_node,
                   env={**elastic_env(), EVENTS_VAR: ns.events})
    supervisor = Supervisor(job, ConstantRespawn(1_000_000, ns.respawn_delay))
    with job:
        seats = supervisor.finish(ns.timeout, "chaos launcher")
        if seats is None:
            return 124
    line, status = summarize([seat.last.returncode for seat in seats], events.read(), False, seats)
    print(line, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
