"""A rank of the per-rank rank assignment end-to-end tests: 4 ranks, gloo, the real store.

The rank assignment is a custom per-rank hook written as for
nvidia_resiliency_ext.inprocess: its ``__call__(ctx)`` reads ``ctx.state``
and ``ctx.terminated_ranks`` and returns the rank's next state.

INPROCESS_TEST_SCENARIO:
  "spare"     KeepSpare: ranks shift down over the terminated ones and at most
              3 are active, so initial rank 3 starts as a spare; initial rank 1
              leaves with sys.exit(3) in iteration 0 and the spare takes over.
  "mismatch"  SpareAfterOwnFault: a rank whose own function raised becomes a
              spare. The hook reads ctx.state.fn_exception, which only the rank
              itself knows: initial rank 2 raises in iteration 0, its own run
              disagrees with the leader's decision, and the job must end.

Each hook call is recorded (who was evaluated, on which rank, with what);
every rank writes its record to INPROCESS_TEST_OUT/rank<initial rank>.json.
"""

import dataclasses
import datetime
import json
import logging
import os
import sys

import torch
import torch.distributed as dist

import inprocess
from inprocess.rank_assignment import RankAssignment, RankAssignmentCtx, RankDiscarded
from inprocess.state import Mode

STEPS = 4
INITIAL_RANK = int(os.environ["RANK"])
OUT = os.environ["INPROCESS_TEST_OUT"]
SCENARIO = os.environ["INPROCESS_TEST_SCENARIO"]
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(threadName)s %(message)s")

log = {"initial_rank": INITIAL_RANK, "hook_calls": [], "iterations": []}


def record_call(ctx: RankAssignmentCtx) -> None:
    s = ctx.state
    log["hook_calls"].append({
        "for": s.initial_rank, "iteration": s.iteration, "mode": s.mode.name, "rank": s.rank,
        "world_size": s.world_size, "active_world_size": s.active_world_size,
        "terminated": sorted(ctx.terminated_ranks),
        "fn_exception": None if s.fn_exception is None else type(s.fn_exception).__name__,
    })


def shifted(ctx: RankAssignmentCtx) -> tuple[int, int]:
    s, gone = ctx.state, ctx.terminated_ranks
    if s.rank in gone:
        raise RankDiscarded(f"rank {s.rank} is terminated")
    return s.rank - sum(1 for t in gone if t < s.rank), s.world_size - len(gone)


def with_activity(ctx: RankAssignmentCtx, rank: int, world_size: int, active_world_size: int) -> RankAssignmentCtx:
    active = rank < active_world_size
    ctx.state = dataclasses.replace(
        ctx.state, rank=rank, world_size=world_size, active_world_size=active_world_size,
        mode=Mode.ACTIVE if active else Mode.INACTIVE, active_rank=rank if active else None,
    )
    ctx.terminated_ranks = set()
    return ctx


class KeepSpare(RankAssignment):
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        record_call(ctx)
        rank, world_size = shifted(ctx)
        return with_activity(ctx, rank, world_size, min(3, world_size))


class SpareAfterOwnFault(RankAssignment):
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        record_call(ctx)
        rank, world_size = shifted(ctx)
        ctx = with_activity(ctx, rank, world_size, world_size)
        if ctx.state.fn_exception is not None:  # known to this rank only: not an agreed input
            ctx.state = dataclasses.replace(ctx.state, mode=Mode.INACTIVE, active_rank=None)
        return ctx


def td(seconds):
    return datetime.timedelta(seconds=seconds)


@inprocess.Wrapper(
    rank_assignment=KeepSpare() if SCENARIO == "spare" else SpareAfterOwnFault(),
    barrier_timeout=td(30),
    completion_timeout=td(30),
    soft_timeout=td(10),
    hard_timeout=td(20),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    it = call_wrapper.iteration
    state = call_wrapper.frozen_state
    entry = {
        "iteration": it, "active_rank": state.active_rank, "active_world_size": state.active_world_size,
        "rank": state.rank, "world_size": state.world_size, "env_rank": os.environ.get("RANK"),
        "env_world_size": os.environ.get("WORLD_SIZE"), "steps": 0,
    }
    log["iterations"].append(entry)
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=td(10))
    total = None
    for step in range(STEPS):
        call_wrapper.ping()
        if it == 0 and step == 1:
            if SCENARIO == "spare" and INITIAL_RANK == 1:
                sys.exit(3)
            if SCENARIO == "mismatch" and INITIAL_RANK == 2:
                raise RuntimeError("injected fault of initial rank 2")
        t = torch.tensor([float(state.active_rank + 1)])
        dist.all_reduce(t)
        total = float(t)
        entry["steps"] = step + 1
    holders = [torch.zeros(1, dtype=torch.int64) for _ in range(state.active_world_size)]
    dist.all_gather(holders, torch.tensor([INITIAL_RANK], dtype=torch.int64))
    entry["holders"] = [int(h) for h in holders]
    dist.destroy_process_group()
    return {"iteration": it, "sum": total}


def main():
    code = 0
    try:
        log["result"] = train()
    except SystemExit as e:
        log["exception"] = "SystemExit"
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        log["exception"] = type(e).__name__
        log["message"] = str(e)
        code = 17
    with open(os.path.join(OUT, f"rank{INITIAL_RANK}.json"), "w") as f:
        json.dump(log, f)
    sys.exit(code)


if __name__ == "__main__":
    main()
