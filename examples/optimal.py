"""Optimal: what a restart must redo, and nothing more.

    python -m inprocess.launch --nproc 4 examples/optimal.py
    torchrun --standalone --nproc-per-node 4 examples/optimal.py
    INPROCESS_FAULTS="exception@rank=2,after=1s" python -m inprocess.launch --nproc 4 examples/optimal.py

- **Built once, outside the wrapped function:** everything that does not
  depend on the process group: the model, the optimizer, the data. The
  function receives the same objects on every call.
- **A process group per iteration**, on ``call_wrapper.store`` (scoped to the
  iteration by the engine; under torchrun it is torchrun's store), with the
  active rank and world size of this iteration; DDP is the only thing rebuilt
  on it.
- **State resumed from an in-memory checkpoint** committed under
  ``call_wrapper.atomic()`` after every step: a restart waits for a commit
  in progress, never sees half of one. A restart can interrupt a rank between
  a step's allreduce and its commit, so the ranks agree on the lowest committed
  step (one ``all_reduce``) and the ones ahead roll back to it.

Against ``examples/minimal.py`` (whose restart reruns ``main()``), this
resumes where the job was; ``benchmarks/example_restarts.py`` measures both.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import time
from typing import Any, Optional

import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.distributed as dist

import inprocess

# DDP imports torch._dynamo (and sympy) on its first use, a second or more; a restart
# that comes meanwhile waits for the import to finish (a module cut in the middle would
# stay broken). Imported above, before the wrapper, it never delays a restart.


class Checkpoint:
    """The last two committed steps in memory (model and optimizer state), so that the
    ranks can agree on the lower one when a restart caught them one step apart."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.model, self.opt = model, opt
        self.step = 0
        self.saved: Optional[tuple[dict[str, Any], dict[str, Any]]] = None
        self.previous: Optional[tuple[int, Optional[tuple[dict[str, Any], dict[str, Any]]]]] = None

    def commit(self) -> None:
        self.previous = (self.step, self.saved)
        self.saved = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))
        self.step += 1

    def restore(self, step: int) -> None:
        """Back to committed ``step`` (this one or the one before), into the same model and optimizer."""
        if step != self.step:
            assert self.previous is not None and self.previous[0] == step, (step, self.step)
            self.step, self.saved = self.previous
            self.previous = None
        if self.saved is not None:
            self.model.load_state_dict(self.saved[0])
            self.opt.load_state_dict(self.saved[1])


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=100),
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
    barrier_timeout=datetime.timedelta(seconds=90),
)
def train(model: torch.nn.Module, ckpt: Checkpoint, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
          call_wrapper: Optional[inprocess.CallWrapper] = None) -> float:
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    # The gloo timeout bounds the rare collective a restart cannot release (README, "Gloo timeout").
    dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank, world_size=me.active_world_size,
                            timeout=datetime.timedelta(seconds=10))
    agreed = torch.tensor([ckpt.step])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    ckpt.restore(int(agreed))
    if me.active_rank == 0 and call_wrapper.iteration > 0:
        print(f"[optimal] iteration {call_wrapper.iteration}: {me.active_world_size} ranks resume at step "
              f"{ckpt.step}", flush=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    loss = torch.tensor(float("nan"))
    while ckpt.step < steps:
        call_wrapper.ping()
        inprocess.faults.maybe_inject(ckpt.step)  # INPROCESS_FAULTS="...step=N": rehearse a failure
        x, y = data[(ckpt.step * me.active_world_size + me.active_rank) % len(data)]
        ckpt.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        ckpt.opt.step()
        with call_wrapper.atomic():  # a restart waits for the commit to end
            ckpt.commit()
    dist.destroy_process_group()
    if me.active_rank == 0:
        print(f"[optimal] {steps} steps done in iteration {call_wrapper.iteration} "
              f"({len(call_wrapper.restarts)} restarts), loss {float(loss.detach()):.4f}", flush=True)
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    start = time.monotonic()
    # Built once: the model, its optimizer, the data. Restarts reuse them.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(64):
        x = torch.randn(64, 32, generator=gen)
        data.append((x, torch.sin(x.sum(dim=1, keepdim=True))))
    loss = train(model, Checkpoint(model, opt), data, args.steps)
    print(f"[optimal] rank {os.environ.get('RANK')} done in {time.monotonic() - start:.1f} s, loss {loss:.4f}",
          flush=True)


if __name__ == "__main__":
    main()
