"""A rank of a small gloo job under inprocess.Wrapper whose training code names no fault.

The loop calls ``inprocess.faults.maybe_inject(step)`` every step; the
wrapper arms the timed faults itself when an iteration starts. Which fault, on
which rank and when comes only from INPROCESS_FAULTS.

Environment: INPROCESS_TEST_OUT (directory for rank<N>.json), FAULTS_TEST_STEPS
(default 8), FAULTS_TEST_STEP_SLEEP (seconds per step, default 0.05).
"""

import datetime
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import inprocess
from inprocess import faults

OUT = os.environ["INPROCESS_TEST_OUT"]
INITIAL_RANK = int(os.environ["RANK"])
STEPS = int(os.environ.get("FAULTS_TEST_STEPS", "8"))
STEP_SLEEP = float(os.environ.get("FAULTS_TEST_STEP_SLEEP", "0.05"))
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(name)s %(message)s")

log = {"initial_rank": INITIAL_RANK, "iterations": []}
LAST_CALL = {}


def td(seconds):
    return datetime.timedelta(seconds=seconds)


@inprocess.Wrapper(barrier_timeout=td(30), completion_timeout=td(30), soft_timeout=td(10), hard_timeout=td(20))
def train(call_wrapper: inprocess.CallWrapper = None):
    LAST_CALL["call"] = call_wrapper
    state = call_wrapper.frozen_state
    entry = {"iteration": state.iteration, "world_size": state.active_world_size, "steps": 0}
    log["iterations"].append(entry)
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=td(10))
    total = torch.zeros(4, dtype=torch.float64)  # exact sums: the test recomputes them
    for step in range(STEPS):
        call_wrapper.ping()
        faults.maybe_inject(step)
        total += 1
        dist.all_reduce(total)
        entry["steps"] = step + 1
        time.sleep(STEP_SLEEP)
    dist.destroy_process_group()
    return {"iteration": state.iteration, "total": float(total[0])}


def main():
    failed = False
    try:
        log["result"] = train()
    except BaseException as e:
        failed = True
        log["exception"] = type(e).__name__
        log["message"] = str(e)
    call = LAST_CALL.pop("call", None)
    log["restarts"] = [
        {"iteration": r.iteration, "terminated": r.terminated,
         "faults": [{"rank": f.rank, "type": f.type, "kind": f.kind, "message": f.message} for f in r.faults]}
        for r in (call.restarts if call is not None else [])
    ]
    with open(os.path.join(OUT, f"rank{INITIAL_RANK}.json"), "w") as f:
        json.dump(log, f)
    if failed:
        sys.exit(17)


if __name__ == "__main__":
    main()
