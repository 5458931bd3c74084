"""A rank whose own exception is still on its way out of the function when the restart it
caused arrives (the restart's signal raises on top of it, in a ``finally`` block).

Rank 1 raises ``ValueError`` and, in a ``finally`` block, tells rank 0 and waits; rank 0 then
raises what a gloo pair raises when its peer's group is gone, which requests the restart.
So the only first-hand fault is rank 0's communication error, and rank 1's exception reaches
its wrapper only under the restart. Environment: INPROCESS_TEST_OUT (directory of the JSON
result). Each rank writes the summary of its one restart and the causes' ranks and types.
"""

import datetime
import json
import os
import sys
import time

import inprocess

OUT = os.environ["INPROCESS_TEST_OUT"]
RANK = int(os.environ["RANK"])


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=2),
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=40),
    completion_timeout=datetime.timedelta(seconds=30),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    state = call_wrapper.frozen_state
    if state.iteration > 0:
        record = call_wrapper.restarts[-1]
        return {"summary": record.summary(state.active_world_size, state.world_size),
                "causes": [[f.rank, f.kind, f.type] for f in record.causes],
                "consequences": [[f.rank, f.kind, f.type] for f in record.consequences]}
    if state.rank == 1:
        try:
            raise ValueError("rank 1's own fault")
        finally:
            call_wrapper.store.set("rank 1 raised", "1")
            time.sleep(20)  # the restart that rank 0 requests comes here
    if state.rank == 0:
        call_wrapper.store.wait(["rank 1 raised"], datetime.timedelta(seconds=20))
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5007")
    time.sleep(20)  # the others train on until the restart
    return None


if __name__ == "__main__":
    result = train()
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0)
