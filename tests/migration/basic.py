"""The whole main() wrapped, as nvidia_resiliency_ext's usage guide shows first.

Written the way a user of nvidia_resiliency_ext.inprocess writes it; only the
import line changed. Everything is rebuilt on every iteration: the model,
the optimizer, the application's own TCPStore (MASTER_PORT + 1, hosted by
rank 0 with multi_tenant=True) and the process group. State survives a restart
only through the checkpoint file, saved under atomic().

The test harness sets MIGRATION_OUT (where each rank writes what it saw) and
MIGRATION_FAULT ("<rank>:<step>": that rank raises at that step of the first
iteration).
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
seen = {"iterations": [], "resumed_at": []}


# The Wrapper's own store on MASTER_PORT + 2, away from the application's (+ 1).
@inprocess.Wrapper(
    store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
    health_check=inprocess.health_check.CudaHealthCheck(),
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=60),
    completion_timeout=datetime.timedelta(seconds=60),
)
def main(call_wrapper: inprocess.CallWrapper | None = None):
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    seen["iterations"].append(call_wrapper.iteration)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 1,
        world_size=world_size,
        is_master=rank == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    torch.distributed.init_process_group(
        backend="gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=10)
    )
    model_ddp = torch.nn.parallel.DistributedDataParallel(model)

    checkpoint_path = OUT / "checkpoint.pt"
    start = 0
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        start = checkpoint["step"] + 1
    seen["resumed_at"].append(start)

    loss = torch.tensor(float("nan"))
    for step in range(start, TOTAL_STEPS):
        if step % CHECKPOINT_EVERY == CHECKPOINT_EVERY - 1:
            torch.distributed.barrier()
            if rank == 0:
                checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                with call_wrapper.atomic():
                    torch.save(checkpoint, checkpoint_path)
        if call_wrapper.iteration == 0 and (rank, step) == (FAULT_RANK, FAULT_STEP):
            raise RuntimeError(f"example fault at {step=} from {rank=}")
        model.zero_grad()
        loss = model_ddp(torch.rand(16, 16)).square().mean()
        loss.backward()
        opt.step()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return {"rank": rank, "loss": float(loss.item()), "steps": TOTAL_STEPS - start}


if __name__ == "__main__":
    result = main()
    rank = int(os.environ["RANK"])
    (OUT / f"rank{rank}.json").write_text(json.dumps({"result": result, **seen}))
