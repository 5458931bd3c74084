"""One rank of the restart-latency workload (see restart_latency.py and fault_latency.py).

MODE=inprocess: wrapped in inprocess.Wrapper; rank FAULT_RANK injects a fault
of FAULT_KIND at step FAULT_STEP of iterations 0..FAULTS-1. MODE=torchrun:
plain script restarted by torchrun; it raises at FAULT_STEP while
TORCHELASTIC_RESTART_COUNT < FAULTS.
Every rank appends JSON lines to OUT/rank<initial rank>.jsonl: the fault time
and the time each iteration's first training step starts (CLOCK_MONOTONIC,
comparable between processes of this host).

FAULT_KIND (default exception): exception (raise RuntimeError), sigkill (the
rank SIGKILLs itself), exit (os._exit(1)), hang (time.sleep forever, GIL
released), gil_hang (native spin holding the GIL). The fault is stamped just
before the rank raises, dies or hangs.
WRAPPER_TIMEOUTS: JSON {keyword: seconds} for inprocess.Wrapper's timedelta
keywords (default: soft 30 s, hard 60 s, barrier 90 s). PING=1: call
call_wrapper.ping() at every step (manual progress). UNGUARDED_INIT=1: build
the process group and DDP inside call_wrapper.disable_hang_protection(), so
that a slow rendezvous on a loaded machine is not taken for a hang by a short
soft_timeout (the training steps stay guarded). GLOO_TIMEOUT: the timeout of
the gloo process group in seconds (default 30). HIDDEN: the MLP's hidden
width (default 128; 4096 gives 1 MB of gradients). LOG_FILE: this rank's stdout
and stderr go to LOG_FILE.<initial rank> instead of the launcher's.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

MODE = os.environ["MODE"]
OUT = os.environ["OUT"]
FAULTS = int(os.environ.get("FAULTS", "5"))
FAULT_RANK = int(os.environ.get("FAULT_RANK", "2"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "5"))
STEPS = int(os.environ.get("STEPS", "10"))
FAULT_KIND = os.environ.get("FAULT_KIND", "exception")
PING = os.environ.get("PING", "0") == "1"
UNGUARDED_INIT = os.environ.get("UNGUARDED_INIT", "0") == "1"
HIDDEN = int(os.environ.get("HIDDEN", "128"))
GLOO_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT", "30")))
RANK = int(os.environ["RANK"])
if os.environ.get("LOG_FILE"):
    _log_fd = os.open(f"{os.environ['LOG_FILE']}.{RANK}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(_log_fd, 1)
    os.dup2(_log_fd, 2)
    os.close(_log_fd)
if os.environ.get("INPROCESS_TEST_LOG"):
    import logging

    logging.basicConfig(level=os.environ["INPROCESS_TEST_LOG"], format=f"%(relativeCreated)d r{RANK} %(message)s")


def record(**kv: object) -> None:
    with open(os.path.join(OUT, f"rank{RANK}.jsonl"), "a") as f:
        f.write(json.dumps(kv) + "\n")


def inject(iteration: int) -> None:
    """The fault, stamped just before it happens (the stamp reaches the file first)."""
    record(event="fault", iteration=iteration, kind=FAULT_KIND, t_ns=time.monotonic_ns())
    if FAULT_KIND == "exception":
        raise RuntimeError(f"benchmark fault {iteration}")
    if FAULT_KIND == "sigkill":
        os.kill(os.getpid(), 9)
    if FAULT_KIND == "exit":
        os._exit(1)
    if FAULT_KIND == "hang":
        time.sleep(3600)  # GIL released; the soft timeout interrupts it
    if FAULT_KIND == "gil_hang":
        from inprocess import _native

        _native.testing.spin_holding_gil(3600)  # only the monitor's hard timeout ends it
    raise ValueError(f"unknown FAULT_KIND={FAULT_KIND!r}")


def train_steps(iteration: int, rank: int, world_size: int, store: dist.Store | None, ping=None,
                unguarded=contextlib.nullcontext) -> float:
    try:
        return _train_steps(iteration, rank, world_size, store, ping, unguarded)
    except BaseException as e:
        record(event="left", iteration=iteration, t_ns=time.monotonic_ns(), why=f"{type(e).__name__}: {e}"[:200])
        raise


def _train_steps(iteration: int, rank: int, world_size: int, store: dist.Store | None, ping, unguarded) -> float:
    t_init = time.monotonic_ns()
    record(event="start", iteration=iteration, t_ns=t_init)
    with unguarded():
        if store is None:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GLOO_TIMEOUT)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=GLOO_TIMEOUT)
        record(event="pg_ready", iteration=iteration, t_ns=time.monotonic_ns())
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loss = torch.zeros(())
    for step in range(STEPS):
        if step == 0:
            record(event="first_step", iteration=iteration, t_ns=time.monotonic_ns(), init_ns=t_init)
        if ping is not None:
            ping()
        if step == FAULT_STEP and RANK == FAULT_RANK and iteration < FAULTS:
            inject(iteration)
        x = torch.randn(32, 64)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
        loss.backward()
        opt.step()
    dist.destroy_process_group()
    return float(loss.detach())


def main_inprocess() -> None:
    import inprocess

    timeouts = {"soft_timeout": 30, "hard_timeout": 60, "barrier_timeout": 90}
    timeouts.update(json.loads(os.environ.get("WRAPPER_TIMEOUTS", "{}")))

    @inprocess.Wrapper(**{k: datetime.timedelta(seconds=v) for k, v in timeouts.items()})
    def train(call_wrapper: inprocess.CallWrapper = None) -> float:
        if call_wrapper.restarts:
            # The engine's own timestamps of the restart that led here, for the breakdown.
            r = call_wrapper.restarts[-1]
            record(event="restart", iteration=r.iteration, fault_ns=r.fault_ns, detected_ns=r.detected_ns,
                   aborted_ns=r.aborted_ns, finalized_ns=r.finalized_ns, health_checked_ns=r.health_checked_ns,
                   decided_ns=r.decided_ns, initialized_ns=r.initialized_ns, assignment_ns=r.assignment_ns,
                   terminated=list(r.terminated),
                   faults=[{"rank": f.rank, "kind": f.kind, "type": f.type, "t_ns": f.t_ns} for f in r.faults])
        st = call_wrapper.frozen_state
        return train_steps(call_wrapper.iteration, st.active_rank, st.active_world_size, call_wrapper.store,
                           call_wrapper.ping if PING else None,
                           call_wrapper.disable_hang_protection if UNGUARDED_INIT else contextlib.nullcontext)

    train()


def main_torchrun() -> None:
    iteration = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    train_steps(iteration, RANK, int(os.environ["WORLD_SIZE"]), None)


if __name__ == "__main__":
    if MODE == "inprocess":
        main_inprocess()
    else:
        main_torchrun()
    sys.exit(0)
