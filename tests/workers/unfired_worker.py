"""A job that trains for UNFIRED_SECONDS and returns, calling inprocess.faults.maybe_inject(step)
only if UNFIRED_REPORT_STEPS=1 (up to step 10): code written for nvidia_resiliency_ext does not.
INPROCESS_FAULTS holds the plan under test; the test reads each rank's output."""

import datetime
import os
import sys
import time

import inprocess

SECONDS = float(os.environ.get("UNFIRED_SECONDS", "1"))
REPORT_STEPS = os.environ.get("UNFIRED_REPORT_STEPS") == "1"


@inprocess.Wrapper(
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=40),
    completion_timeout=datetime.timedelta(seconds=30),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < SECONDS:
        if REPORT_STEPS and step <= 10:
            inprocess.faults.maybe_inject(step)
        step += 1
        time.sleep(0.05)
    return call_wrapper.iteration


if __name__ == "__main__":
    print(f"[worker] returned {train()}", flush=True)
    sys.exit(0)
