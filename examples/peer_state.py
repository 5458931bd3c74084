"""DDP whose state comes from a peer after a restart: a spare that takes over resumes at the last step.

    python examples/peer_state.py               # 4 active ranks and 1 spare on 127.0.0.1

The model and the optimizer live outside the wrapped function, registered once
with ``inprocess.ReplicatedState``; each step ends with ``state.commit(step)``
(a snapshot in host memory). Rank 2 raises at step 30 and rank 1's process is
SIGKILLed at step 60. Each time, ``state.restore()`` at the start of the next
iteration agrees on the newest committed step: after the exception every rank
rolls back to it from its own memory (a rank that the restart interrupted
between a step's allreduce and its commit receives it from a peer); after the
kill the spare takes rank 1's place and receives the state from a peer, so the
job goes on at step 60 with no checkpoint read. The current rank 0 prints where each iteration resumed and
what the restore sent. Environment: EXAMPLE_STEPS (100).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

STEPS = int(os.environ.get("EXAMPLE_STEPS", "100"))
FAULTS = {(2, 30): "raise", (1, 60): "kill"}  # (initial rank, step): what happens there


def launch(world_size: int = 5) -> int:
    from inprocess.launch import LocalJob

    with LocalJob([__file__], world_size, capture=False) as job:
        ranks = job.wait(timeout=300)
    bad = [r for r in ranks if r.returncode != (-signal.SIGKILL if r.rank == 1 else 0)]
    for r in bad:
        print(f"[peer_state] rank {r.rank} ended with return code {r.returncode}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__" and "RANK" not in os.environ:
    sys.exit(launch())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import inprocess  # noqa: E402

torch.manual_seed(0)  # every replica starts from the same weights
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
state = inprocess.ReplicatedState(model=model, optimizer=optimizer)
fired: set[tuple[int, int]] = set()
R = inprocess.rank_assignment


@inprocess.Wrapper(
    rank_assignment=inprocess.Compose(R.MaxActiveWorldSize(4), R.ActivateAllRanks(), R.ShiftRanks()),
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
    barrier_timeout=datetime.timedelta(seconds=90),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank,
                            world_size=me.active_world_size, timeout=datetime.timedelta(seconds=5))
    resumed = state.restore()  # every rank, before the first step: the newest committed state
    step = 0 if resumed is None else resumed  # None: nothing committed yet (a checkpoint would be read here)
    if me.active_rank == 0:
        done = state.last_restore
        sent = f", sent by rank {done.source} to rank(s) {list(done.receivers)}" if done and done.receivers else ""
        print(f"[peer_state] iteration {call_wrapper.iteration}: {me.active_world_size} ranks at step {step}{sent}",
              flush=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    while step < STEPS:
        call_wrapper.ping()
        what = FAULTS.get((me.initial_rank, step))
        if what is not None and (me.initial_rank, step) not in fired:
            fired.add((me.initial_rank, step))
            if what == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault at step {step}")
        gen = torch.Generator().manual_seed(step * 100 + me.active_rank)  # data by step: a resumed step repeats
        x = torch.randn(64, 32, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        state.commit(step)
    if me.active_rank == 0:
        print(f"[peer_state] done: step {step}, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
