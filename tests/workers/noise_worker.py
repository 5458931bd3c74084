"""A job as a migrated one runs: CudaHealthCheck in its health check, the root logger at INFO
(as nvidia_resiliency_ext's examples configure it), and one fault: initial rank 1 is SIGKILLed in
iteration 0; the others wait for the restart and return in iteration 1. The test reads the output."""

import datetime
import logging
import os
import signal
import sys
import time

import inprocess

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@inprocess.Wrapper(
    health_check=inprocess.health_check.CudaHealthCheck(),
    soft_timeout=datetime.timedelta(seconds=20),
    hard_timeout=datetime.timedelta(seconds=30),
    barrier_timeout=datetime.timedelta(seconds=40),
    completion_timeout=datetime.timedelta(seconds=30),
)
def train(call_wrapper: inprocess.CallWrapper = None):
    if call_wrapper.iteration == 0:
        if int(os.environ["RANK"]) == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)  # until the restart
    return call_wrapper.iteration


if __name__ == "__main__":
    print(f"[worker] returned {train()}", flush=True)
    sys.exit(0)
