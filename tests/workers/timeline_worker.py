"""A rank of a short gloo job with events on, for the timeline's end-to-end test.

argv: EVENTS_DIR FAILING_RANK. The failing rank raises in iteration 0 after a
few allreduces; iteration 1 completes on every rank, which prints
"finished iteration <i>".
"""

import datetime
import sys

import torch
import torch.distributed as dist

import inprocess

EVENTS_DIR, FAILING_RANK = sys.argv[1], int(sys.argv[2])


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=3),
    events_dir=EVENTS_DIR,
    soft_timeout=td(20),
    hard_timeout=td(30),
    barrier_timeout=td(60),
    completion_timeout=td(60),
)
def train(call_wrapper: inprocess.CallWrapper = None) -> int:
    me = call_wrapper.frozen_state
    dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank,
                            world_size=me.active_world_size, timeout=td(30))
    t = torch.ones(8)
    for step in range(4):
        call_wrapper.ping()
        dist.all_reduce(t)
        if me.iteration == 0 and me.initial_rank == FAILING_RANK and step == 2:
            raise RuntimeError("timeline test fault")
    dist.destroy_process_group()
    return me.iteration


print(f"finished iteration {train()}", flush=True)
