"""Minimal: an existing training script's ``main()``, wrapped as it is.

    python -m inprocess.launch --nproc 4 examples/minimal.py
    INPROCESS_FAULTS="exception@rank=2,after=1s" python -m inprocess.launch --nproc 4 examples/minimal.py

``main()`` below is an ordinary DDP script: it initialises the default process
group from the environment (``env://``), builds its model and optimizer, trains
and returns. Nothing in it knows about ``inprocess``. The only lines added are
the last ones: the Wrapper around ``main``, with its own store on
``MASTER_PORT + 1``, since ``main()``'s ``env://`` rendezvous takes
``MASTER_PORT`` itself.

What a restart costs here: the whole of ``main()`` runs again, from step 0: a
new rendezvous, a new model, a new optimizer, and the steps done so far are
lost. ``examples/optimal.py`` keeps all of that. Under torchrun, use the
optimal form (``call_wrapper.store``): torchrun's ``env://`` store is shared by
its agent and outlives an iteration, so a second ``env://`` rendezvous in it
reads the first one's keys.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args, _ = parser.parse_known_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    start = time.monotonic()
    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, 32, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
    if rank == 0:
        elapsed = time.monotonic() - start
        print(f"[minimal] {args.steps} steps in {elapsed:.1f} s, loss {float(loss.detach()):.4f}", flush=True)
    dist.destroy_process_group()
    return float(loss.detach())


if __name__ == "__main__":
    # DDP imports torch._dynamo (and sympy) on its first use, which takes a second or
    # more; a restart that comes meanwhile waits for the import to finish (a module cut
    # in the middle would stay broken). Importing it before the wrapper keeps that wait
    # out of restarts (README, "Imports and restarts").
    import torch._dynamo  # noqa: F401

    import inprocess

    # The restart engine's own store: MASTER_PORT is main()'s env:// rendezvous.
    wrapped = inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 1},
        soft_timeout=datetime.timedelta(seconds=30),
        hard_timeout=datetime.timedelta(seconds=60),
        barrier_timeout=datetime.timedelta(seconds=90),
    )(main)
    wrapped()
