"""A rank of the fault matrix: a gloo job whose faults come from INPROCESS_FAULTS only.

The timeouts are the short, valid ones of the matrix (soft 2 s, hard 4 s,
grace 1 s, heartbeat 1 s / 5 s, barrier 15 s). Per iteration it records when
it started and its last step, and the process's threads, descriptors and
RSS; it writes rank<N>.json before it leaves, then re-raises what ended the
call, so that its exit status is what a user's script would have.

Environment: INPROCESS_TEST_OUT (directory), MATRIX_STEPS (default 6),
MATRIX_STEP_SLEEP (default 0.05), MATRIX_FIRST_STEPS (iteration 0's, default
MATRIX_STEPS), MATRIX_ACTIVE (at most this many active
ranks: the others are spares), MATRIX_STORE_KEYS=1 (initial rank 0 counts the
store's keys at each iteration start), MATRIX_SPARE_GATE=1 (a spare starts iteration 0's wait, and
its timed faults, only once every active rank ran a collective: then a fault on it never lands in the
actives' init_process_group, where a restart cannot release a rank in gloo's full-mesh connect).
"""

import datetime
import json
import logging
import os
import resource
import threading
import time

import torch
import torch.distributed as dist

import inprocess
from inprocess import faults

OUT = os.environ["INPROCESS_TEST_OUT"]
INITIAL_RANK = int(os.environ["RANK"])
STEPS = int(os.environ.get("MATRIX_STEPS", "6"))
FIRST_STEPS = int(os.environ.get("MATRIX_FIRST_STEPS", STEPS))  # iteration 0's (a slow fault on a spare needs time)
STEP_SLEEP = float(os.environ.get("MATRIX_STEP_SLEEP", "0.05"))
MAX_ACTIVE = os.environ.get("MATRIX_ACTIVE")
COUNT_KEYS = os.environ.get("MATRIX_STORE_KEYS") == "1"
SPARE_GATE = os.environ.get("MATRIX_SPARE_GATE") == "1"
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(name)s %(message)s")

log = {"initial_rank": INITIAL_RANK, "pid": os.getpid(), "iterations": []}
# The last step's start, where a killed rank can still leave it: the fault's time for the test.
STAMP = os.open(os.path.join(OUT, f"stamp{INITIAL_RANK}"), os.O_WRONLY | os.O_CREAT, 0o600)
LAST_CALL = {}


def td(seconds):
    return datetime.timedelta(seconds=seconds)


def count_fds():
    return len(os.listdir("/proc/self/fd"))


def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def count_store_keys(call_wrapper):
    try:
        return len(call_wrapper._runtime.store.list_keys())
    except Exception as e:  # noqa: BLE001 - recorded, the test decides
        return f"{type(e).__name__}: {e}"


kwargs = dict(
    soft_timeout=td(2), hard_timeout=td(4), termination_grace_time=td(1),
    heartbeat_interval=td(1), heartbeat_timeout=td(5),
    barrier_timeout=td(15), completion_timeout=td(15),
    progress_watchdog_interval=td(0.2), monitor_thread_interval=td(0.2),
)


def trained_marker(rank):
    return os.path.join(OUT, f"trained{rank}")


def spare_gate(state):
    """A health check that holds a spare's iteration 0 until every active rank ran a collective."""
    if state.mode != inprocess.Mode.INACTIVE or state.iteration != 0:
        return
    deadline = time.monotonic() + 60
    while sum(os.path.exists(trained_marker(r)) for r in range(state.initial_world_size)) < int(MAX_ACTIVE):
        if time.monotonic() > deadline:
            raise RuntimeError("the active ranks did not run a collective within 60 s")
        time.sleep(0.02)


if SPARE_GATE:
    kwargs["health_check"] = spare_gate
if MAX_ACTIVE is not None:
    R = inprocess.rank_assignment
    kwargs["rank_assignment"] = inprocess.Compose(R.MaxActiveWorldSize(int(MAX_ACTIVE)), R.ActivateAllRanks(),
                                                  R.ShiftRanks())


@inprocess.Wrapper(**kwargs)
def train(call_wrapper: inprocess.CallWrapper = None):
    LAST_CALL["call"] = call_wrapper
    state = call_wrapper.frozen_state
    entry = {"iteration": state.iteration, "world_size": state.active_world_size, "active_rank": state.active_rank,
             "steps": 0, "start_ns": time.monotonic_ns(), "threads": threading.active_count(), "fds": count_fds(),
             "rss_kib": rss_kib()}
    if COUNT_KEYS and INITIAL_RANK == 0:
        entry["store_keys"] = count_store_keys(call_wrapper)
    log["iterations"].append(entry)
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=td(10))
    total = torch.zeros(4, dtype=torch.float64)
    for step in range(FIRST_STEPS if state.iteration == 0 else STEPS):
        call_wrapper.ping()
        entry["last_step_ns"] = time.monotonic_ns()
        os.pwrite(STAMP, b"%20d %10d %10d" % (entry["last_step_ns"], state.iteration, step), 0)
        faults.maybe_inject(step)
        total += 1
        dist.all_reduce(total)
        if SPARE_GATE and state.iteration == 0 and step == 0:
            open(trained_marker(INITIAL_RANK), "w").close()
        entry["steps"] = step + 1
        time.sleep(STEP_SLEEP)
    dist.destroy_process_group()
    return {"iteration": state.iteration, "total": float(total[0])}


def main():
    log["threads_before"] = threading.active_count()
    log["fds_before"] = count_fds()
    error = None
    try:
        log["result"] = train()
    except BaseException as e:
        error = e
        log["exception"] = type(e).__name__
        log["message"] = str(e)[:500]
    call = LAST_CALL.pop("call", None)
    log["restarts"] = [
        {"iteration": r.iteration, "terminated": r.terminated, "activated": r.activated,
         "faults": [{"rank": f.rank, "kind": f.kind, "type": f.type, "t_ns": f.t_ns, "message": f.message[:200]}
                    for f in r.faults],
         "detected_ns": r.detected_ns, "decided_ns": r.decided_ns}
        for r in (call.restarts if call is not None else [])
    ]
    del call
    log["final_threads"] = threading.active_count()
    log["final_fds"] = count_fds()
    log["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(os.path.join(OUT, f"rank{INITIAL_RANK}.json"), "w") as f:
        json.dump(log, f)
    if error is not None:
        raise error


if __name__ == "__main__":
    main()
