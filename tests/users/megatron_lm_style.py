"""A training program written in the style of Megatron-LM's in-process restart
(``megatron/training/inprocess_restart.py``, and how ``pretrain_gpt.py`` and ``pretrain()`` use it),
for CPU and gloo. It is our own code, shaped as that code is, so that a program of that shape is
shown to run here changed only in its import line:

* ``maybe_wrap_for_inprocess_restart(pretrain)`` wraps ``pretrain`` and creates the job's own
  ``torch.distributed.TCPStore`` at ``MASTER_PORT + 1`` (hosted by rank 0), passed as ``store``;
  the Wrapper's store is at ``MASTER_PORT + 2`` (``store_kwargs``);
* ``pretrain(..., store, inprocess_call_wrapper)`` prefixes that store with the restart iteration
  and initialises the process group on it;
* the hooks: ``Compose`` chains for ``initialize`` (``RetryController`` + nested-restarter line),
  ``abort`` (``AbortTransformerEngine``, ``AbortTorchDistributed``, a custom ``Abort`` subclass that
  resets the asynchronous checkpoint worker, nested-restarter line) and ``finalize``
  (``ThreadedFinalize`` of a no-argument ``destroy_state`` and of ``torch.cuda.empty_cache``),
  ``CudaHealthCheck``, ``Tree`` of ``Layer``s with warm spares, and Megatron's ``--inprocess-*``
  options with their defaults for every timeout.

Launched as SLURM starts its tasks (one process per task, ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` exported from ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID``,
``MASTER_ADDR``/``MASTER_PORT`` set by the batch script). Each active rank prints ``step N`` as it
trains and ``RESULT {json}`` when done; tests/test_megatron_style.py runs it.
"""

import argparse
import json
import os
import socket
import sys
import time
import warnings
from datetime import timedelta

import torch
import toy_megatron

import inprocess  # for nvidia_resiliency_ext: import nvidia_resiliency_ext.inprocess as inprocess

INITIAL_RANK = os.environ.get("SLURM_PROCID", "?")
ASYNC_STRATEGY = toy_megatron.AsyncCallsQueue()


def say(text: str) -> None:
    print(f"[task {INITIAL_RANK}] {text}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group(title="In-process restart")  # Megatron-LM's options and defaults
    group.add_argument("--inprocess-restart", action="store_true")
    group.add_argument("--inprocess-max-iterations", default=None, type=int)
    group.add_argument("--inprocess-monitor-thread-interval", default=1.0, type=float)
    group.add_argument("--inprocess-monitor-process-interval", default=1.0, type=float)
    group.add_argument("--inprocess-progress-watchdog-interval", default=1.0, type=float)
    group.add_argument("--inprocess-heartbeat-interval", default=30, type=float)
    group.add_argument("--inprocess-soft-timeout", default=60, type=float)
    group.add_argument("--inprocess-hard-timeout", default=90, type=float)
    group.add_argument("--inprocess-heartbeat-timeout", default=60, type=float)
    group.add_argument("--inprocess-barrier-timeout", default=120, type=float)
    group.add_argument("--inprocess-completion-timeout", default=120, type=float)
    group.add_argument("--inprocess-last-call-wait", default=1, type=float)
    group.add_argument("--inprocess-termination-grace-time", default=1, type=float)
    group.add_argument("--inprocess-granularity", default="node", type=str, choices=["node", "rank"])
    group.add_argument("--inprocess-active-world-size", default=int(os.getenv("WORLD_SIZE", "1")), type=int)
    group.add_argument("--inprocess-empty-cuda-cache", action="store_true")
    training = parser.add_argument_group(title="training")
    training.add_argument("--train-iters", type=int, default=40)
    training.add_argument("--save-interval", type=int, default=5)
    training.add_argument("--save", type=str, required=True)
    training.add_argument("--lr", type=float, default=0.01)
    training.add_argument("--step-time", type=float, default=0.1, help="seconds a step of a real model would take")
    return parser.parse_args(argv)


def destroy_state() -> None:
    toy_megatron.destroy_global_state()
    say("destroy_state: global state reset")


def reset_persistent_async_worker(async_strategy: toy_megatron.AsyncCallsQueue) -> None:
    async_strategy.close(abort=True)
    say("abort: persistent async checkpoint worker reset")


def inprocess_restart(train, args):  # type: ignore[no-untyped-def]
    if os.environ.get("TORCH_CPP_LOG_LEVEL") not in ("error", "fatal"):
        warnings.warn("Set TORCH_CPP_LOG_LEVEL=error to suppress c10d waitForInput timeout warning messages",
                      stacklevel=2)

    # The first layer holds every rank (the root of the topology tree); the second, optional, groups
    # them by node.
    layers = [
        inprocess.rank_assignment.Layer(
            min_ranks=args.inprocess_active_world_size,
            max_ranks=args.inprocess_active_world_size,
            flag=inprocess.rank_assignment.LayerFlag.RESERVE,
        )
    ]
    if args.inprocess_granularity == "node":
        device_count = torch.cuda.device_count()
        layers.append(
            inprocess.rank_assignment.Layer(
                min_ranks=device_count,
                max_ranks=device_count,
                key_or_fn=lambda _: socket.gethostname(),
                flag=inprocess.rank_assignment.LayerFlag.RESERVE,
            )
        )

    finalize = [inprocess.finalize.ThreadedFinalize(timeout=timedelta(seconds=10), fn=destroy_state)]
    if args.inprocess_empty_cuda_cache:
        finalize.append(inprocess.finalize.ThreadedFinalize(timeout=timedelta(seconds=10), fn=torch.cuda.empty_cache))

    initialize = inprocess.Compose(
        inprocess.initialize.RetryController(min_world_size=args.inprocess_active_world_size),
        inprocess.nested_restarter.NestedRestarterHandlingCompleted(),
    )

    class AbortCheckpoint(inprocess.abort.Abort):
        def __init__(self, async_strategy):  # type: ignore[no-untyped-def]
            self.async_strategy = async_strategy

        def __call__(self, state: inprocess.state.FrozenState) -> inprocess.state.FrozenState:
            reset_persistent_async_worker(self.async_strategy)
            return state

    abort = inprocess.Compose(
        inprocess.abort.AbortTransformerEngine(),
        inprocess.abort.AbortTorchDistributed(),
        AbortCheckpoint(ASYNC_STRATEGY),
        inprocess.nested_restarter.NestedRestarterHandlingStarting(),
    )
    completion = inprocess.nested_restarter.NestedRestarterFinalized()
    terminate = inprocess.nested_restarter.NestedRestarterAborted()

    return inprocess.Wrapper(
        store_kwargs={
            "timeout": timedelta(seconds=300),
            "port": int(os.environ["MASTER_PORT"]) + 2,
        },
        initialize=initialize,
        abort=abort,
        completion=completion,
        terminate=terminate,
        health_check=inprocess.health_check.CudaHealthCheck(timeout=timedelta(seconds=10)),
        rank_assignment=inprocess.rank_assignment.Tree(layers=layers),
        finalize=inprocess.Compose(*finalize),
        heartbeat_interval=timedelta(seconds=args.inprocess_heartbeat_interval),
        heartbeat_timeout=timedelta(seconds=args.inprocess_heartbeat_timeout),
        barrier_timeout=timedelta(seconds=args.inprocess_barrier_timeout),
        completion_timeout=timedelta(seconds=args.inprocess_completion_timeout),
        monitor_process_interval=timedelta(seconds=args.inprocess_monitor_process_interval),
        monitor_thread_interval=timedelta(seconds=args.inprocess_monitor_thread_interval),
        last_call_wait=timedelta(seconds=args.inprocess_last_call_wait),
        soft_timeout=timedelta(seconds=args.inprocess_soft_timeout),
        hard_timeout=timedelta(seconds=args.inprocess_hard_timeout),
        termination_grace_time=timedelta(seconds=args.inprocess_termination_grace_time),
        enabled=True,
    )(train)


def maybe_wrap_for_inprocess_restart(pretrain, args):  # type: ignore[no-untyped-def]
    if not args.inprocess_restart:
        return pretrain, None
    pretrain = inprocess_restart(pretrain, args)
    store = torch.distributed.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 1,
        world_size=int(os.getenv("WORLD_SIZE", "1")),
        is_master=(int(os.getenv("RANK", "0")) == 0),
        timeout=timedelta(seconds=300),
        wait_for_workers=True,
        use_libuv=True,
    )
    return pretrain, store


def pretrain(args, store=None, inprocess_call_wrapper: inprocess.CallWrapper | None = None):  # type: ignore[no-untyped-def]
    iteration = 0
    if inprocess_call_wrapper is not None:
        iteration = inprocess_call_wrapper.iteration
        store = torch.distributed.PrefixStore(str(iteration), store)

    # initialize_megatron: the rank and world size as the launcher (or the Wrapper) set them.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                         timeout=timedelta(seconds=60))
    model = toy_megatron.model_provider()
    optimizer = toy_megatron.optimizer_provider(model, args.lr)
    toy_megatron.set_global_state(args=args, model=model, optimizer=optimizer)
    start = toy_megatron.load_checkpoint(args.save, model, optimizer)
    say(f"iteration {iteration}: rank {rank} of {world_size}, resuming at step {start}")

    for step in range(start, args.train_iters):
        toy_megatron.train_step(model, optimizer, step, rank, world_size)
        say(f"step {step + 1}")
        if (step + 1) % args.save_interval == 0:
            toy_megatron.save_checkpoint(ASYNC_STRATEGY, args.save, step + 1, model, optimizer)
        time.sleep(args.step_time)
    ASYNC_STRATEGY.maybe_finalize(blocking=True)

    result = {"initial_rank": int(INITIAL_RANK), "rank": rank, "world_size": world_size, "iteration": iteration,
              "resumed_at": start, "steps": args.train_iters, "parameters": toy_megatron.parameters_of(model)}
    print("RESULT " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


def main() -> int:
    args = parse_args()
    pretrain_fn, store = maybe_wrap_for_inprocess_restart(pretrain, args)
    pretrain_fn(args, store=store)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
