"""Sharded training whose lost shard comes back from a partner's copy: the job resumes at its last commit.

    python examples/sharded_state.py            # 4 active ranks and 1 spare on 127.0.0.1

Each active rank owns one slice of a linear model's weights and that slice's
momentum (the way ZeRO and FSDP shard a model): no other rank holds them. The
slice is registered with ``inprocess.ShardedState``; each step ends with
``state.commit(step)``, which snapshots the slice in host memory and, in the
background, sends it to the rank one place before (its partner's keeper) and
receives the slice of the rank one place after. Rank 1's process is SIGKILLed
at step 40: the spare takes its place and ``state.restore()`` gives it rank
1's slice from the copy rank 0 kept, so every rank resumes at the same step,
the last one whose copies were complete. The current rank 0 prints where each
iteration resumed. Environment: EXAMPLE_STEPS (80).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

STEPS = int(os.environ.get("EXAMPLE_STEPS", "80"))
KILL = (1, 40)  # (initial rank, step)
SHARDS, SLICE = 4, 256


def launch(world_size: int = 5) -> int:
    from inprocess.launch import LocalJob

    with LocalJob([__file__], world_size, capture=False) as job:
        ranks = job.wait(timeout=300)
    bad = [r for r in ranks if r.returncode != (-signal.SIGKILL if r.rank == KILL[0] else 0)]
    for r in bad:
        print(f"[sharded_state] rank {r.rank} ended with return code {r.returncode}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__" and "RANK" not in os.environ:
    sys.exit(launch())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import inprocess  # noqa: E402

torch.manual_seed(0)
START = torch.randn(SHARDS * SLICE) * 0.1  # the whole weight vector at step 0 (a checkpoint's place)
shard = torch.nn.Module()
shard.weight = torch.nn.Parameter(torch.zeros(SLICE))
optimizer = torch.optim.SGD(shard.parameters(), lr=5.0, momentum=0.9)
state = inprocess.ShardedState(shard=shard, optimizer=optimizer)  # partners one node apart (LOCAL_WORLD_SIZE)
R = inprocess.rank_assignment


@inprocess.Wrapper(
    rank_assignment=inprocess.Compose(R.MaxActiveWorldSize(SHARDS), R.ActivateAllRanks(), R.ShiftRanks()),
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
    barrier_timeout=datetime.timedelta(seconds=90),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    rank = me.active_rank
    dist.init_process_group("gloo", store=call_wrapper.store, rank=rank, world_size=me.active_world_size,
                            timeout=datetime.timedelta(seconds=5))
    step = state.restore()  # every rank, before its first step and before any commit
    if step is None:  # nothing committed yet, or a slice lost with its copy: start from the checkpoint
        step = 0
        with torch.no_grad():
            shard.weight.copy_(START[rank * SLICE:(rank + 1) * SLICE])
        optimizer.state.clear()
    if rank == 0:
        print(f"[sharded_state] iteration {call_wrapper.iteration}: {me.active_world_size} ranks at step {step}",
              flush=True)
    target = torch.linspace(-1, 1, SHARDS * SLICE)
    while step < STEPS:
        call_wrapper.ping()
        if (me.initial_rank, step) == KILL and call_wrapper.iteration == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        parts = [torch.empty(SLICE) for _ in range(me.active_world_size)]
        dist.all_gather(parts, shard.weight.detach())
        weights = torch.cat(parts).requires_grad_()
        gen = torch.Generator().manual_seed(step * 100 + rank)  # data by step: a resumed step repeats
        x = torch.randn(32, weights.numel(), generator=gen) / weights.numel() ** 0.5
        loss = torch.nn.functional.mse_loss(x @ weights, x @ target)
        loss.backward()
        grad = weights.grad
        dist.all_reduce(grad)
        shard.weight.grad = grad[rank * SLICE:(rank + 1) * SLICE] / me.active_world_size
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        state.commit(step)
    state.wait()
    if rank == 0:
        print(f"[sharded_state] done: step {step}, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
