"""A 4-rank CPU training job that survives faults without leaving its processes.

    python examples/demo.py                                      # starts 4 ranks on 127.0.0.1
    DEMO_FAULTS=2:30,1:60 torchrun --standalone --nproc-per-node 4 examples/demo.py
                    # under torchrun: exceptions only; a killed worker is torchrun's to
                    # replace, with all the others (README, "Launchers")

A small MLP trains under DDP (gloo) for 100 steps. Rank 2 raises at step 30,
rank 1 at step 60, and rank 0's process is SIGKILLed at step 80; each time the
ranks still there restart the function in-process and resume from the last step
they all committed. The library says what happened (its one WARNING line per
restart, on the lowest active rank: the cause, who left, how long it took), and
the current rank 0 prints the step the ranks resume at. The
process group's rendezvous runs on ``call_wrapper.store``, served by the store
host process (not by rank 0's process), so the job survives losing rank 0.
Environment: DEMO_STEPS, DEMO_FAULTS ("rank:step[:kill],...").
"""

from __future__ import annotations

import copy
import datetime
import os
import signal
import sys
import time

TOTAL_STEPS = int(os.environ.get("DEMO_STEPS", "100"))

def parse_faults(spec: str) -> list[tuple[int, int, str]]:
    """"rank:step" raises at that step; "rank:step:kill" SIGKILLs the rank's process."""
    faults = []
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        kind = parts[2] if len(parts) == 3 else "raise"
        if len(parts) not in (2, 3) or kind not in ("raise", "kill"):
            raise ValueError(f"DEMO_FAULTS item {item!r}: expected rank:step or rank:step:kill")
        faults.append((int(parts[0]), int(parts[1]), kind))
    return faults


FAULTS = parse_faults(os.environ.get("DEMO_FAULTS", "2:30,1:60,0:80:kill"))


def launch(world_size: int = 4) -> int:
    from inprocess.launch import LocalJob

    killed = {rank for rank, _, kind in FAULTS if kind == "kill"}
    with LocalJob([__file__], world_size, capture=False) as job:
        ranks = job.wait(timeout=300)
    # A rank killed on purpose ends with SIGKILL; every other rank must succeed.
    bad = [r for r in ranks if r.returncode != (-signal.SIGKILL if r.rank in killed else 0)]
    for r in bad:
        print(f"[demo] rank {r.rank} ended with return code {r.returncode}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__" and "RANK" not in os.environ:
    # The launcher needs no torch (only the ranks import it): it starts them and waits.
    sys.exit(launch())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import inprocess  # noqa: E402


class TrainState:
    """Lives across restarts: the wrapped function receives this same object every time.

    It keeps the last two committed steps: a restart can interrupt a rank
    between a step's allreduce and its commit, so ranks may resume one step
    apart; they agree on the lowest and the ones ahead roll back one step.
    """

    def __init__(self) -> None:
        self.step = 0
        self.snapshot: tuple[dict, dict, float] | None = None  # model, optimizer, loss at `step`
        self.previous: tuple[int, tuple[dict, dict, float] | None] | None = None
        self.faults_done: set[tuple[int, int, str]] = set()
        self.active_rank: int | None = None

    def commit(self, model: torch.nn.Module, opt: torch.optim.Optimizer, loss: float) -> None:
        self.previous = (self.step, self.snapshot)
        self.snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), loss)
        self.step += 1

    def roll_back_to(self, step: int) -> None:
        if step == self.step:
            return
        assert self.previous is not None and self.previous[0] == step, (step, self.step)
        self.step, self.snapshot = self.previous
        self.previous = None

    @property
    def loss(self) -> float:
        return self.snapshot[2] if self.snapshot else float("nan")


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=10),
    soft_timeout=datetime.timedelta(seconds=30),
    hard_timeout=datetime.timedelta(seconds=60),
    barrier_timeout=datetime.timedelta(seconds=90),
)
def train(state: TrainState, call_wrapper: inprocess.CallWrapper | None = None) -> float:
    assert call_wrapper is not None
    me = call_wrapper.frozen_state
    # A process group per iteration, on the store the engine scopes to it. Its
    # timeout is short: it bounds the rare gloo collective that a restart cannot
    # release (README, "Gloo timeout").
    dist.init_process_group("gloo", store=call_wrapper.store, rank=me.active_rank,
                            world_size=me.active_world_size, timeout=datetime.timedelta(seconds=5))
    agreed = torch.tensor([state.step])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    state.roll_back_to(int(agreed))
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    if state.snapshot is not None:
        model.load_state_dict(state.snapshot[0])
        opt.load_state_dict(state.snapshot[1])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if me.active_rank == 0 and call_wrapper.restarts:
        # The restart itself was logged by the library (its summary); call_wrapper.restarts holds its record.
        record = call_wrapper.restarts[-1]
        print(f"[demo] iteration {call_wrapper.iteration}: {me.active_world_size} ranks resume at step {state.step}, "
              f"{record.duration_s * 1e3:.0f} ms after the fault", flush=True)
    initial_rank = me.initial_rank
    state.active_rank = me.active_rank
    while state.step < TOTAL_STEPS:
        call_wrapper.ping()
        for fault in FAULTS:
            if fault[:2] == (initial_rank, state.step) and fault not in state.faults_done:
                state.faults_done.add(fault)
                if fault[2] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault at step {state.step}")
        gen = torch.Generator().manual_seed(state.step * 1000 + me.active_rank)
        x = torch.randn(64, 32, generator=gen)
        y = torch.sin(x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        # Commit the step (an in-memory checkpoint) as one unit: a restart waits for it.
        with call_wrapper.atomic():
            state.commit(model, opt, float(loss.detach()))
    dist.destroy_process_group()
    return state.loss


def run_rank() -> int:
    start = time.monotonic()
    state = TrainState()
    loss = train(state)
    if state.active_rank == 0:
        print(f"[demo] finished {TOTAL_STEPS} steps in {time.monotonic() - start:.1f} s, "
              f"final loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_rank())
