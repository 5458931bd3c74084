"""A rank of benchmarks/join_latency.py's and grow_pause.py's jobs: a gloo all_reduce per step, a timeline on disk.

Started by ``inprocess.launch.LocalJob`` (the job's first processes) or by its
``respawn`` (``INPROCESS_JOIN=1``: a process that joins the running job).
Environment: ``OUT`` (a directory), ``STEP_S`` (sleep per step),
``GROW_CHECK_EVERY`` (set: ``Wrapper(grow=GrowPolicy(min_waiting=1,
min_interval_s=0, check_every=N))``, the job grows at a safe point), and the
launcher's ``RANK``, ``INPROCESS_RESPAWN_COUNT``. Writes
``OUT/events.seat<r>.life<k>.jsonl``, one JSON object per line, with
``time.monotonic()`` stamps (one clock for every process of this machine):

* ``start``: the first line of this file ran (the interpreter is up, nothing imported);
* ``announced`` / ``admitted``: the library logged that this process announced
  itself to the running job / was admitted by a restart's leader (its own
  INFO lines, ``inprocess/engine/join.py``, caught by a logging handler);
* ``step``: the first step of each iteration completed (an all_reduce with
  every active rank), with the iteration and the active world size;
* ``last_step``: the function left an iteration (it returned, raised, or a
  restart interrupted it): the iteration, its last completed step (``t``), and
  its first (``t_first``) and number of steps (``steps``);
* ``raise``: this process raised the fault the driver asked for (file
  ``OUT/fault<k>``; seat 0 only, which the driver never kills).

Each step is an all_reduce, then a sleep of ``STEP_S``, then
``call_wrapper.safe_point()`` (a no-op without ``GROW_CHECK_EVERY``).

Its stdout and stderr (and its monitor's) go to ``OUT/output.seat<r>.life<k>.txt``.
"""

import time

T_START = time.monotonic()

import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

OUT = os.environ["OUT"]
SEAT = int(os.environ["RANK"])
LIFE = int(os.environ.get("INPROCESS_RESPAWN_COUNT", "0"))
STEP_S = float(os.environ.get("STEP_S", "0.02"))
_fd = os.open(os.path.join(OUT, f"output.seat{SEAT}.life{LIFE}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
os.dup2(_fd, 1)
os.dup2(_fd, 2)
_events = open(os.path.join(OUT, f"events.seat{SEAT}.life{LIFE}.jsonl"), "a", buffering=1)


def event(ev: str, t: float, **fields: object) -> None:
    _events.write(json.dumps({"ev": ev, "t": t, **fields}) + "\n")


event("start", T_START)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import inprocess  # noqa: E402


class JoinTimeline(logging.Handler):
    """The library's own log lines of a joiner's progress (engine/join.py), stamped as they are emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "waiting to join the running job" in message:
            event("announced", time.monotonic())
        elif ": admitted at barrier " in message:
            event("admitted", time.monotonic())


_handler = JoinTimeline(logging.INFO)
logging.getLogger("inprocess").addHandler(_handler)
logging.getLogger("inprocess").setLevel(logging.INFO)

faults_raised = 0  # seat 0's process raises fault k once OUT/fault<k> exists (never killed: one process)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


GROW_CHECK_EVERY = os.environ.get("GROW_CHECK_EVERY")
grow = (inprocess.GrowPolicy(min_waiting=1, min_interval_s=0, check_every=int(GROW_CHECK_EVERY))
        if GROW_CHECK_EVERY else None)
wrapper = inprocess.Wrapper(
    grow=grow,
    rank_assignment=inprocess.Compose(inprocess.rank_assignment.ActivateAllRanks(),
                                      inprocess.rank_assignment.ShiftRanks()),
    soft_timeout=td(60), hard_timeout=td(90), barrier_timeout=td(120), completion_timeout=td(60),
    heartbeat_timeout=td(30),
)


@wrapper
def train(call_wrapper: inprocess.CallWrapper = None) -> int:
    global faults_raised
    state = call_wrapper.frozen_state
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=td(60))
    t_first = t_last = None
    steps = 0
    try:
        x = torch.ones(4)
        while not os.path.exists(os.path.join(OUT, "end")):
            call_wrapper.ping()
            if SEAT == 0 and os.path.exists(os.path.join(OUT, f"fault{faults_raised}")):
                faults_raised += 1
                event("raise", time.monotonic(), k=faults_raised - 1, iteration=call_wrapper.iteration)
                raise RuntimeError(f"benchmark fault {faults_raised - 1}")
            dist.all_reduce(x)
            t_last = time.monotonic()
            steps += 1
            if t_first is None:
                t_first = t_last
                event("step", t_first, iteration=call_wrapper.iteration, active_world_size=state.active_world_size)
            time.sleep(STEP_S)
            call_wrapper.safe_point()  # with GROW_CHECK_EVERY, the job may grow here
        return call_wrapper.iteration
    finally:
        event("last_step", t_last, iteration=call_wrapper.iteration, t_first=t_first, steps=steps)
        dist.destroy_process_group()


train()
event("end", time.monotonic())
