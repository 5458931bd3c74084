"""A rank of the Tree end-to-end test: two fake nodes of 3 ranks, one spare per node.

Each rank derives its node from its initial RANK (rank // 3) and exports it
as INPROCESS_TEST_NODE before the Wrapper starts; the Tree reads it with
EnvKey at the initial barrier, as a real job would read SLURM_NODEID.

Configured by environment variables (the test sets them):
  INPROCESS_TEST_OUT     directory for this rank's JSON result
  INPROCESS_TEST_LEAVER  initial rank that leaves with sys.exit(3) in iteration 0
  INPROCESS_TEST_LEAVE_BY  "exit" (default) or "sigkill": how it leaves
"""

import datetime
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

import inprocess
from inprocess.rank_assignment import EnvKey, Layer, LayerFlag, Tree

PER_NODE = 3
STEPS = 4
INITIAL_RANK = int(os.environ["RANK"])
OUT = os.environ["INPROCESS_TEST_OUT"]
LEAVER = int(os.environ["INPROCESS_TEST_LEAVER"])
os.environ["INPROCESS_TEST_NODE"] = f"node{INITIAL_RANK // PER_NODE}"
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(threadName)s %(message)s")


def td(seconds):
    return datetime.timedelta(seconds=seconds)


tree = Tree([
    Layer(key_or_fn="job", flag=LayerFlag.RESERVE),
    Layer(max_ranks=2, key_or_fn=EnvKey("INPROCESS_TEST_NODE"), flag=LayerFlag.RESERVE),
])
log = {"initial_rank": INITIAL_RANK, "node": os.environ["INPROCESS_TEST_NODE"], "iterations": []}


@inprocess.Wrapper(
    rank_assignment=tree,
    barrier_timeout=td(30),
    completion_timeout=td(30),
    soft_timeout=td(10),
    hard_timeout=td(20),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    it = call_wrapper.iteration
    state = call_wrapper.frozen_state
    entry = {
        "iteration": it,
        "active_rank": state.active_rank,
        "active_world_size": state.active_world_size,
        "rank": state.rank,
        "world_size": state.world_size,
        "env_rank": os.environ.get("RANK"),
        "env_world_size": os.environ.get("WORLD_SIZE"),
        "steps": 0,
    }
    log["iterations"].append(entry)
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=td(10))
    total = None
    for step in range(STEPS):
        call_wrapper.ping()
        if it == 0 and step == 1 and INITIAL_RANK == LEAVER:
            if os.environ.get("INPROCESS_TEST_LEAVE_BY") == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)  # seen by this rank's monitor process
            sys.exit(3)
        t = torch.tensor([float(state.active_rank + 1)])
        dist.all_reduce(t)
        total = float(t)
        entry["steps"] = step + 1
    # Who holds which rank, as the collective itself sees it.
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
