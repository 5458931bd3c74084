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

- **A process that joins the running job** (started by ``python -m
  inprocess.launch --respawn N`` or ``examples/slurm/respawn_task.sh`` in
  place of a dead one) holds no state: at the restart that admits it, it
  receives the committed step, the weights and the optimizer's state from the
  lowest active rank that has them. ``grow=`` admits a waiting joiner within
  ten steps, so the job returns to its full width without waiting for a fault;
  a joiner that the job never admitted (it ended first) gets ``None`` back.
  Every rank ends with one line that names the world it ended in and a digest
  of its parameters: equal on every rank.

Against ``examples/minimal.py`` (whose restart reruns ``main()``), this
resumes where the job was; ``benchmarks/example_restarts.py`` measures both.

    python -m inprocess.launch --nproc 4 --respawn 3 examples/optimal.py --step-time 0.05
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import os
import time
from typing import Any

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
        self.saved: tuple[dict[str, Any], dict[str, Any]] | None = None
        self.previous: tuple[int, tuple[dict[str, Any], dict[str, Any]] | None] | None = None

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

    def resume(self, rank: int) -> None:
        """Every rank at the same committed step: the lowest one among the ranks that hold a state
        (a restart can catch a rank one commit behind the others); a rank with none (a process that
        joined the running job) receives it from the lowest such rank."""
        no_state = 2**62
        agreed = torch.tensor([self.step if self.step > 0 else no_state])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if int(agreed) == no_state:
            return  # nobody committed a step yet: every rank holds the same initial model
        if self.step > 0:
            self.restore(int(agreed))
        source = torch.tensor([rank if self.step > 0 else no_state])
        dist.all_reduce(source, op=dist.ReduceOp.MIN)
        empty = torch.tensor([int(self.step == 0)])
        dist.all_reduce(empty, op=dist.ReduceOp.MAX)
        if int(empty):
            src = int(source)
            step = torch.tensor([self.step])
            dist.broadcast(step, src=src)
            for p in self.model.parameters():  # the weights and SGD's momentum, in place
                dist.broadcast(p.data, src=src)
                dist.broadcast(self.opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p)), src=src)
            if self.step == 0:
                self.step, self.previous = int(step), None
                self.saved = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))


def digest(model: torch.nn.Module) -> str:
    """A digest of the parameters' values: equal on ranks whose parameters are equal."""
    values = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return hashlib.sha256(repr(values).encode()).hexdigest()[:12]


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=100),
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
    barrier_timeout=datetime.timedelta(seconds=90),
    # A node lost as a whole (its ranks and their monitors) is counted out after this (default 60 s).
    heartbeat_timeout=datetime.timedelta(seconds=20),
    # A process waiting to join (a respawned rank) is taken in at the next look, every 10 steps.
    grow=inprocess.GrowPolicy(min_waiting=1, min_interval_s=0, check_every=10),
)
def train(model: torch.nn.Module, ckpt: Checkpoint, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
          step_time: float = 0.0, call_wrapper: inprocess.CallWrapper | None = None) -> tuple[float, int]:
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    # The gloo timeout bounds the rare collective a restart cannot release (README, "Gloo timeout").
    dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank, world_size=me.active_world_size,
                            timeout=datetime.timedelta(seconds=10))
    ckpt.resume(me.active_rank)
    if me.active_rank == 0 and call_wrapper.iteration > 0:
        print(f"[optimal] iteration {call_wrapper.iteration}: {me.active_world_size} ranks resume at step "
              f"{ckpt.step}", flush=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    loss = torch.tensor(float("nan"))
    while ckpt.step < steps:
        started = time.monotonic()
        call_wrapper.ping()
        inprocess.faults.maybe_inject(ckpt.step)  # INPROCESS_FAULTS="...step=N": rehearse a failure
        x, y = data[(ckpt.step * me.active_world_size + me.active_rank) % len(data)]
        ckpt.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        ckpt.opt.step()
        with call_wrapper.atomic():  # a restart waits for the commit to end
            ckpt.commit()
        time.sleep(max(0.0, step_time - (time.monotonic() - started)))
    dist.destroy_process_group()
    if me.active_rank == 0:
        print(f"[optimal] {steps} steps done in iteration {call_wrapper.iteration} "
              f"({len(call_wrapper.restarts)} restarts), loss {float(loss.detach()):.4f}", flush=True)
    return float(loss.detach()), me.active_world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="seconds a step takes at least (a stand-in for a real model's step)")
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
    ended = train(model, Checkpoint(model, opt), data, args.steps, args.step_time)
    took = f"[optimal] rank {os.environ.get('RANK')} done in {time.monotonic() - start:.1f} s"
    if ended is None:
        # This process waited to join (or as a spare) and the job completed without taking it in.
        print(f"{took}: the job ended before it took this process in", flush=True)
        return
    loss, world = ended
    print(f"{took}, loss {loss:.4f}, world {world}, parameters {digest(model)}", flush=True)


if __name__ == "__main__":
    main()
