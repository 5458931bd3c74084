"""Process-group-independent objects built once, outside the wrapped function.

The shape of nvidia_resiliency_ext's advanced ("optimal") usage example,
written by a user of that library; only the import line changed. main()
builds the model, the optimizer and the application's TCPStore (MASTER_PORT
+ 1) once; train() is wrapped and gets them as arguments on every iteration,
builds a process group on a PrefixStore scoped to the iteration, and keeps
an in-memory checkpoint in an argument object, committed under atomic().

MIGRATION_OUT and MIGRATION_FAULT as in basic.py.
"""

import datetime
import json
import os
import pathlib

import torch

import inprocess  # was: import nvidia_resiliency_ext.inprocess as inprocess

OUT = pathlib.Path(os.environ["MIGRATION_OUT"])
FAULT_RANK, FAULT_STEP = (int(v) for v in os.environ.get("MIGRATION_FAULT", "-1:-1").split(":"))
TOTAL_STEPS = 12
CHECKPOINT_EVERY = 4


class Checkpoint:
    """Kept in memory by every rank: the wrapper hands the same object to every iteration."""

    def __init__(self):
        self.step = -1
        self.model = None
        self.opt = None
        self.model_ids = []
        self.iterations = []
        self.resumed_at = []


@inprocess.Wrapper(
    store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
    initialize=inprocess.initialize.RetryController(max_iterations=5),
    health_check=inprocess.health_check.FaultCounter(max_rank_faults=2),
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=60),
    completion_timeout=datetime.timedelta(seconds=60),
)
def train(base_store, model, opt, checkpoint, call_wrapper: inprocess.CallWrapper | None = None):
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    checkpoint.iterations.append(call_wrapper.iteration)
    checkpoint.model_ids.append(id(model))

    store = torch.distributed.PrefixStore(str(call_wrapper.iteration), base_store)
    torch.distributed.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=10)
    )
    model_ddp = torch.nn.parallel.DistributedDataParallel(model)

    if checkpoint.model is not None:
        model.load_state_dict(checkpoint.model)
        opt.load_state_dict(checkpoint.opt)
    start = checkpoint.step + 1
    checkpoint.resumed_at.append(start)

    loss = torch.tensor(float("nan"))
    for step in range(start, TOTAL_STEPS):
        if call_wrapper.iteration == 0 and (rank, step) == (FAULT_RANK, FAULT_STEP):
            raise RuntimeError(f"example fault at {step=} from {rank=}")
        call_wrapper.ping()
        model.zero_grad()
        loss = model_ddp(torch.rand(16, 16)).square().mean()
        loss.backward()
        opt.step()
        if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            torch.distributed.barrier()
            with call_wrapper.atomic():
                checkpoint.model = {k: v.clone() for k, v in model.state_dict().items()}
                checkpoint.opt = opt.state_dict()
                checkpoint.step = step
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return {"rank": rank, "loss": float(loss.item()), "steps": TOTAL_STEPS - start}


def main():
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 1,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=rank == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    checkpoint = Checkpoint()
    result = train(store, model, opt, checkpoint)
    (OUT / f"rank{rank}.json").write_text(json.dumps({
        "result": result,
        "iterations": checkpoint.iterations,
        "resumed_at": checkpoint.resumed_at,
        "same_model_every_iteration": len(set(checkpoint.model_ids)) == 1,
    }))


if __name__ == "__main__":
    main()
