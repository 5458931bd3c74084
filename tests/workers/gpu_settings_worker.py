"""A rank for tests/test_gpu_settings.py, on the fake GPU libraries.

INPROCESS_TEST_PLAN:
- {"case": "sticky"}: iteration 0 starts the fake of torch's NCCL watchdog
  (tests/fakes/fake_torch_watchdog.c, its path in FAKE_TORCH_WATCHDOG), then
  a kernel hits an illegal address (the fake libcuda turns sticky); the
  training loop goes on for a while, as one does until its next
  synchronisation, then raises the CUDA error. CudaHealthCheck runs in the
  restart. The exit status says who ended the process: 76 (inprocess, the
  context lost) or SIGABRT (torch's watchdog).
- {"case": "settings", "calls": N}: N wrapped calls in a row, each restarting
  once; the check of the GPU settings is told NCCL is in use (nccl_in_use is
  replaced, as on a GPU node with NCCL 2.18.3), unless "real_in_use" is true.
"""

import ctypes
import datetime
import json
import logging
import os
import time

import torch.distributed as dist

import inprocess
from inprocess.gpu import settings
from inprocess.health_check import CudaHealthCheck

PLAN = json.loads(os.environ.get("INPROCESS_TEST_PLAN", "{}"))
RANK = int(os.environ["RANK"])
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{RANK} %(threadName)s %(message)s")

TIMEOUTS = dict(
    soft_timeout=datetime.timedelta(seconds=10),
    hard_timeout=datetime.timedelta(seconds=20),
    termination_grace_time=datetime.timedelta(seconds=5),
    barrier_timeout=datetime.timedelta(seconds=30),
    completion_timeout=datetime.timedelta(seconds=30),
)


def sticky() -> None:
    @inprocess.Wrapper(health_check=CudaHealthCheck(), **TIMEOUTS)
    def train(call_wrapper: inprocess.CallWrapper = None) -> None:
        if call_wrapper.iteration == 0:
            os.environ["FAKE_CUDA_MODE"] = "sticky"  # a kernel hit an illegal address
            watchdog = ctypes.CDLL(os.environ["FAKE_TORCH_WATCHDOG"])
            assert watchdog.fake_torch_watchdog_start() == 0
            time.sleep(1.0)  # the loop runs on until its next synchronisation
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        print("iteration", call_wrapper.iteration, "ran", flush=True)

    train()


def many_calls(calls: int) -> None:
    if not PLAN.get("real_in_use"):
        settings.nccl_in_use = lambda: (True, (2, 18, 3))

    @inprocess.Wrapper(**TIMEOUTS)
    def train(call_wrapper: inprocess.CallWrapper = None) -> int:
        state = call_wrapper.frozen_state
        dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                                world_size=state.active_world_size)
        try:
            if call_wrapper.iteration == 0:
                raise RuntimeError("a fault, to restart once")
            return call_wrapper.iteration
        finally:
            dist.destroy_process_group()

    for call in range(calls):
        print("call", call, "returned iteration", train(), flush=True)


if PLAN["case"] == "sticky":
    sticky()
else:
    many_calls(PLAN["calls"])
