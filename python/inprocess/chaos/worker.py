"""One rank of a chaos run: ``python -m inprocess.launch ... worker.py SCHEDULE_JSON OUT_DIR``.

A small gloo job under ``inprocess.Wrapper`` with short timeouts, spares, grow points and (with
several nodes) node agents. Each iteration runs the schedule's steps (``ping()``, the toolkit's step
faults, an allreduce, a ``safe_point()``); an iteration of the schedule that ends without a restart
(its fault did not fire) is ended by a filler exception on active rank 0, so that every scheduled
iteration restarts. A respawned process (``INPROCESS_RESPAWN_COUNT``) that the schedule names dies
while it waits to be admitted, or right after its admission. At each iteration's start the rank
writes its descriptors once its group is made (and active rank 0 the store's keys) to ``OUT_DIR/obs/``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import inprocess
from inprocess import faults
from inprocess.chaos.schedule import Schedule

SCHEDULE = Schedule.from_json(open(sys.argv[1]).read())
OUT = sys.argv[2]
RANK = int(os.environ["RANK"])
LIFE = int(os.environ.get("INPROCESS_RESPAWN_COUNT", "0"))
STEP_S = 0.025
TIMEOUTS: dict[str, Any] = {
    name: datetime.timedelta(seconds=seconds) for name, seconds in (
        ("soft_timeout", 1.5), ("hard_timeout", 3.0), ("termination_grace_time", 0.5), ("heartbeat_interval", 0.5),
        ("heartbeat_timeout", 3.0), ("barrier_timeout", 30.0), ("completion_timeout", 30.0),
        ("progress_watchdog_interval", 0.2), ("monitor_thread_interval", 0.2))}
logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s r{RANK}.{LIFE} %(name)s %(message)s")


class ChaosFiller(RuntimeError):
    """The iteration's scheduled fault did not fire: the iteration restarts all the same."""


def observe(call_wrapper: inprocess.CallWrapper, iteration: int, active_rank: int | None, world: int) -> None:
    # The group's size with it: gloo holds one socket per peer, so the count follows the world as it grows back.
    record: dict[str, Any] = {"iteration": iteration, "fds": len(os.listdir("/proc/self/fd")),
                              "world": world}
    if active_rank == 0:
        try:
            record["keys"] = [str(k) for k in call_wrapper._runtime.store.list_keys()]
        except Exception as e:  # noqa: BLE001 - an observation, not the job
            record["keys_error"] = f"{type(e).__name__}: {e}"
    with open(os.path.join(OUT, "obs", f"{RANK}.{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def rank_assignment() -> Any:
    R = inprocess.rank_assignment
    return inprocess.Compose(R.MaxActiveWorldSize(SCHEDULE.ranks), R.ActivateAllRanks(), R.ShiftRanks())


@inprocess.Wrapper(rank_assignment=rank_assignment(), grow=inprocess.GrowPolicy(min_waiting=1, check_every=5),
                   node_agent=True if SCHEDULE.nodes > 1 else None, **TIMEOUTS)
def train(call_wrapper: inprocess.CallWrapper = None) -> int:  # type: ignore[assignment]
    s = call_wrapper.frozen_state
    assert s.active_rank is not None and s.active_world_size is not None  # the function runs on active ranks
    dist.init_process_group("gloo", store=call_wrapper.store, rank=s.active_rank, world_size=s.active_world_size,
                            timeout=datetime.timedelta(seconds=15))
    # Once the group is made: the failed iteration's connections are held until then (engine/connection_release).
    observe(call_wrapper, s.iteration, s.active_rank, s.active_world_size)
    total = torch.zeros(1)
    for step in range(SCHEDULE.steps):
        call_wrapper.ping()
        faults.maybe_inject(step)
        total += 1
        dist.all_reduce(total)
        time.sleep(STEP_S)
        call_wrapper.safe_point()
    dist.destroy_process_group()
    if s.iteration < SCHEDULE.iterations and s.active_rank == 0:
        raise ChaosFiller(f"iteration {s.iteration}: its scheduled fault did not fire")
    return s.iteration


def joiner_fault(kind: str) -> None:
    """A respawned process's own fault: it dies while it waits to be admitted, or once admitted."""
    started = time.monotonic()
    while True:
        call = inprocess.current_call()
        admitted = call is not None and getattr(call, "_membership", None) is not None
        if kind == "die_admitted" and admitted:
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "die_waiting":
            if admitted:
                return  # admitted before its time came: the fault does not fire
            if call is not None and time.monotonic() - started > 0.5:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.002)


def main() -> int:
    os.makedirs(os.path.join(OUT, "obs"), exist_ok=True)
    kind = SCHEDULE.joiners.get(f"{RANK}:{LIFE}") if LIFE else None
    if kind is not None:
        threading.Thread(target=joiner_fault, args=(kind,), name="chaos-joiner-fault", daemon=True).start()
    try:
        train()
    except BaseException as e:  # noqa: BLE001 - the exit status says it to the launcher
        logging.getLogger("chaos").warning("rank %d (life %d) leaves: %s: %s", RANK, LIFE, type(e).__name__, e)
        if isinstance(e, KeyboardInterrupt):
            raise
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
