"""A custom hook of every kind, written against nvidia_resiliency_ext's hook classes.

Each hook subclasses the library's base class (as nvidia_resiliency_ext
requires) and records when it ran; only the import line changed. The test
compares the record with the documented order: initialize and health_check
before every iteration, abort then finalize then health_check at every
restart, completion once at the end, terminate only on a rank that leaves.

MIGRATION_OUT and MIGRATION_FAULT as in basic.py; MIGRATION_FINALIZE_FAILS
names a rank whose finalize raises (it leaves the job with that exception).
"""

import datetime
import json
import os
import pathlib

import torch

import inprocess  # was: import nvidia_resiliency_ext.inprocess as inprocess

OUT = pathlib.Path(os.environ["MIGRATION_OUT"])
FAULT_RANK, FAULT_STEP = (int(v) for v in os.environ.get("MIGRATION_FAULT", "-1:-1").split(":"))
FINALIZE_FAILS = int(os.environ.get("MIGRATION_FINALIZE_FAILS", "-1"))
calls = []


def record(name, state):
    calls.append([name, state.iteration])


class Init(inprocess.initialize.Initialize):
    def __call__(self, state):
        record("initialize", state)
        return state


class Abort(inprocess.abort.Abort):
    def __call__(self, state):
        record("abort", state)
        return state


class Finalize(inprocess.finalize.Finalize):
    def __call__(self, state):
        record("finalize", state)
        if state.initial_rank == FINALIZE_FAILS:
            raise ValueError(f"finalize failed on rank {state.initial_rank}")
        return state


class Health(inprocess.health_check.HealthCheck):
    def __call__(self, state):
        record("health_check", state)
        return state


class Completion(inprocess.completion.Completion):
    def __call__(self, state):
        record("completion", state)
        return state


class Terminate(inprocess.terminate.Terminate):
    def __call__(self, state):
        record("terminate", state)
        return state


@inprocess.Wrapper(
    initialize=Init(),
    abort=inprocess.Compose(Abort(), inprocess.abort.AbortTorchDistributed()),
    finalize=Finalize(),
    health_check=Health(),
    completion=Completion(),
    terminate=Terminate(),
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=60),
    completion_timeout=datetime.timedelta(seconds=60),
)
def train(call_wrapper: inprocess.CallWrapper | None = None):
    rank = int(os.environ["RANK"])
    calls.append(["function", call_wrapper.iteration])
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.PrefixStore(f"pg{call_wrapper.iteration}", inprocess_store()),
        rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=10),
    )
    for step in range(6):
        if call_wrapper.iteration == 0 and (rank, step) == (FAULT_RANK, FAULT_STEP):
            raise RuntimeError(f"example fault at {step=}")
        torch.distributed.all_reduce(torch.ones(4))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return rank


_store = []


def inprocess_store():
    """The application's own store (MASTER_PORT + 1), built once per process."""
    if not _store:
        _store.append(torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, int(os.environ["WORLD_SIZE"]),
            int(os.environ["RANK"]) == 0, multi_tenant=True, wait_for_workers=False,
        ))
    return _store[0]


if __name__ == "__main__":
    initial_rank = int(os.environ["RANK"])
    try:
        outcome = {"returned": train()}
    except BaseException as e:
        outcome = {"raised": type(e).__name__, "message": str(e)}
    (OUT / f"rank{initial_rank}.json").write_text(json.dumps({"outcome": outcome, "calls": calls}))
