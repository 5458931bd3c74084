"""A training script written the way NVRx's optimal example is (``examples/inprocess/optimal_example.py`` in
0.4, ``advanced_example.py`` since 0.5).

Only the training loop and what depends on the process group are restarted:
the model, the optimizer and the application's ``TCPStore`` (``MASTER_PORT + 2``,
served by rank 0, ``multi_tenant=True``) are built once in ``main()`` and
passed to the wrapped ``train()``, which scopes the store to each iteration
with a ``PrefixStore``. The Wrapper's own store is on ``MASTER_PORT + 1``
(``store_kwargs``). With ``--nested-restarter`` the four nested-restarter hooks
are composed in as the example does; ``--nested-keywords`` builds them with the
keywords of NVRx's dataclass API (``restarter_state``, ``restarter_stage``,
``logger``, ``special_rank``).

Launched as that example's documentation says::

    python -m torch.distributed.run --standalone --nproc-per-node 4 nvrx_optimal_style.py --device cpu ...

Only the import line differs from what an NVRx user writes. The fault is not
random: ``--fault RANK:STEP`` raises on that rank at that step of the first
iteration. Each rank writes what it saw to ``--out``/rank<RANK>.json.
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
    parser = argparse.ArgumentParser(description="NVRx optimal-example style training")
    parser.add_argument("--size", default=32, type=int, help="model hidden size")
    parser.add_argument("--layers", default=3, type=int, help="number of layers")
    parser.add_argument("--chkpt-interval", default=5, type=int, help="checkpointing interval")
    parser.add_argument("--total-iterations", default=30, type=int, help="total training iterations")
    parser.add_argument("--fault", default=None, help="RANK:STEP raises in the first iteration")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="where each rank writes its record")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--log-level", default="INFO", type=lambda s: logging._nameToLevel[s.upper()])
    parser.add_argument("--nested-restarter", action="store_true", help="status lines for a nested restarter")
    parser.add_argument("--nested-keywords", action="store_true", help="the hooks built with their keywords")
    return parser.parse_args()


def train(base_store, model, opt, backend, device, timeout, args,
          call_wrapper: inprocess.CallWrapper | None = None) -> dict:
    global raise_timestamp
    if raise_timestamp is not None:
        seen["restart_latency_s"].append(time.perf_counter() - raise_timestamp)
        logging.info("restart latency: %.3fs", seen["restart_latency_s"][-1])
    raise_timestamp = None
    seen["iterations"].append(call_wrapper.iteration)

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    fault_rank, fault_step = (int(v) for v in args.fault.split(":")) if args.fault else (-1, -1)

    # The application's store, built once, scoped to this restart iteration.
    store = torch.distributed.PrefixStore(str(call_wrapper.iteration), base_store)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
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


def nested_restarter_hooks(args: argparse.Namespace) -> dict:
    nested = inprocess.nested_restarter
    if not args.nested_keywords:
        return {
            "initialize": nested.NestedRestarterHandlingCompleted(),
            "abort": inprocess.Compose(inprocess.abort.AbortTorchDistributed(),
                                       nested.NestedRestarterHandlingStarting()),
            "completion": nested.NestedRestarterFinalized(),
            "terminate": nested.NestedRestarterAborted(),
        }
    # NVRx's hooks are dataclasses: their fields are keywords (nested_restarter.py, NestedRestarterCallback).
    logger = nested.NestedRestarterLogger()
    return {
        "initialize": nested.NestedRestarterHandlingCompleted(special_rank=0),
        "abort": inprocess.Compose(
            inprocess.abort.AbortTorchDistributed(),
            nested.NestedRestarterHandlingStarting(restarter_state="handling", restarter_stage="starting",
                                                   logger=logger, special_rank=0),
        ),
        "completion": nested.NestedRestarterFinalized(restarter_state="finalized", logger=logger),
        "terminate": nested.NestedRestarterAborted(restarter_state="aborted", logger=logger, special_rank=0),
    }


def main() -> None:
    args = parse_args()
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=args.log_level)
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend, timeout = torch.device("cuda"), "nccl", datetime.timedelta(seconds=150)
    else:
        device, backend, timeout = torch.device("cpu"), "gloo", datetime.timedelta(seconds=10)

    # Built once, reused by every restart iteration.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.size, args.size) for _ in range(args.layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 2,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )

    wrapper_kwargs = {
        "store_kwargs": {"port": int(os.getenv("MASTER_PORT", 29500)) + 1},
        "health_check": inprocess.health_check.CudaHealthCheck(),
    }
    if args.nested_restarter or args.nested_keywords:
        wrapper_kwargs.update(nested_restarter_hooks(args))
    wrapped_train = inprocess.Wrapper(**wrapper_kwargs)(train)
    result = wrapped_train(store, model, opt, backend, device, timeout, args)

    record = dict(seen, result=result, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                  master_port=int(os.environ["MASTER_PORT"]),
                  agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    (args.out / f"rank{record['rank']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
