"""A rank whose CUDA context is lost leaves, is started again, and rejoins with its state from a peer.

    python -m inprocess.launch --nproc 4 --respawn 1 examples/lost_context.py

NVRx issue #139 ("recover from a corrupted CUDA context"), end to end, simulated on CPU: at step
20 rank 1 meets the error a sticky CUDA fault gives (a RuntimeError, "an illegal memory access"),
and the health check that follows reports the context lost (on a GPU,
``inprocess.health_check.CudaHealthCheck`` finds it; here a hook says so). A lost context cannot
be repaired inside the process: the rank leaves the job with exit status 76. The three others
restart in-process, roll back to step 20 from their own memory (``ReplicatedState``) and wait at
safe points, without a step, for a fourth rank. ``inprocess.launch --respawn 1`` starts a new
process for rank 1 (``INPROCESS_JOIN=1``); it joins the running job, a grow
(``GrowPolicy``) admits it, and ``state.restore()`` gives it the state of step 20 from a peer.
No rank reads a checkpoint; the job ends as the job without the fault does, bitwise (the last
line prints a digest of the parameters and the optimizer's state).

Environment: EXAMPLE_STEPS (40); EXAMPLE_LOST_AT, ``rank:step`` (``1:20``), or ``none``: no fault.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import inprocess

STEPS = int(os.environ.get("EXAMPLE_STEPS", "40"))
LOST_AT = os.environ.get("EXAMPLE_LOST_AT", "1:20")
WORLD = int(os.environ["WORLD_SIZE"])
FIRST_LIFE = os.environ.get("INPROCESS_RESPAWN_COUNT", "0") == "0"  # set by inprocess.launch on a respawn

torch.manual_seed(0)  # every replica starts from the same weights
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
state = inprocess.ReplicatedState(model=model, optimizer=optimizer)
context_lost = False


def health_check(frozen: Any) -> None:
    """What CudaHealthCheck would find on a GPU after a sticky error: the context is gone."""
    if context_lost:
        raise inprocess.gpu.CudaContextLost("CUDA context lost after an illegal memory access (simulated)")


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's output and do not cut into each other's lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def digest() -> str:
    h = hashlib.sha256()
    tensors = list(model.state_dict().values())
    tensors += [v for entry in optimizer.state.values() for _, v in sorted(entry.items())]
    for t in tensors:
        t = t.detach().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()[:16]


@inprocess.Wrapper(
    health_check=health_check,
    grow=inprocess.GrowPolicy(min_waiting=1, check_every=1),
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
    barrier_timeout=datetime.timedelta(seconds=120),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    global context_lost
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank,
                            world_size=me.active_world_size, timeout=datetime.timedelta(seconds=30))
    resumed = state.restore()  # every rank, before its first step: the newest committed state
    step = 0 if resumed is None else resumed  # None: nothing committed yet (a checkpoint would be read here)
    done = state.last_restore
    got = f", its state from rank {done.source}" if done is not None and done.nbytes else ""
    say(f"[lost_context] initial rank {me.initial_rank}: iteration {call_wrapper.iteration}, rank "
        f"{me.active_rank} of {me.active_world_size} at step {step}{got}")
    while me.active_world_size < WORLD:  # a rank short: no step (the data would split otherwise) until a grow
        call_wrapper.ping()
        call_wrapper.safe_point()
        dist.barrier()
        time.sleep(0.05)
    while step < STEPS:
        call_wrapper.ping()
        call_wrapper.safe_point()
        if LOST_AT == f"{me.initial_rank}:{step}" and FIRST_LIFE:
            context_lost = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        gen = torch.Generator().manual_seed(step * 100 + me.active_rank)  # data by step and rank
        x = torch.randn(64, 32, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        for p in model.parameters():  # the gradients' mean, as a data-parallel loop takes it
            dist.all_reduce(p.grad)
            p.grad /= me.active_world_size
        optimizer.step()
        step += 1
        state.commit(step)
    if me.active_rank == 0:
        say(f"[lost_context] done: step {step}, digest {digest()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
