"""Spares: ranks started in advance that take over from a failed one.

    python -m inprocess.launch --nproc 4 examples/spares.py          # 3 active ranks + 1 spare
    INPROCESS_FAULTS="sigkill@rank=1,step=50" python -m inprocess.launch --nproc 4 examples/spares.py

The job trains on ``ACTIVE`` ranks (3 here, ``--active``); the others are
spares: they hold their process (torch imported, state built) and wait in the
wrapper, without calling the function. When an active rank fails and leaves
the job, the restart's single decision activates a spare in its place
(``MaxActiveWorldSize``), and the job goes on at its full width. The spare's
own state is empty, so every rank resumes from the step that the active
ranks agree on, and a fresh rank receives the model from active rank 0
(``broadcast``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch._dynamo  # noqa: F401  (DDP's lazy import, done before any restart: see examples/optimal.py)
import torch.distributed as dist

import inprocess

R = inprocess.rank_assignment


class Progress:
    """This rank's state across restarts: the committed step and the model's weights."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.step = 0
        self.took_over_at: int | None = None  # the iteration in which this spare became active


def make_train(active: int) -> inprocess.Wrapper:
    return inprocess.Wrapper(
        # Read right to left: renumber the ranks left, activate them, keep at most `active` active.
        rank_assignment=inprocess.Compose(R.MaxActiveWorldSize(active), R.ActivateAllRanks(), R.ShiftRanks()),
        soft_timeout=datetime.timedelta(seconds=30),
        hard_timeout=datetime.timedelta(seconds=60),
        barrier_timeout=datetime.timedelta(seconds=90),
    )


def train(progress: Progress, steps: int, step_time: float = 0.0,
          call_wrapper: inprocess.CallWrapper | None = None) -> int:
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    if progress.took_over_at is None and call_wrapper.iteration > 0 and progress.step == 0:
        progress.took_over_at = call_wrapper.iteration
        print(f"[spares] initial rank {me.initial_rank} takes over as active rank {me.active_rank} "
              f"in iteration {call_wrapper.iteration}", flush=True)
    dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank, world_size=me.active_world_size,
                            timeout=datetime.timedelta(seconds=10))
    # Every rank resumes at the step active rank 0 committed, with its weights (a spare has neither).
    step = torch.tensor([progress.step])
    dist.broadcast(step, src=0)
    progress.step = int(step)
    for p in progress.model.parameters():
        dist.broadcast(p.data, src=0)
    ddp = torch.nn.parallel.DistributedDataParallel(progress.model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    while progress.step < steps:
        started = time.monotonic()
        call_wrapper.ping()
        inprocess.faults.maybe_inject(progress.step)
        gen = torch.Generator().manual_seed(progress.step * 1000 + me.active_rank)
        x = torch.randn(64, 32, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), torch.sin(x.sum(dim=1, keepdim=True))).backward()
        opt.step()
        with call_wrapper.atomic():
            progress.step += 1
        time.sleep(max(0.0, step_time - (time.monotonic() - started)))
    dist.destroy_process_group()
    if me.active_rank == 0:
        print(f"[spares] {steps} steps done on {me.active_world_size} active ranks in iteration "
              f"{call_wrapper.iteration}", flush=True)
    return me.active_world_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--active", type=int, default=3, help="active ranks; the others are spares")
    parser.add_argument("--step-time", type=float, default=0.0,
                        help="seconds a step takes at least (a stand-in for a real model's step)")
    args = parser.parse_args()
    torch.manual_seed(0)
    progress = Progress(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    width = make_train(args.active)(train)(progress, args.steps, args.step_time)
    # None: this rank was a spare to the end (never needed), or a respawned process that waited to join
    # (python -m inprocess.launch --respawn) and was never needed either.
    role = "spare, never activated" if width is None else f"active, {width} active ranks at the end"
    print(f"[spares] initial rank {os.environ['RANK']}: {role}", flush=True)


if __name__ == "__main__":
    main()
