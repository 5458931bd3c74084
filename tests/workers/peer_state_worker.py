"""A rank of a DDP job whose training state lives outside the wrapped function and
comes from a peer after a restart (inprocess.ReplicatedState), with faults from a plan.

INPROCESS_TEST_OUT   directory for this rank's JSON result
INPROCESS_TEST_PLAN  JSON: {"steps": 30, "every": 1, "max_active": 4,
                     "faults": [{"iteration": 0, "rank": 1, "step": 7, "kind": "sigkill"}],
                     "sync": "ddp" (torch's DistributedDataParallel) or "manual" (an
                     all_reduce per gradient, as a hand-written data-parallel loop),
                     "ddp_created_at": [7]: steps before which DDP is created again,
                     "grow": {...}: Wrapper(grow=GrowPolicy(...)), "full_world": 4: while fewer
                     ranks are active, wait at safe points for joiners instead of stepping,
                     "die_while_sending": {"iteration": 1, "rank": 0, "after": 3}: that rank's
                     process SIGKILLs itself after that many point-to-point sends of a restore,
                     "chunk_bytes": the transfer's chunk size, "snapshots": ReplicatedState's,
                     "staging": "cpu": the NCCL path's staged, batched transfer, over gloo}

Data are a function of (step, active rank) only, so that a job that loses a rank
to a spare computes what the same job without faults computes, if and only if every
rank resumes from the same state at the same step. The result holds a digest of the
final parameters and optimizer state (bitwise), the step each iteration resumed at,
and what each restore did.
"""

import ctypes
import datetime
import hashlib
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from peer_state_common import STAGED, stage_replicated_through

import inprocess

PLAN = json.loads(os.environ["INPROCESS_TEST_PLAN"])
OUT = os.environ["INPROCESS_TEST_OUT"]
INITIAL_RANK = int(os.environ["RANK"])
STEPS = PLAN.get("steps", 30)
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(message)s")

torch.manual_seed(0)  # every replica starts from the same weights, as DDP expects
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
state = inprocess.ReplicatedState(model=model, optimizer=optimizer, every=PLAN.get("every", 1),
                                  chunk_bytes=PLAN.get("chunk_bytes", 64 << 20),
                                  snapshots=PLAN.get("snapshots", "copy"))
log = {"initial_rank": INITIAL_RANK, "iterations": [], "staged": STAGED}
if "staging" in PLAN:
    stage_replicated_through(PLAN["staging"])


def raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes, without numpy (torch's CPU wheel does not bring it)."""
    t = t.detach().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def digest():
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(raw_bytes(t))
    for index, entry in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(entry.items()):
            h.update(f"{index}.{key}".encode())
            h.update(raw_bytes(value) if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()


def die_while_sending(spec, iteration):
    """The source of a restore dies in the middle of its transfer: dist.send and dist.isend
    (which only the transfer calls in this job) kill this process after `after` sends."""
    if spec is None or spec["iteration"] != iteration or spec["rank"] != INITIAL_RANK:
        return
    if "staging" in PLAN:  # staged: the sends are in batch_isend_irecv (peer_state_common counts them)
        STAGED["die_after"] = STAGED["sends"] + spec["after"]
        return
    sent = []

    def dying(real):
        def send(*args, **kwargs):
            if len(sent) == spec["after"]:
                os.kill(os.getpid(), 9)
            sent.append(1)
            return real(*args, **kwargs)
        return send

    dist.send, dist.isend = dying(dist.send), dying(dist.isend)


def write():
    with open(os.path.join(OUT, f"rank{INITIAL_RANK}.json"), "w") as f:
        json.dump(log, f)


R = inprocess.rank_assignment


@inprocess.Wrapper(
    rank_assignment=inprocess.Compose(R.MaxActiveWorldSize(PLAN.get("max_active", 4)), R.ActivateAllRanks(),
                                      R.ShiftRanks()),
    soft_timeout=datetime.timedelta(seconds=10), hard_timeout=datetime.timedelta(seconds=20),
    barrier_timeout=datetime.timedelta(seconds=30), completion_timeout=datetime.timedelta(seconds=30),
    grow=inprocess.GrowPolicy(**PLAN["grow"]) if "grow" in PLAN else None,
)
def train(call_wrapper: inprocess.CallWrapper = None):
    s = call_wrapper.frozen_state
    dist.init_process_group("gloo", store=call_wrapper.store, rank=s.active_rank, world_size=s.active_world_size,
                            timeout=datetime.timedelta(seconds=10))
    die_while_sending(PLAN.get("die_while_sending"), call_wrapper.iteration)
    resumed = state.restore()
    record = state.last_restore
    entry = {"iteration": call_wrapper.iteration, "rank": s.active_rank, "world_size": s.active_world_size,
             "resumed": resumed, "source": record.source, "receivers": list(record.receivers),
             "nbytes": record.nbytes}
    log["iterations"].append(entry)
    write()
    step = resumed
    if step is None:  # nobody committed yet: the job's start (a storage checkpoint would be read here)
        step = 0
        state.commit(0)
    manual = PLAN.get("sync", "ddp") == "manual"
    while s.active_world_size < PLAN.get("full_world", 0):
        # Short of ranks: no step (it would split the data otherwise) until a grow takes a joiner in.
        call_wrapper.ping()
        call_wrapper.safe_point()
        dist.barrier()  # in lockstep, as a training loop's collectives keep it: the same safe points everywhere
        time.sleep(0.05)
    ddp = model if manual else torch.nn.parallel.DistributedDataParallel(model)
    while step < STEPS:
        for f in PLAN.get("faults", []):
            if f["iteration"] == call_wrapper.iteration and f["rank"] == INITIAL_RANK and f["step"] == step:
                if f["kind"] == "sigkill":
                    os.kill(os.getpid(), 9)
                raise RuntimeError(f"injected fault on initial rank {INITIAL_RANK} at step {step}")
        if step in PLAN.get("ddp_created_at", []) and not manual:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        gen = torch.Generator().manual_seed(1000 * step + s.active_rank)
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        if manual:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= s.active_world_size
        with call_wrapper.atomic():  # a restart lands before the step or after its commit
            optimizer.step()
            step += 1
            state.commit(step)
    dist.destroy_process_group()
    return {"step": step, "digest": digest()}


try:
    log["result"] = train()
except BaseException as e:
    log["exception"] = f"{type(e).__name__}: {e}"
write()
