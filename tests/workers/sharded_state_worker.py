"""A rank of a toy sharded job (each rank owns one slice of the parameters, ZeRO
style) whose shards come from partners' copies after a restart
(inprocess.ShardedState), with faults from a plan.

INPROCESS_TEST_OUT   directory for this rank's JSON result
INPROCESS_TEST_PLAN  JSON: {"steps": 20, "max_active": 4,
                     "faults": [{"iteration": 0, "rank": 1, "step": 7, "kind": "sigkill"}]}
                     kinds: sigkill, exception, kill_pair (this rank SIGKILLs the process
                     of initial rank "with" and then itself: a shard and its copy lost at once)

A step: all ranks all_gather the shards into the full parameter vector, compute a
least-squares loss on data that are a function of (step, rank), all_reduce the
gradient, and each rank takes an SGD-with-momentum step on its own slice. The
result holds a digest of the gathered final parameters and momentum buffers.
"""

import ctypes
import datetime
import hashlib
import json
import logging
import os
import signal

import torch
import torch.distributed as dist

import inprocess

PLAN = json.loads(os.environ["INPROCESS_TEST_PLAN"])
OUT = os.environ["INPROCESS_TEST_OUT"]
INITIAL_RANK = int(os.environ["RANK"])
STEPS = PLAN.get("steps", 20)
SHARDS = PLAN.get("max_active", 4)
SLICE = 64
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(message)s")
with open(os.path.join(OUT, f"pid{INITIAL_RANK}"), "w") as f:
    f.write(str(os.getpid()))

torch.manual_seed(0)
START = torch.randn(SHARDS * SLICE)  # the full parameter vector at step 0
shard = torch.nn.Module()
shard.weight = torch.nn.Parameter(torch.zeros(SLICE))
optimizer = torch.optim.SGD(shard.parameters(), lr=0.05, momentum=0.9)
state = inprocess.ShardedState(shard=shard, optimizer=optimizer, distance=PLAN.get("distance", 1),
                               snapshots=PLAN.get("snapshots", "copy"))
log = {"initial_rank": INITIAL_RANK, "iterations": []}


def raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes, without numpy (torch's CPU wheel does not bring it)."""
    t = t.detach().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def write():
    with open(os.path.join(OUT, f"rank{INITIAL_RANK}.json"), "w") as f:
        json.dump(log, f)


def gathered(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def fault(kind, spec):
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "kill_pair":
        with open(os.path.join(OUT, f"pid{spec['with']}")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault on initial rank {INITIAL_RANK}")


R = inprocess.rank_assignment


@inprocess.Wrapper(
    rank_assignment=inprocess.Compose(R.MaxActiveWorldSize(SHARDS), R.ActivateAllRanks(), R.ShiftRanks()),
    soft_timeout=datetime.timedelta(seconds=10), hard_timeout=datetime.timedelta(seconds=20),
    barrier_timeout=datetime.timedelta(seconds=30), completion_timeout=datetime.timedelta(seconds=30),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    s = call_wrapper.frozen_state
    rank = s.active_rank
    dist.init_process_group("gloo", store=call_wrapper.store, rank=rank, world_size=s.active_world_size,
                            timeout=datetime.timedelta(seconds=10))
    step = state.restore()
    done = state.last_restore
    log["iterations"].append({"iteration": call_wrapper.iteration, "rank": rank, "resumed": step,
                              "receivers": list(done.receivers), "nbytes": done.nbytes, "sent": done.sent,
                              "shard_nbytes": state.nbytes})
    write()
    if step is None:  # the job's start, or a shard lost with its copy: the state at step 0 (a checkpoint's place)
        step = 0
        with torch.no_grad():
            shard.weight.copy_(START[rank * SLICE:(rank + 1) * SLICE])
        optimizer.state.clear()
        state.commit(0)
    while step < STEPS:
        for spec in PLAN.get("faults", []):
            if spec["iteration"] == call_wrapper.iteration and spec["rank"] == INITIAL_RANK and spec["step"] == step:
                fault(spec["kind"], spec)
        full = gathered(shard.weight.detach()).requires_grad_()
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, full.numel(), generator=gen)
        y = torch.randn(8, generator=gen)
        torch.nn.functional.mse_loss(x @ full, y).backward()
        grad = full.grad
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
        shard.weight.grad = grad[rank * SLICE:(rank + 1) * SLICE].clone()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        state.commit(step)
    state.wait()
    h = hashlib.sha256()
    h.update(raw_bytes(gathered(shard.weight.detach())))
    h.update(raw_bytes(gathered(optimizer.state[shard.weight]["momentum_buffer"])))
    dist.destroy_process_group()
    return {"step": step, "digest": h.hexdigest()}


try:
    log["result"] = train()
except BaseException as e:
    log["exception"] = f"{type(e).__name__}: {e}"
write()
