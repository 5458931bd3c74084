"""A seeded schedule of faults: every kind the fault toolkit knows, at every phase and protocol step it
reaches, plus what only the runner and the worker can do (a slow store, joiners that die).

One fault per iteration: fault k is due in iteration k. What fires where:

* **in the toolkit** (``INPROCESS_FAULTS``, :mod:`inprocess.faults`): an ``exception`` or a ``hang``
  at a training step (a fault of the function: the job restarts, nobody leaves); a process-ending kind
  (``sigkill``, ``sigterm``, ``sigint``, ``abort``, ``segfault``, ``os_exit`` with status 75, ``gil_hang``,
  ``sigstop``, a ``hang`` that never ends) at a step, after a delay (a spare too), or when the rank enters a
  phase of the restart (``abort``, ``finalize``, ``health_check``: a hang there is a hang in a hook;
  ``barrier``), or as the leader of the barrier after it (``reassignment``, and then ``takeover``: the
  rank that took the lead over is slow). A phase fault comes with an exception on another rank at a
  step, the restart its phase belongs to. A process that ends is respawned by the launcher
  (``--respawn``) and joins the running job;
* **in the worker** (:mod:`inprocess.chaos.worker`): a respawned process dies while it waits to be
  admitted, or right after its admission, before its first iteration;
* **in the runner** (:mod:`inprocess.chaos.runner`): the store host is stopped (SIGSTOP) for a while
  and continued: a slow store.

Exceptions are left out of the restart's hooks: a rank whose hook raises leaves for good (its exit
status asks no launcher for a replacement: only a signal or status 75/76 does) and the job would run
out of ranks. A planned fault that does not fire (its seat is empty, or a spare's at a step) leaves
its iteration to end without a restart: the worker's active rank 0 then raises a filler exception, so
that every iteration of the schedule restarts (the report counts them).
The same seed and parameters give the same schedule (:func:`draw`).
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

# Kinds that end the process by a signal or status 75: the launcher respawns it.
ENDING = ("sigkill", "sigterm", "sigint", "abort", "segfault", "os_exit", "gil_hang", "sigstop")
SLOW = frozenset({"gil_hang", "sigstop"})  # killed by the monitor at hard_timeout + grace
# A rank frozen (SIGSTOP, or holding the GIL) on entering a barrier ended the job in the first long run
# (seed 31, sigstop@rank=4,phase=barrier): nothing watched it there. The restart barrier now has a hang
# rule (engine/hang_guard.py; tests/test_fault_matrix.py, test_a_rank_frozen_at_the_restart_barrier),
# and the schedule places these faults at the barrier like any other.
STEP_KINDS = ("exception", "hang_step") + ENDING
HOOK_PHASES = ("abort", "finalize", "health_check", "barrier")
LEADER_PHASES = ("reassignment", "takeover")
RUNNER_KINDS = ("store_stop",)
JOINER_KINDS = ("die_waiting", "die_admitted")
ALL_KINDS = STEP_KINDS + ("hang_hook",) + RUNNER_KINDS + JOINER_KINDS
TAKEOVER_HANG_S = 0.5  # a leader that took the lead over is slow this long (under the hard timeout)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One scheduled fault: due in ``iteration`` on initial rank ``rank`` (None: whoever the phase picks)."""

    iteration: int
    kind: str  # one of ALL_KINDS
    where: str  # "step", "after", a phase name, "store" or "joiner"
    rank: int | None
    step: int = 0
    delay_s: float = 0.0

    def toolkit(self) -> list[str]:
        """This fault's entries in INPROCESS_FAULTS (none for the runner's and the worker's)."""
        if self.kind in RUNNER_KINDS or self.kind in JOINER_KINDS:
            return []
        kind = {"hang_step": "hang,for=2s", "hang_hook": "hang", "os_exit": "os_exit,code=75"}.get(self.kind, self.kind)
        name, _, extra = kind.partition(",")
        extra = f",{extra}" if extra else ""
        rank = "*" if self.rank is None else str(self.rank)
        if self.where == "takeover":
            # Every rank that takes the lead over meets it (each process fires it once): a slow leader,
            # not a lost one, or the lead would pass from rank to rank until none is left.
            return [f"hang@rank=*,phase=takeover,iteration={self.iteration},for={TAKEOVER_HANG_S:g}s"]
        if self.where == "step":
            return [f"{name}@rank={rank},step={self.step},iteration={self.iteration}{extra}"]
        if self.where == "after":
            return [f"{name}@rank={rank},after={int(self.delay_s * 1000)}ms,iteration={self.iteration}{extra}"]
        # A phase of the restart after this iteration: an exception at a step on another rank is its cause.
        return [f"{name}@rank={rank},phase={self.where},iteration={self.iteration}{extra}"]


@dataclasses.dataclass
class Schedule:
    seed: int
    ranks: int  # active ranks
    spares: int
    nodes: int
    steps: int  # per iteration
    faults: list[Fault]
    # (seat, respawn count) -> "die_waiting" | "die_admitted": what a respawned process does to itself
    joiners: dict[str, str]
    # Seconds into the run -> how long the store host stays stopped
    store_stops: list[tuple[float, float]]

    @property
    def world_size(self) -> int:
        return self.ranks + self.spares

    @property
    def iterations(self) -> int:
        return len(self.faults)

    def plan(self) -> str:
        """The INPROCESS_FAULTS value: the toolkit's faults, and the exceptions that cause a phase's restart."""
        entries = [f"seed={self.seed}"]
        for f in self.faults:
            entries += f.toolkit()
            if f.where in HOOK_PHASES + LEADER_PHASES:
                cause = (f.rank + 1) % self.ranks if f.rank is not None else 0
                entries.append(f"exception@rank={cause},step={max(1, f.step)},iteration={f.iteration}")
            if f.where == "takeover":  # the first leader is lost: the rank that takes over meets the fault
                entries.append(f"sigkill@rank=*,phase=reassignment,iteration={f.iteration}")
        return ";".join(entries)

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "ranks": self.ranks, "spares": self.spares, "nodes": self.nodes,
                           "steps": self.steps, "faults": [dataclasses.asdict(f) for f in self.faults],
                           "joiners": self.joiners, "store_stops": self.store_stops})

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        d: dict[str, Any] = json.loads(text)
        return cls(d["seed"], d["ranks"], d["spares"], d["nodes"], d["steps"], [Fault(**f) for f in d["faults"]],
                   dict(d["joiners"]), [(float(at), float(seconds)) for at, seconds in d["store_stops"]])


def _weights(kinds: set[str] | None) -> list[tuple[str, float]]:
    """What each fault of the schedule may be, and how often (a process-ending one half the time)."""
    table = [("exception", 3.0), ("hang_step", 1.0), ("hang_hook", 0.6), ("store_stop", 0.5),
             ("die_waiting", 0.5), ("die_admitted", 0.5)] + [(k, 0.6 if k in SLOW else 1.2) for k in ENDING]
    return [(k, w) for k, w in table if kinds is None or k in kinds]


def draw(seed: int, faults: int, ranks: int, spares: int, nodes: int = 1, steps: int = 40,
         kinds: set[str] | None = None) -> Schedule:
    """The schedule of ``seed``: ``faults`` faults over as many iterations, for ``ranks`` active ranks and
    ``spares`` spares on ``nodes`` nodes, ``steps`` steps per iteration."""
    rng = random.Random(seed)
    table = _weights(kinds)
    if not table:
        raise ValueError(f"kinds={sorted(kinds or ())}: none of {list(ALL_KINDS)}")
    names, weights = [k for k, _ in table], [w for _, w in table]
    world = ranks + spares
    out: list[Fault] = []
    joiners: dict[str, str] = {}
    stops: list[tuple[float, float]] = []
    for i in range(faults):
        kind = rng.choices(names, weights)[0]
        out.append(_place(rng, i, kind, ranks, world, steps, joiners, stops))
    return Schedule(seed, ranks, spares, nodes, steps, out, joiners, stops)


def _place(rng: random.Random, i: int, kind: str, ranks: int, world: int, steps: int, joiners: dict[str, str],
           stops: list[tuple[float, float]]) -> Fault:
    """Where and when fault ``i`` of ``kind`` comes."""
    step = rng.randrange(1, steps - 1)
    if kind in ("exception", "hang_step"):
        return Fault(i, kind, "step", rng.randrange(world), step)
    if kind == "hang_hook":
        return Fault(i, kind, rng.choice(("finalize", "health_check", "abort")), rng.randrange(ranks), step)
    if kind == "store_stop":
        stops.append((float(i), round(rng.uniform(0.3, 2.0), 2)))  # the runner's: at the i-th restart
        return Fault(i, kind, "store", None, step)
    if kind in JOINER_KINDS:
        seat = rng.randrange(world)
        joiners[f"{seat}:{1 + rng.randrange(3)}"] = kind  # one of the seat's first three replacements
        return Fault(i, kind, "joiner", seat, step)
    where = rng.choices(("step", "after", "abort", "finalize", "health_check", "barrier", "reassignment",
                         "takeover"), (4, 2, 1, 1, 1, 1, 1, 0.5))[0]
    if where == "reassignment" and kind == "sigint":
        where = "step"  # a KeyboardInterrupt in the leader's rank assignment ends the whole job (by design)
    if where == "after":  # a spare too: whoever holds the seat
        return Fault(i, kind, "after", rng.randrange(world), step, round(rng.uniform(0.05, 0.5), 3))
    if where in LEADER_PHASES:
        return Fault(i, kind, where, None, step)
    return Fault(i, kind, where, rng.randrange(world if where == "step" else ranks), step)
