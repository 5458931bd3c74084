"""One rank runs a wrapped call that ends as argv[1] says, then reports what of the wrapper is left.

"return": the call returns; "restart_abort": RetryController ends it with
RestartAbort; "failing_hook": a finalize hook raises during the restart.
Printed as one JSON line: the stores still reachable (gc), the threads and
socket descriptors added since before the call, and the child processes
still running a few seconds after it.
"""

import datetime
import gc
import json
import sys
import threading
import time

import psutil
import torch.distributed as dist

import inprocess
from inprocess.engine import sockets

ending = sys.argv[1]


def finalize(state):
    if ending == "failing_hook":
        raise ValueError("finalize failed")


@inprocess.Wrapper(
    initialize=inprocess.initialize.RetryController(max_iterations=1 if ending == "restart_abort" else 5),
    finalize=finalize,
    soft_timeout=datetime.timedelta(seconds=10),
    hard_timeout=datetime.timedelta(seconds=20),
    barrier_timeout=datetime.timedelta(seconds=40),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    call_wrapper.ping()
    dist.init_process_group("gloo", store=call_wrapper.store, rank=0, world_size=1)
    dist.all_reduce(__import__("torch").ones(2))
    if call_wrapper.iteration == 0 and ending != "return":
        raise RuntimeError("fault in iteration 0")
    dist.destroy_process_group()
    return "done"


gc.collect()
threads_before = {t.ident for t in threading.enumerate()}
sockets_before = sockets.socket_fds()
try:
    outcome = repr(train())
except BaseException as e:
    outcome = type(e).__name__


def children() -> list[str]:
    """Child processes, zombies included (an exited child nobody reaped is left over too)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            found.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())}")
        except psutil.ZombieProcess:
            found.append(f"{p.pid} zombie")
        except psutil.NoSuchProcess:
            pass  # gone and reaped meanwhile
    return found


deadline = time.monotonic() + 5
while children() and time.monotonic() < deadline:
    time.sleep(0.05)
gc.collect()
print(json.dumps({
    "outcome": outcome,
    "stores": sorted(type(o).__qualname__ for o in gc.get_objects() if isinstance(o, dist.Store)),
    "call_wrappers": sum(isinstance(o, inprocess.CallWrapper) for o in gc.get_objects()),
    "threads": sorted(t.name for t in threading.enumerate() if t.ident not in threads_before),
    "sockets": sorted(sockets.new_since(sockets_before).values()),
    "children": children(),
}))
