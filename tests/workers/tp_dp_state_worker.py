"""A rank of a 2 x 2 tensor x data parallel job (Megatron-style layout: tensor group {0, 1} and
{2, 3}, data-parallel group {0, 2} and {1, 3}) whose state comes back over its data-parallel group
after a restart, with faults from a plan; spares fill a lost rank's number (FillGaps).

INPROCESS_TEST_OUT   directory for this rank's JSON result
INPROCESS_TEST_PLAN  JSON: {"steps": 10, "mode": "replicated" | "sharded",
                     "faults": [{"iteration": 0, "rank": 1, "step": 4, "kind": "sigkill"}]}

The model: y = relu(x W1) W2, W1 split by columns and W2 by rows over the tensor group (the
partial outputs summed by an all_reduce over it), gradients averaged over the data-parallel group,
Adam. "replicated": every rank keeps its tensor slice and its Adam state, alike across its
data-parallel group (ReplicatedState, restore(group=dp)). "sharded": ZeRO within the data-parallel
group: each rank owns half of its tensor slice's parameters (flattened) and their Adam state
(ShardedState, restore(group=dp)), the slice all-gathered over the group at each step. Data are a
function of (step, data-parallel rank). The result holds a digest of this rank's tensor slice and
its whole Adam state (gathered over the data-parallel group in "sharded").
"""

import datetime
import hashlib
import logging
import os

import torch
import torch.distributed as dist
from peer_state_common import INITIAL_RANK, PLAN, fault_at, raw_bytes, run, wrapper, write

import inprocess

STEPS = PLAN.get("steps", 10)
MODE = PLAN.get("mode", "replicated")
IN, HIDDEN, OUT = 8, 16, 4
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(message)s")

torch.manual_seed(0)
FULL = (torch.randn(IN, HIDDEN) * 0.3, torch.randn(HIDDEN, OUT) * 0.3)  # the step-0 weights (a checkpoint's place)
holder = torch.nn.Module()  # "replicated": this rank's tensor slice; "sharded": its half of the flattened slice
if MODE == "replicated":
    holder.w1 = torch.nn.Parameter(torch.zeros(IN, HIDDEN // 2))
    holder.w2 = torch.nn.Parameter(torch.zeros(HIDDEN // 2, OUT))
else:
    holder.flat = torch.nn.Parameter(torch.zeros((IN + OUT) * HIDDEN // 4))
optimizer = torch.optim.Adam(holder.parameters(), lr=0.01)
kind = inprocess.ReplicatedState if MODE == "replicated" else inprocess.ShardedState
state = kind(model=holder, optimizer=optimizer)
log = {"initial_rank": INITIAL_RANK, "iterations": []}


def groups(world):
    """Every rank creates every group, in one order: (its tensor group, its data-parallel group)."""
    tp = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    dp = [dist.new_group([t, t + 2]) for t in range(2)]
    rank = dist.get_rank()
    return tp[rank // 2], dp[rank % 2]


def start(tp_rank, dp_rank):
    """The step-0 state of this rank's slice (and, "sharded", its half)."""
    w1 = FULL[0][:, tp_rank * HIDDEN // 2:(tp_rank + 1) * HIDDEN // 2]
    w2 = FULL[1][tp_rank * HIDDEN // 2:(tp_rank + 1) * HIDDEN // 2]
    optimizer.state.clear()
    with torch.no_grad():
        if MODE == "replicated":
            holder.w1.copy_(w1)
            holder.w2.copy_(w2)
        else:
            flat = torch.cat([w1.reshape(-1), w2.reshape(-1)])
            half = flat.numel() // 2
            holder.flat.copy_(flat[dp_rank * half:(dp_rank + 1) * half])


def gathered(t, group):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts)


def slice_weights(dp):
    """This rank's tensor slice: (the leaf that gets the gradient, w1, w2)."""
    if MODE == "replicated":
        return None, holder.w1, holder.w2
    flat = gathered(holder.flat, dp).requires_grad_()
    n1 = IN * HIDDEN // 2
    return flat, flat[:n1].view(IN, HIDDEN // 2), flat[n1:].view(HIDDEN // 2, OUT)


def one_step(step, tp, dp, dp_rank):
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    x, y = torch.randn(8, IN, generator=gen), torch.randn(8, OUT, generator=gen)
    optimizer.zero_grad()  # here, not after the step: a restart may have cut a step after its backward
    leaf, w1, w2 = slice_weights(dp)
    part = torch.relu(x @ w1) @ w2
    total = part.detach().clone()
    dist.all_reduce(total, group=tp)
    torch.nn.functional.mse_loss(part + (total - part.detach()), y).backward()
    if MODE == "replicated":
        for p in holder.parameters():
            dist.all_reduce(p.grad, group=dp)
            p.grad /= 2
    else:
        grad = leaf.grad
        dist.all_reduce(grad, group=dp)
        grad /= 2
        half = grad.numel() // 2
        holder.flat.grad = grad[dp_rank * half:(dp_rank + 1) * half].clone()
    optimizer.step()


def digest(dp):
    h = hashlib.sha256()
    tensors = [p for p in holder.parameters()]
    tensors += [v for entry in optimizer.state.values() for _, v in sorted(entry.items())]
    for t in tensors:
        h.update(raw_bytes(gathered(t.reshape(-1), dp) if MODE == "sharded" and t.dim() else t))
    return h.hexdigest()


@wrapper(4, seconds=15, fill_gaps=True)
def train(call_wrapper: inprocess.CallWrapper = None):
    s = call_wrapper.frozen_state
    rank = s.active_rank
    dist.init_process_group("gloo", store=call_wrapper.store, rank=rank, world_size=s.active_world_size,
                            timeout=datetime.timedelta(seconds=15))
    tp, dp = groups(s.active_world_size)
    tp_rank, dp_rank = rank % 2, rank // 2
    step = state.restore(group=dp)
    done = state.last_restore
    log["iterations"].append({"iteration": call_wrapper.iteration, "rank": rank, "resumed": step,
                              "receivers": list(done.receivers), "nbytes": done.nbytes,
                              "node": os.environ.get("GROUP_RANK"), "keeper": getattr(state, "keeper", None)})
    write(log)
    if step is None:
        step = 0
        start(tp_rank, dp_rank)
        state.commit(0)
    while step < STEPS:
        fault_at(call_wrapper.iteration, step)
        one_step(step, tp, dp, dp_rank)
        step += 1
        state.commit(step)
        if PLAN.get("trace"):
            log.setdefault("trace", []).append([step, digest(dp)])
    if MODE == "sharded":
        state.wait()
    result = {"step": step, "rank": rank, "digest": digest(dp)}
    dist.destroy_process_group()
    return result


run(train, log)
