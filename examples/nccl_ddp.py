"""Data-parallel training on GPUs with NCCL, restarted inside its processes after a fault.

    torchrun --standalone --nproc-per-node 2 examples/nccl_ddp.py                  # one rank per GPU
    INPROCESS_FAULTS="exception@rank=1,step=20" torchrun --standalone --nproc-per-node 2 examples/nccl_ddp.py
    INPROCESS_FAULTS="sigkill@rank=1,step=20" python -m inprocess.launch --nproc 2 --respawn 1 examples/nccl_ddp.py

What a GPU job needs beyond ``examples/optimal.py``:

- **The settings of docs/gpu.md**, set before torch makes a group (your own values win):
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (torch's watchdog aborts a failed communicator and leaves
  the process alive), ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0`` and ``NCCL_NVLS_ENABLE=0``.
- **The group bound to the rank's device**, ``init_process_group(..., device_id=...)``: its
  communicator is made at once, and the restart's abort, the health check and the peer state find
  the rank's device there (not GPU 0).
- **The default abort** (``inprocess.abort.AbortTorchDistributed``) releases every NCCL
  communicator from the restart's thread; NCCL's teardown (about half a second to a second) goes on
  beside finalize, the health check and the restart barrier. ``EXAMPLE_OVERLAP=1`` lets it go on
  beside the next iteration too where the device has room (Stage 2, opt-in: docs/gpu.md says what
  NCCL does not promise there).
- **``CudaHealthCheck``** after the abort: a rank whose CUDA context was lost to a sticky error
  leaves with exit status 76 (a launcher with ``--respawn`` starts it again; it rejoins).
- **The state from memory**: ``ReplicatedState`` commits the model and optimizer after every step;
  at a restart every rank resumes from the newest committed step, sent by a peer to the ranks that
  lack it (over NCCL, staged through the group's device). No checkpoint is read.

Without a GPU it trains on the CPU with gloo (``tests/test_examples.py`` runs it so under torchrun).
Every rank ends with one line naming the step, the world and a digest of its parameters: equal on
every rank. Environment: EXAMPLE_STEPS (60), EXAMPLE_OVERLAP (0).
"""

from __future__ import annotations

import os

# docs/gpu.md: what an in-process restart on GPUs needs, before torch makes a group.
for _name, _value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"), ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0"),
                      ("NCCL_NVLS_ENABLE", "0")):
    os.environ.setdefault(_name, _value)

import ctypes  # noqa: E402  (after the settings: torch reads some of them when it loads)
import datetime  # noqa: E402
import hashlib  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import inprocess  # noqa: E402
from inprocess.abort import AbortTorchDistributed  # noqa: E402
from inprocess.health_check import CudaHealthCheck  # noqa: E402

STEPS = int(os.environ.get("EXAMPLE_STEPS", "60"))
GPU = torch.cuda.is_available()
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
DEVICE = torch.device("cuda", LOCAL_RANK % max(torch.cuda.device_count(), 1)) if GPU else torch.device("cpu")

# Built once, outside the wrapped function: the same objects in every iteration.
torch.manual_seed(0)  # every replica starts from the same weights
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
state = inprocess.ReplicatedState(model=model, optimizer=optimizer)


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's output."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def digest() -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        t = t.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()[:16]


@inprocess.Wrapper(
    abort=AbortTorchDistributed(overlap_next_iteration=os.environ.get("EXAMPLE_OVERLAP", "0") == "1"),
    health_check=CudaHealthCheck() if GPU else None,
    soft_timeout=datetime.timedelta(seconds=60),
    hard_timeout=datetime.timedelta(seconds=90),
    barrier_timeout=datetime.timedelta(seconds=120),
)
def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    if GPU:
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", store=call_wrapper.store, rank=me.active_rank,
                                world_size=me.active_world_size, device_id=DEVICE,
                                timeout=datetime.timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank,
                                world_size=me.active_world_size, timeout=datetime.timedelta(seconds=60))
    ddp = DistributedDataParallel(model, device_ids=[DEVICE.index] if GPU else None)
    resumed = state.restore()  # every rank, before its first step: the newest committed step, or None
    step = 0 if resumed is None else resumed
    say(f"[nccl_ddp] initial rank {me.initial_rank}: iteration {call_wrapper.iteration}, rank {me.active_rank} "
        f"of {me.active_world_size} on {DEVICE} ({dist.get_backend()}), from step {step}")
    while step < STEPS:
        call_wrapper.ping()  # a step: progress, for the hang timeouts and the storm brake
        inprocess.faults.maybe_inject(step)  # INPROCESS_FAULTS="...step=N": rehearse a failure
        gen = torch.Generator().manual_seed(step * 1000 + me.active_rank)  # data by step and rank
        x = torch.randn(128, 256, generator=gen).to(DEVICE)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.flip(1)).backward()  # DDP averages the gradients
        optimizer.step()
        step += 1
        state.commit(step)
    say(f"[nccl_ddp] initial rank {me.initial_rank}: {step} steps done in iteration {call_wrapper.iteration} on "
        f"{me.active_world_size} ranks, digest {digest()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
