"""A rank of an FSDP2 job (``fully_shard`` per layer, Adam, gloo on CPU) whose shard comes from a
partner's copy after a restart (inprocess.ShardedState through torch.distributed.checkpoint's
state dicts), with faults from a plan.

INPROCESS_TEST_OUT   directory for this rank's JSON result
INPROCESS_TEST_PLAN  JSON: {"steps": 12, "max_active": 4,
                     "faults": [{"iteration": 0, "rank": 1, "step": 7, "kind": "sigkill"}]}
                     kinds: sigkill, exception

The model is built and sharded anew in each iteration (an FSDP2 module is bound to the process
group it was sharded over) and handed to ``state.restore(model=..., optimizer=...)``. Data are a
function of (step, active rank). The result holds a digest of the full parameters and the full
Adam state (gathered through get_model_state_dict / get_optimizer_state_dict with
full_state_dict=True), the same on every rank.
"""

import datetime
import hashlib
import logging
import os

import torch
import torch.distributed as dist
from peer_state_common import INITIAL_RANK, PLAN, fault_at, raw_bytes, run, wrapper, write
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

import inprocess

STEPS = PLAN.get("steps", 12)
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(message)s")

state = inprocess.ShardedState(distance=PLAN.get("distance", 1))
log = {"initial_rank": INITIAL_RANK, "iterations": []}


def build():
    torch.manual_seed(0)  # the step-0 weights, alike on every rank (a checkpoint's place)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24), torch.nn.ReLU(),
                                torch.nn.Linear(24, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def digest(model, optimizer):
    full = StateDictOptions(full_state_dict=True)
    h = hashlib.sha256()
    for name, t in sorted(get_model_state_dict(model, options=full).items()):
        h.update(name.encode() + raw_bytes(t))
    for fqn, entry in sorted(get_optimizer_state_dict(model, optimizer, options=full)["state"].items()):
        for key, value in sorted(entry.items()):
            h.update(f"{fqn}.{key}".encode() + raw_bytes(value))
    return h.hexdigest()


@wrapper(PLAN.get("max_active", 4), seconds=15)
def train(call_wrapper: inprocess.CallWrapper = None):
    s = call_wrapper.frozen_state
    rank = s.active_rank
    dist.init_process_group("gloo", store=call_wrapper.store, rank=rank, world_size=s.active_world_size,
                            timeout=datetime.timedelta(seconds=15))
    model, optimizer = build()
    step = state.restore(model=model, optimizer=optimizer)
    done = state.last_restore
    log["iterations"].append({"iteration": call_wrapper.iteration, "rank": rank, "resumed": step,
                              "receivers": list(done.receivers), "nbytes": done.nbytes})
    write(log)
    if step is None:  # the job's start: the model as built (a checkpoint would be read here)
        step = 0
        state.commit(0)
    while step < STEPS:
        fault_at(call_wrapper.iteration, step)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        state.commit(step)
    state.wait()
    result = {"step": step, "digest": digest(model, optimizer)}
    dist.destroy_process_group()
    return result


run(train, log)
