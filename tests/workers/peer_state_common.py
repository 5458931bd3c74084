"""What the peer-state workers share: the plan, the rank's log file, faults at a step, bytes of a tensor.

Imported by tests/workers/*_state_worker.py (run as scripts: this folder is first on their path).
"""

import ctypes
import datetime
import json
import os
import signal

import inprocess

PLAN = json.loads(os.environ.get("INPROCESS_TEST_PLAN", "{}"))  # a job's worker has all three
OUT = os.environ.get("INPROCESS_TEST_OUT", "")
INITIAL_RANK = int(os.environ.get("RANK", "-1"))


def raw_bytes(t):
    """A CPU tensor's bytes, without numpy (torch's CPU wheel does not bring it)."""
    t = t.detach().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def write(log):
    with open(os.path.join(OUT, f"rank{INITIAL_RANK}.json"), "w") as f:
        json.dump(log, f)


STAGED = {"batches": 0, "sends": 0, "die_after": None}  # this process's staged transfers (see below)


def stage_replicated_through(device):
    """The seam of the NCCL path, over gloo: every ReplicatedState transfer stages its chunks
    through two buffers on `device` and batches every point to point, as it does through the
    GPU an NCCL group is bound to (ProcessGroupTransport's `staging`). STAGED counts the batches
    and the sends in them; once STAGED["die_after"] sends were posted, the process SIGKILLs
    itself before posting another (a source that dies in the middle of its transfer)."""
    import torch
    import torch.distributed as dist

    from inprocess.peer_state import process_group, replicated

    class StagedTransport(process_group.ProcessGroupTransport):
        def __init__(self, group, chunk_bytes):
            super().__init__(group, chunk_bytes, staging=torch.device(device))

    real = dist.batch_isend_irecv

    def batch(ops):
        sends = sum(op.op is dist.isend for op in ops)
        if sends and STAGED["die_after"] is not None and STAGED["sends"] >= STAGED["die_after"]:
            os.kill(os.getpid(), signal.SIGKILL)
        STAGED["batches"] += 1
        STAGED["sends"] += sends
        return real(ops)

    replicated.ProcessGroupTransport = StagedTransport
    dist.batch_isend_irecv = batch


def fault_at(iteration, step):
    """The plan's fault for this initial rank at (iteration, step), carried out: a SIGKILL of this
    process, or an exception raised."""
    for spec in PLAN.get("faults", []):
        if (spec["iteration"], spec["rank"], spec["step"]) == (iteration, INITIAL_RANK, step):
            if spec["kind"] == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault on initial rank {INITIAL_RANK} at step {step}")


def wrapper(max_active, seconds=10, fill_gaps=False):
    """The workers' Wrapper: at most `max_active` active ranks, spares shifted in (`fill_gaps`: a
    spare takes a lost rank's number, every other rank keeps its own); timeouts `seconds` (soft),
    twice (hard), thrice (barrier, completion)."""
    R = inprocess.rank_assignment
    s = datetime.timedelta(seconds=seconds)
    renumber = R.FillGaps() if fill_gaps else R.ShiftRanks()
    return inprocess.Wrapper(
        rank_assignment=inprocess.Compose(R.MaxActiveWorldSize(max_active), R.ActivateAllRanks(), renumber),
        soft_timeout=s, hard_timeout=2 * s, barrier_timeout=3 * s, completion_timeout=3 * s)


def run(train, log):
    """The wrapped function, its result or exception in this rank's log file."""
    try:
        log["result"] = train()
    except BaseException as e:
        log["exception"] = f"{type(e).__name__}: {e}"
    write(log)
