"""A training program written in the style of Megatron-Bridge's in-process restart
(``src/megatron/bridge/training/inprocess_restart.py`` and how ``pretrain()`` calls it), for CPU
and gloo. It is our own code, shaped as that code is, so that a program of that shape is shown to
run here changed only in its import line:

* an ``InProcessRestartConfig`` dataclass with Bridge's fields and defaults;
* ``maybe_wrap_for_inprocess_restart(_pretrain, config, state)`` creates the job's own
  ``torch.distributed.TCPStore`` at ``MASTER_PORT + 1`` and wraps, not ``_pretrain`` itself, an
  adapter ``_adapter(*args, inprocess_call_wrapper: Optional[CallWrapper] = None, **kwargs)`` that
  exposes the annotated parameter the Wrapper injects and passes it on by keyword;
* ``health_check=Compose(CudaHealthCheck(timeout), FaultCounter(max_rank_faults))``; the abort hook
  closes the global state's asynchronous checkpoint queue; ``destroy_state`` catches and logs
  its own errors; the monitor process's log file is named from ``SLURM_JOB_ID``, the host name,
  ``SLURM_PROCID`` and ``SLURM_LOCALID``, on task 0 only;
* ``_pretrain(state, forward_step_func, callback_manager, store, inprocess_call_wrapper)`` is called
  as ``wrapped_pretrain(state, forward_step_func, callback_manager, store=store)``.

Launched as SLURM starts its tasks, as megatron_lm_style.py is; tests/test_megatron_style.py runs it.
"""

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
import toy_megatron

import inprocess  # for nvidia_resiliency_ext: import nvidia_resiliency_ext.inprocess as inprocess
from inprocess import CallWrapper  # for nvidia_resiliency_ext: from nvidia_resiliency_ext.inprocess import ...

logger = logging.getLogger(__name__)
INITIAL_RANK = os.environ.get("SLURM_PROCID", "?")


def say(text: str) -> None:
    print(f"[task {INITIAL_RANK}] {text}", flush=True)


@dataclasses.dataclass
class InProcessRestartConfig:
    """Bridge's configuration of the in-process restart (its fields and defaults)."""

    enabled: bool = False
    max_iterations: int | None = None
    monitor_thread_interval: float = 1.0
    monitor_process_interval: float = 1.0
    progress_watchdog_interval: float = 1.0
    heartbeat_interval: float = 30.0
    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    heartbeat_timeout: float = 60.0
    barrier_timeout: float = 120.0
    completion_timeout: float = 120.0
    last_call_wait: float = 1.0
    termination_grace_time: float = 1.0
    granularity: Literal["node", "rank"] = "node"
    active_world_size: int | None = None
    empty_cuda_cache: bool = True
    max_rank_faults: int | None = None
    monitor_process_logdir: str | None = None


@dataclasses.dataclass
class TrainingConfig:
    train_iters: int = 40
    save_interval: int = 5
    save: str = ""
    lr: float = 0.01
    step_time: float = 0.1  # seconds a step of a real model would take


@dataclasses.dataclass
class ConfigContainer:
    train: TrainingConfig
    inprocess_restart: InProcessRestartConfig | None = None


class GlobalState:
    """The run's state, created once and kept across restarts; reset by ``destroy_state``."""

    def __init__(self) -> None:
        self.cfg: ConfigContainer | None = None
        self._async_calls_queue: toy_megatron.AsyncCallsQueue | None = None
        self.train_step = 0

    @property
    def async_calls_queue(self) -> toy_megatron.AsyncCallsQueue | None:
        return self._async_calls_queue

    def ensure_async_calls_queue(self) -> toy_megatron.AsyncCallsQueue:
        if self._async_calls_queue is None:
            self._async_calls_queue = toy_megatron.AsyncCallsQueue()
        return self._async_calls_queue

    def reset_for_restart(self) -> None:
        self.train_step = 0


def inprocess_restart(train_fn: Callable[..., Any], config: InProcessRestartConfig,
                      global_state: GlobalState) -> Callable[..., Any]:
    if os.environ.get("TORCH_CPP_LOG_LEVEL") not in ("error", "fatal"):
        warnings.warn("Set TORCH_CPP_LOG_LEVEL=error to suppress c10d waitForInput timeout warning messages",
                      stacklevel=2)

    active_world_size = config.active_world_size
    if active_world_size is None:
        active_world_size = int(os.getenv("WORLD_SIZE", "1"))

    layers = [
        inprocess.rank_assignment.Layer(
            min_ranks=active_world_size,
            max_ranks=active_world_size,
            flag=inprocess.rank_assignment.LayerFlag.RESERVE,
        )
    ]
    if config.granularity == "node":
        device_count = torch.cuda.device_count()
        layers.append(
            inprocess.rank_assignment.Layer(
                min_ranks=device_count,
                max_ranks=device_count,
                key_or_fn=lambda _: socket.gethostname(),
                flag=inprocess.rank_assignment.LayerFlag.RESERVE,
            )
        )

    def destroy_state() -> None:
        try:
            toy_megatron.destroy_global_state()
            global_state.reset_for_restart()
            say("destroy_state: global state reset")
        except Exception as e:
            logger.error(f"destroy_state failed: {type(e).__name__}: {e}", exc_info=True)

    finalize = [inprocess.finalize.ThreadedFinalize(timeout=timedelta(seconds=10), fn=destroy_state)]
    if config.empty_cuda_cache:
        finalize.append(inprocess.finalize.ThreadedFinalize(timeout=timedelta(seconds=10), fn=torch.cuda.empty_cache))

    initialize = inprocess.Compose(
        inprocess.initialize.RetryController(min_world_size=active_world_size),
        inprocess.nested_restarter.NestedRestarterHandlingCompleted(),
    )

    class AbortCheckpoint(inprocess.abort.Abort):
        def __call__(self, frozen_state: inprocess.state.FrozenState) -> inprocess.state.FrozenState:
            try:
                if global_state is not None and global_state.async_calls_queue is not None:
                    global_state.async_calls_queue.close(abort=True)
                    global_state._async_calls_queue = None
                    say("abort: async calls queue closed")
            except Exception:
                pass
            return frozen_state

    abort = inprocess.Compose(
        inprocess.abort.AbortTransformerEngine(),
        inprocess.abort.AbortTorchDistributed(),
        AbortCheckpoint(),
        inprocess.nested_restarter.NestedRestarterHandlingStarting(),
    )
    completion = inprocess.nested_restarter.NestedRestarterFinalized()
    terminate = inprocess.nested_restarter.NestedRestarterAborted()

    health_check_components = [inprocess.health_check.CudaHealthCheck(timeout=timedelta(seconds=10))]
    if config.max_rank_faults is not None:
        health_check_components.append(inprocess.health_check.FaultCounter(max_rank_faults=config.max_rank_faults))
    health_check = inprocess.Compose(*health_check_components)

    monitor_process_logfile = None
    if config.monitor_process_logdir is not None:
        slurm_local_id = os.environ.get("SLURM_LOCALID")
        slurm_global_rank = os.environ.get("SLURM_PROCID")
        slurm_job_id = os.environ.get("SLURM_JOB_ID")
        hostname = socket.gethostname()
        if slurm_global_rank is not None and int(slurm_global_rank) == 0:
            monitor_process_logfile = os.path.join(
                config.monitor_process_logdir,
                f"monitor_{slurm_job_id}_{hostname}_{slurm_global_rank}_{slurm_local_id}.log",
            )

    # The Wrapper injects the CallWrapper into a parameter annotated CallWrapper (or Optional of it):
    # this adapter has one, and hands it to the training function by keyword.
    def _adapter(*args: Any, inprocess_call_wrapper: inprocess.CallWrapper | None = None, **kwargs: Any) -> Any:
        return train_fn(*args, inprocess_call_wrapper=inprocess_call_wrapper, **kwargs)

    return inprocess.Wrapper(
        store_kwargs={
            "timeout": timedelta(seconds=300),
            "port": int(os.environ["MASTER_PORT"]) + 2,
        },
        initialize=initialize,
        abort=abort,
        completion=completion,
        terminate=terminate,
        health_check=health_check,
        rank_assignment=inprocess.rank_assignment.Tree(layers=layers),
        finalize=inprocess.Compose(*finalize),
        heartbeat_interval=timedelta(seconds=config.heartbeat_interval),
        heartbeat_timeout=timedelta(seconds=config.heartbeat_timeout),
        barrier_timeout=timedelta(seconds=config.barrier_timeout),
        completion_timeout=timedelta(seconds=config.completion_timeout),
        monitor_process_interval=timedelta(seconds=config.monitor_process_interval),
        monitor_thread_interval=timedelta(seconds=config.monitor_thread_interval),
        last_call_wait=timedelta(seconds=config.last_call_wait),
        soft_timeout=timedelta(seconds=config.soft_timeout),
        hard_timeout=timedelta(seconds=config.hard_timeout),
        termination_grace_time=timedelta(seconds=config.termination_grace_time),
        monitor_process_logfile=monitor_process_logfile,
        enabled=True,
    )(_adapter)


def maybe_wrap_for_inprocess_restart(
    train_fn: Callable[..., Any], config: InProcessRestartConfig, state: GlobalState
) -> tuple[Callable[..., Any], dist.Store | None]:
    if not config.enabled:
        return train_fn, None
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]) + 1,
        world_size=int(os.getenv("WORLD_SIZE", "1")),
        is_master=(int(os.getenv("RANK", "0")) == 0),
        timeout=timedelta(seconds=300),
        wait_for_workers=True,
        use_libuv=True,
    )
    return inprocess_restart(train_fn, config, state), store


def forward_step_func(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    toy_megatron.train_step(model, optimizer, step, dist.get_rank(), dist.get_world_size())


def pretrain(config: ConfigContainer, forward_step: Callable[..., None], callbacks: list[Any] | None = None) -> None:
    state = GlobalState()
    state.cfg = config
    if config.inprocess_restart and config.inprocess_restart.enabled:
        if dist.is_initialized():
            raise RuntimeError("In-process restart is incompatible with user-initialized process groups.")
        wrapped_pretrain, store = maybe_wrap_for_inprocess_restart(_pretrain, config.inprocess_restart, state)
        wrapped_pretrain(state, forward_step, callbacks, store=store)
    else:
        _pretrain(state=state, forward_step_func=forward_step, callback_manager=callbacks)


def _pretrain(
    state: GlobalState,
    forward_step_func: Callable[..., None],
    callback_manager: list[Any] | None = None,
    store: dist.Store | None = None,
    inprocess_call_wrapper: CallWrapper | None = None,
) -> None:
    restart_attempt = 0
    if inprocess_call_wrapper is not None:
        restart_attempt = inprocess_call_wrapper.iteration
        store = dist.PrefixStore(str(restart_attempt), store)
    assert state.cfg is not None
    train = state.cfg.train
    try:
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(minutes=1))
        rank, world_size = dist.get_rank(), dist.get_world_size()
        model = toy_megatron.model_provider()
        optimizer = toy_megatron.optimizer_provider(model, train.lr)
        toy_megatron.set_global_state(model=model, optimizer=optimizer)
        queue = state.ensure_async_calls_queue()
        state.train_step = toy_megatron.load_checkpoint(train.save, model, optimizer)
        start = state.train_step
        say(f"restart attempt {restart_attempt}: rank {rank} of {world_size}, resuming at step {start}")
        while state.train_step < train.train_iters:
            forward_step_func(model, optimizer, state.train_step)
            state.train_step += 1
            say(f"step {state.train_step}")
            if state.train_step % train.save_interval == 0:
                toy_megatron.save_checkpoint(queue, train.save, state.train_step, model, optimizer)
            time.sleep(train.step_time)
        queue.maybe_finalize(blocking=True)
        result = {"initial_rank": int(INITIAL_RANK), "rank": rank, "world_size": world_size,
                  "iteration": restart_attempt, "resumed_at": start, "steps": state.train_step,
                  "parameters": toy_megatron.parameters_of(model)}
        print("RESULT " + json.dumps(result), flush=True)
        dist.destroy_process_group()
    except BaseException as error:
        if inprocess_call_wrapper is None:
            logger.exception("pretrain failed: %s: %s", type(error).__name__, error)
        raise


def parse_args() -> ConfigContainer:
    parser = argparse.ArgumentParser()
    parser.add_argument("--active-world-size", type=int, default=None)
    parser.add_argument("--max-rank-faults", type=int, default=None)
    parser.add_argument("--monitor-process-logdir", type=str, default=None)
    parser.add_argument("--train-iters", type=int, default=40)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--save", type=str, required=True)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    restart = InProcessRestartConfig(enabled=True, granularity="rank", active_world_size=args.active_world_size,
                                     max_rank_faults=args.max_rank_faults,
                                     monitor_process_logdir=args.monitor_process_logdir)
    train = TrainingConfig(train_iters=args.train_iters, save_interval=args.save_interval, save=args.save, lr=args.lr)
    return ConfigContainer(train=train, inprocess_restart=restart)


def main() -> int:
    pretrain(parse_args(), forward_step_func)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
