"""A rank that makes several wrapped calls in a row, as a script with two training phases does.

Environment: INPROCESS_TEST_OUT (directory of the JSON result), INPROCESS_TEST_PLAN
({"calls": 20}; optional soft_timeout, hard_timeout, termination_grace_time,
barrier_timeout in seconds). Each call runs one iteration: a gloo group over the call's
store, one allreduce, the group destroyed. The result lists, per call, the
allreduce's sum and how long the call took.
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

PLAN = json.loads(os.environ.get("INPROCESS_TEST_PLAN", "{}"))
OUT = os.environ["INPROCESS_TEST_OUT"]
RANK = int(os.environ["RANK"])
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{RANK} %(threadName)s %(message)s")


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=1),
    soft_timeout=datetime.timedelta(seconds=PLAN.get("soft_timeout", 10)),
    hard_timeout=datetime.timedelta(seconds=PLAN.get("hard_timeout", 20)),
    termination_grace_time=datetime.timedelta(seconds=PLAN.get("termination_grace_time", 5)),
    barrier_timeout=datetime.timedelta(seconds=PLAN.get("barrier_timeout", 30)),
    completion_timeout=datetime.timedelta(seconds=30),
)
def train(call: int, call_wrapper: inprocess.CallWrapper = None):
    state = call_wrapper.frozen_state
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=datetime.timedelta(seconds=20))
    value = torch.tensor([float(call + state.active_rank)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return float(value.item())


def main():
    log = {"calls": []}
    code = 0
    try:
        for call in range(PLAN.get("calls", 2)):
            t0 = time.monotonic()
            total = train(call)
            log["calls"].append({"call": call, "sum": total, "seconds": time.monotonic() - t0})
    except BaseException as e:
        log["exception"] = f"{type(e).__name__}: {e}"
        code = 17
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(log, f)
    sys.exit(code)


if __name__ == "__main__":
    main()
