"""A fake rank for tests/test_monitor.py: a heartbeat page, a monitor, then a fault.

argv[1] is a JSON plan: store_port, rank, call, iteration, world_size, phase
(a _native.Phase name), hard_timeout_s (0: none), grace_s, flags (list of
flag names), pidfile, logfile, action; optional: initial_world_size,
barrier_timeout_s, heartbeat_interval_s, heartbeat_timeout_s (0: no peers
watched). Prints "ready <monitor pid>" once the monitor watches (its pidfile
exists), then does ``action``:

  wait   sleep (the test injects the fault: SIGKILL, SIGSTOP)
  hang   sleep without progress: the hard timeout kills it
  exit1  os._exit(1)
  segv   read address 0
  done   set phase DONE and exit 0 (left the wrapper normally)
  early  os._exit(3) right after spawning the monitor (before it watches)
"""

import json
import os
import sys
import time

from inprocess import _native
from inprocess.processes.contract import MonitorConfig
from inprocess.processes.helper_process import HelperProcess

plan = json.loads(sys.argv[1])
page = _native.HeartbeatPage.create()
page.begin_iteration(plan["iteration"], plan["world_size"])
page.set_phase(getattr(_native.Phase, plan["phase"]))
page.set_timeouts(0, int(plan["hard_timeout_s"] * 1e9))
for name in plan.get("flags", []):
    page.set_flag(getattr(_native, name), True)
config = MonitorConfig(
    store_host="127.0.0.1", store_port=plan["store_port"], call=plan["call"], rank=plan["rank"],
    heartbeat_fd=page.fd, pid=os.getpid(), grace_s=plan["grace_s"],
    world_size=plan.get("initial_world_size"), kill_wait_s=2.0, store_timeout_s=10.0,
    barrier_timeout_s=plan.get("barrier_timeout_s", 10.0), logfile=plan["logfile"], pidfile=plan["pidfile"],
    heartbeat_interval_s=plan.get("heartbeat_interval_s", 0.0),
    heartbeat_timeout_s=plan.get("heartbeat_timeout_s", 0.0), log_level="DEBUG",
)
monitor = HelperProcess.start(config, env=dict(os.environ, INPROCESS_MONITOR_REPORT_MODULES="1"))
print(f"spawned {monitor.pid}", flush=True)
action = plan["action"]
if action == "early":
    os._exit(3)
# Test-harness readiness only (not part of the library): the monitor writes
# its pidfile once it watches this process. Until then this process stamps
# progress, so that a short hard timeout counts from the moment the monitor
# watches, not from the page's creation: starting the monitor takes longer
# than 0.5 s on a loaded machine, and it would kill this process before
# the test hears "ready".
deadline = time.monotonic() + 20
while not os.path.exists(plan["pidfile"]):
    if monitor.poll() is not None or time.monotonic() > deadline:
        print(f"monitor failed rc={monitor.poll()}", flush=True)
        sys.exit(7)
    page.stamp_auto()
    time.sleep(0.005)
page.stamp_auto()
print(f"ready {monitor.pid}", flush=True)

if action in ("wait", "hang"):
    while True:
        time.sleep(3600)
elif action == "exit1":
    os._exit(1)
elif action == "segv":
    import ctypes

    ctypes.string_at(0)
elif action == "done":
    page.set_phase(_native.Phase.DONE)
    page.close()
    sys.exit(0)
else:
    raise SystemExit(f"unknown action {action!r}")
