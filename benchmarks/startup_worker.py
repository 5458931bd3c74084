"""One rank of benchmarks/startup.py: times entering and leaving one wrapped call.

STARTUP_LIBRARY: "bare" (no wrapper), or the module to wrap with ("inprocess",
"nvidia_resiliency_ext.inprocess"). STARTUP_SCENARIO: "return" (the function
returns at once) or "soft_timeout" (one rank, soft_timeout 1 s: a ping, then
10 ms sleeps without pinging, under RetryController(max_iterations=1); the
intervals 0.1 s, below soft_timeout as both libraries require).
Before the call, every rank meets the others on a plain TCPStore (on
STARTUP_MEETING_PORT), so that the launcher's skew is not measured. Prints one JSON line.
"""

import datetime
import importlib
import json
import os
import time

import torch.distributed as dist

library = os.environ["STARTUP_LIBRARY"]
scenario = os.environ.get("STARTUP_SCENARIO", "return")
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
marks: dict[str, float] = {}


def body(call_wrapper=None):
    marks["entered"] = time.perf_counter()
    if scenario == "soft_timeout":
        call_wrapper.ping()
        while True:
            time.sleep(0.01)
    return rank


fn = body
if library != "bare":
    inprocess = importlib.import_module(library)
    kwargs = {}
    if scenario == "soft_timeout":
        short = datetime.timedelta(seconds=0.1)  # every interval must be shorter than soft_timeout
        kwargs = dict(initialize=inprocess.initialize.RetryController(max_iterations=1),
                      soft_timeout=datetime.timedelta(seconds=1), hard_timeout=datetime.timedelta(seconds=5),
                      barrier_timeout=datetime.timedelta(seconds=40), progress_watchdog_interval=short,
                      monitor_thread_interval=short, monitor_process_interval=short)

    def wrapped(call_wrapper: inprocess.CallWrapper = None):
        return body(call_wrapper)

    fn = inprocess.Wrapper(**kwargs)(wrapped)

meeting = dist.TCPStore("127.0.0.1", int(os.environ["STARTUP_MEETING_PORT"]), world_size, rank == 0,
                        datetime.timedelta(seconds=60))
if meeting.add("arrived", 1) == world_size:
    meeting.set("go", "1")  # the last to arrive lets everyone call at once
meeting.wait(["go"], datetime.timedelta(seconds=60))
marks["call"] = time.perf_counter()
outcome = "returned"
try:
    fn()
except BaseException as e:
    outcome = type(e).__name__
marks["left"] = time.perf_counter()
result = {"rank": rank, "outcome": outcome, "total_ms": 1e3 * (marks["left"] - marks["call"])}
if "entered" in marks:
    result["entry_ms"] = 1e3 * (marks["entered"] - marks["call"])
if scenario == "return" and "entered" in marks:
    result["exit_ms"] = 1e3 * (marks["left"] - marks["entered"])
print("STARTUP " + json.dumps(result), flush=True)
# Rank 0 serves the meeting store: it leaves last, once every rank has reported.
meeting.add("reported", 1)
if rank == 0:
    while meeting.add("reported", 0) < world_size:
        time.sleep(0.01)
