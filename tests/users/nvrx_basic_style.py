"""A training script written the way NVRx's basic example is (``examples/inprocess/basic_example.py``).

The whole ``main()`` is wrapped and rebuilt on every iteration: the model, the
optimizer, the application's own ``TCPStore`` (a new one per iteration, on
``MASTER_PORT + 2 + iteration``, served by rank 0 with ``multi_tenant=True``),
the process group and DDP. The Wrapper's own store is on ``MASTER_PORT + 1``
(``store_kwargs``), away from torchrun's agent store on ``MASTER_PORT``. State
survives a restart only through the checkpoint, written under ``atomic()``.

Launched as that example's documentation says::

    python -m torch.distributed.run --standalone --nproc-per-node 4 nvrx_basic_style.py --device cpu ...

Only the import line differs from what an NVRx user writes. Unlike the example,
the fault is not random: ``--fault RANK:STEP`` raises on that rank at that
training step of the first iteration, so that a test knows what to expect.
Each rank writes what it saw to ``--out``/rank<RANK>.json once ``main()`` returned.
"""

import argparse
import datetime
import json
import logging
import os
import pathlib
import time

os.environ["TORCH_CPP_LOG_LEVEL"] = "error"
import torch

import inprocess  # an NVRx user writes: import nvidia_resiliency_ext.inprocess as inprocess

raise_timestamp: float | None = None
seen: dict = {"iterations": [], "resumed_at": [], "restart_latency_s": []}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="NVRx basic-example style training")
    parser.add_argument("--size", default=32, type=int, help="model hidden size")
    parser.add_argument("--layers", default=3, type=int, help="number of layers")
    parser.add_argument("--chkpt-interval", default=5, type=int, help="checkpointing interval")
    parser.add_argument("--total-iterations", default=30, type=int, help="total training iterations")
    parser.add_argument("--fault", default=None, help="RANK:STEP raises in the first iteration")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="where each rank writes its record")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--log-level", default="INFO", type=lambda s: logging._nameToLevel[s.upper()])
    return parser.parse_args()


# The Wrapper's store on MASTER_PORT + 1: torchrun's agent store is on MASTER_PORT,
# the application's own stores on MASTER_PORT + 2 + iteration.
@inprocess.Wrapper(
    store_kwargs={"port": int(os.getenv("MASTER_PORT", 29500)) + 1},
    health_check=inprocess.health_check.CudaHealthCheck(),
)
def main(call_wrapper: inprocess.CallWrapper | None = None) -> dict:
    global raise_timestamp
    if raise_timestamp is not None:
        seen["restart_latency_s"].append(time.perf_counter() - raise_timestamp)
        logging.info("restart latency: %.3fs", seen["restart_latency_s"][-1])
    raise_timestamp = None
    seen["iterations"].append(call_wrapper.iteration)

    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    fault_rank, fault_step = (int(v) for v in args.fault.split(":")) if args.fault else (-1, -1)

    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend, timeout = torch.device("cuda"), "nccl", datetime.timedelta(seconds=150)
    else:
        device, backend, timeout = torch.device("cpu"), "gloo", datetime.timedelta(seconds=10)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.size, args.size) for _ in range(args.layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    # A new store per iteration, on a port of its own: the previous iteration's may still be closing.
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 2 + call_wrapper.iteration,
        world_size=world_size,
        is_master=rank == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    torch.distributed.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                         timeout=timeout)
    model_ddp = torch.nn.parallel.DistributedDataParallel(model)

    start = 0
    checkpoint_path = args.out / "checkpoint.pt"
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        start = checkpoint["step"] + 1
    seen["resumed_at"].append(start)

    torch.manual_seed(1000 + rank)
    loss = torch.tensor(float("nan"))
    step = start
    for step in range(start, args.total_iterations):
        if step % args.chkpt_interval == args.chkpt_interval - 1:
            torch.distributed.barrier()
            if rank == 0:
                checkpoint = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                # Not interrupted half-way by a restart: the file is whole or absent.
                with call_wrapper.atomic():
                    torch.save(checkpoint, checkpoint_path)
        if call_wrapper.iteration == 0 and (rank, step) == (fault_rank, fault_step):
            raise_timestamp = time.perf_counter()
            raise RuntimeError(f"example fault at {step=} from {rank=}")
        inp = torch.rand(args.size, args.size).to(device)
        model.zero_grad()
        loss = model_ddp(inp).square().mean()
        loss.backward()
        opt.step()

    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return {"step": step, "loss": loss.item(), "checksum": sum(float(p.sum()) for p in model.parameters())}


if __name__ == "__main__":
    args = parse_args()
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=args.log_level)
    result = main()
    record = dict(seen, result=result, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                  master_port=int(os.environ["MASTER_PORT"]),
                  agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    (args.out / f"rank{record['rank']}.json").write_text(json.dumps(record))
