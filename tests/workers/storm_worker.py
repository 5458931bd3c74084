"""A job whose every iteration fails at once, for the same reason, until a wall-clock deadline.

STORM_MODE selects the reason:

* ``raise`` (default): rank 1 raises at once in every iteration, with a message
  whose numbers change (a port, the iteration), as a real error's do; the other
  ranks wait for the restart.
* ``sleep``: rank 1 sleeps (an interruptible call, no progress) past
  ``soft_timeout`` (STORM_SOFT_TIMEOUT seconds) in every iteration, so the job
  restarts every soft_timeout;
* ``own_store``: as nvidia_resiliency_ext's advanced example, rank 0 hosts a
  torch TCPStore of its own (MASTER_PORT + 2) and every rank builds its process
  group on it; rank 0 is SIGKILLed in iteration 0, after which every iteration
  fails at once on every rank (the store died with rank 0).

STORM_SECONDS after rank 1's first iteration started (it writes the moment to
INPROCESS_TEST_OUT/until, where the other ranks read it) the function stops
failing and returns, so that the job ends by itself. STORM_MAX_ITERATIONS, if set, gives the Wrapper a
RetryController(max_iterations=N). The logging is configured as that example
configures it (the root logger at INFO, a timestamp and the level). Each rank
writes INPROCESS_TEST_OUT/rank<r>.json: its restarts, their repeat counts and
summaries, and how it ended.
"""

import datetime
import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import inprocess

OUT = os.environ["INPROCESS_TEST_OUT"]
RANK = int(os.environ["RANK"])
MODE = os.environ.get("STORM_MODE", "raise")
SECONDS = float(os.environ["STORM_SECONDS"])
UNTIL_FILE = os.path.join(OUT, "until")


def storm_until() -> float:
    """When the storm ends (time.time()): STORM_SECONDS after rank 1 first entered the function."""
    if RANK == 1 and not os.path.exists(UNTIL_FILE):
        with open(UNTIL_FILE + ".tmp", "w") as f:
            f.write(str(time.time() + SECONDS))
        os.replace(UNTIL_FILE + ".tmp", UNTIL_FILE)
    for _ in range(600):
        if os.path.exists(UNTIL_FILE):
            with open(UNTIL_FILE) as f:
                return float(f.read())
        time.sleep(0.05)
    raise RuntimeError("rank 1 never wrote when the storm ends")

MAX_ITERATIONS = os.environ.get("STORM_MAX_ITERATIONS")

logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(name)s: %(message)s")

RESTARTS: list = []  # what the rank's restart records say, as of its last iteration
own_store = None
if MODE == "own_store":
    own_store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]) + 2, int(os.environ["WORLD_SIZE"]),
                              is_master=RANK == 0, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


@inprocess.Wrapper(
    initialize=(inprocess.initialize.RetryController(max_iterations=int(MAX_ITERATIONS))
                if MAX_ITERATIONS else None),
    soft_timeout=datetime.timedelta(seconds=float(os.environ.get("STORM_SOFT_TIMEOUT", "20"))),
    progress_watchdog_interval=datetime.timedelta(seconds=0.2),
    monitor_thread_interval=datetime.timedelta(seconds=0.2),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=40),
    completion_timeout=datetime.timedelta(seconds=30),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    state = call_wrapper.frozen_state
    RESTARTS[:] = [{"iteration": r.iteration, "repeats": r.repeats,
                    "summary": r.summary(state.active_world_size, state.world_size)} for r in call_wrapper.restarts]
    until = storm_until()
    if time.time() >= until:
        return state.iteration
    if MODE == "sleep":
        if RANK == 1:
            time.sleep(until - time.time() + 0.5)  # no progress: a soft timeout
        while time.time() < until + 0.5:
            time.sleep(0.05)  # progress (bytecode runs between the sleeps): waits for the restart
        return state.iteration
    if MODE == "raise":
        if RANK == 1:
            raise RuntimeError(f"cannot reach the data server at 127.0.0.1:{40000 + state.iteration}: "
                               f"attempt {state.iteration + 1} refused")
        time.sleep(until - time.time() + 0.5)  # the restart comes first, but for the last iteration
        return state.iteration
    store = dist.PrefixStore(str(state.iteration), own_store)
    dist.init_process_group("gloo", store=store, rank=state.active_rank, world_size=state.active_world_size,
                            timeout=datetime.timedelta(seconds=10))
    try:
        for step in range(1000):
            if state.iteration == 0 and RANK == 0 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.ones(4)
            dist.all_reduce(t)
            call_wrapper.ping()
            time.sleep(0.01)
    finally:
        dist.destroy_process_group()
    return state.iteration


if __name__ == "__main__":
    outcome = {"rank": RANK}
    try:
        outcome["result"] = train()
        outcome["ended"] = "returned"
    except BaseException as e:  # noqa: BLE001 - the test reads how the rank ended
        outcome["ended"] = type(e).__name__
        outcome["message"] = str(e)[:300]
    outcome["restarts"] = RESTARTS
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(outcome, f)
    sys.exit(0 if outcome["ended"] == "returned" else 1)
