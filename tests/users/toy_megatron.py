"""A small stand-in for the parts of Megatron that the two programs in the style of its in-process
restart code use (megatron_lm_style.py, megatron_bridge_style.py): a model provider, a data
iterator with a fixed batch per (step, data-parallel rank), one training step whose gradients are
averaged with one all-reduce of a flat buffer (as Megatron's gradient buffer is), checkpoints saved
on rank 0 by a persistent asynchronous worker and tracked in ``latest_checkpointed_iteration.txt``
(Megatron's tracker file), and the global state that ``destroy_global_state()`` resets.

Everything runs on CPU with gloo. ``reference_parameters()`` computes, in one process, what the
data-parallel job must end with, so that a test can check the result of a job that restarted.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
from typing import Any

import torch
import torch.distributed as dist

HIDDEN = 16
BATCH = 8
TRACKER = "latest_checkpointed_iteration.txt"


def model_provider() -> torch.nn.Module:
    """The same initial weights on every rank and in every iteration."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def optimizer_provider(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=lr)


def get_batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100_003 * step + dp_rank)
    x = torch.randn(BATCH, HIDDEN, generator=generator)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def _local_gradients(model: torch.nn.Module, step: int, dp_rank: int) -> torch.Tensor:
    x, y = get_batch(step, dp_rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    model.zero_grad(set_to_none=False)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


def _apply(model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n
    optimizer.step()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, dp_rank: int,
               dp_size: int) -> None:
    """One step: this rank's gradients, averaged over the data-parallel group by one all-reduce."""
    flat = _local_gradients(model, step, dp_rank)
    dist.all_reduce(flat)
    _apply(model, optimizer, flat / dp_size)


def reference_parameters(train_iters: int, dp_size: int, lr: float) -> list[float]:
    """The parameters a fault-free data-parallel job of ``dp_size`` ranks ends with, computed here."""
    model = model_provider()
    optimizer = optimizer_provider(model, lr)
    for step in range(train_iters):
        total = sum(_local_gradients(model, step, r) for r in range(dp_size))
        _apply(model, optimizer, total / dp_size)  # type: ignore[operator]
    return parameters_of(model)


def parameters_of(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


class AsyncCallsQueue:
    """A persistent worker that runs checkpoint saves in the background, one at a time."""

    def __init__(self) -> None:
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[Any]] = []

    def schedule(self, fn: Any, *args: Any) -> None:
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-worker")
        self._pending.append(self._worker.submit(fn, *args))

    def maybe_finalize(self, blocking: bool) -> None:
        if blocking:
            for future in self._pending:
                future.result()
        self._pending = [f for f in self._pending if not f.done()]

    def close(self, abort: bool = False) -> None:
        """Stop the worker; with ``abort``, drop the saves not started (a save under way completes,
        so the tracker never names a partial file)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=abort)
        self._worker, self._pending = None, []


def _write_checkpoint(directory: str, step: int, state: dict[str, Any]) -> None:
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state, path / f"iter_{step:07d}.pt")
    tracker = path / f"{TRACKER}.tmp"
    tracker.write_text(str(step))
    os.replace(tracker, path / TRACKER)  # the tracker names complete checkpoints only


def save_checkpoint(queue: AsyncCallsQueue, directory: str, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> None:
    """Rank 0 hands a copy of the state to the asynchronous worker."""
    if dist.get_rank() != 0:
        return
    queue.maybe_finalize(blocking=True)
    state = {"iteration": step, "model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": _cloned(optimizer.state_dict())}
    queue.schedule(_write_checkpoint, directory, step, state)


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def load_checkpoint(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The iteration to resume from (0 without a checkpoint). Rank 0 reads the tracker and every rank
    loads the iteration it names, so that all ranks resume from the same one."""
    step = torch.zeros(1, dtype=torch.int64)
    tracker = pathlib.Path(directory) / TRACKER
    if dist.get_rank() == 0 and tracker.exists():
        step[0] = int(tracker.read_text())
    dist.broadcast(step, src=0)
    if int(step) == 0:
        return 0
    state = torch.load(pathlib.Path(directory) / f"iter_{int(step):07d}.pt", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["iteration"])


# The global state of a training run (Megatron's global variables): set by initialize, reset by
# destroy_global_state() when an in-process restart finalizes the failed iteration.
_GLOBAL: dict[str, Any] = {}


def set_global_state(**values: Any) -> None:
    _GLOBAL.update(values)


def get_global_state(name: str) -> Any:
    return _GLOBAL.get(name)


def destroy_global_state() -> None:
    _GLOBAL.clear()
