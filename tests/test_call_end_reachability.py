"""However a wrapped call ends, the caller holding what it got (its return value, or its exception with
the traceback) reaches nothing of the wrapper: no torch store, no socket, no thread.

An exception's traceback holds the frames it passed through, and the library's frames hold the
rank's runtime (store clients, the trigger, the interrupter, ...): as long as the caller keeps the
exception, whatever those frames reach stays alive (an open connection to a store host that has
exited, a process group). Each case runs one rank (RANK=0, WORLD_SIZE=1) in a fresh interpreter: this
file is also the worker (``python test_call_end_reachability.py CASE``), which ends a wrapped call the
way CASE says, keeps the exception, collects garbage and reports, as one JSON line, what is left:

- ``stores``: every torch ``Store`` that ``gc.get_objects()`` finds (the user code here builds none of
  its own, so any one is the wrapper's);
- ``sockets``: socket descriptors opened since before the call and still open;
- ``threads``: Python threads started since before the call and still alive, and native threads (the
  watchdog's, torch's store and gloo threads) by their ``/proc/self/task`` names;
- and what the caller needs of the exception: its type, its chain, its traceback text.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import pathlib
import subprocess
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import inprocess
from inprocess.engine import sockets
from inprocess.engine.runtime import RankRuntime
from inprocess.launch import free_port

WORKER = pathlib.Path(__file__)

# case -> (exception type the caller gets, a text its traceback must show, the type it is raised from or during)
CASES: dict[str, tuple[str, str, str | None]] = {
    "return": ("", "", None),
    "failing_initialize": ("RestartAbort", "reached max_iterations=2", None),  # initialize failed twice
    "failing_abort": ("ZeroDivisionError", "raise ZeroDivisionError(\"abort\")", None),
    "failing_finalize": ("ZeroDivisionError", "raise ZeroDivisionError(\"finalize\")", None),
    "failing_health_check": ("HealthCheckError", "raise ZeroDivisionError(\"health check\")", "ZeroDivisionError"),
    "failing_rank_assignment": ("ZeroDivisionError", "raise ZeroDivisionError(\"rank assignment\")", None),
    "keyboard_interrupt": ("KeyboardInterrupt", "raise KeyboardInterrupt", None),
    "system_exit": ("SystemExit", "raise SystemExit(3)", None),
    "max_iterations": ("RestartAbort", "reached max_iterations=2", None),
    "two_calls": ("RestartAbort", "reached max_iterations=2", None),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_nothing_of_the_wrapper_is_reachable_from_what_the_caller_holds(case: str) -> None:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, str(WORKER), case], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    exc_type, shown, cause = CASES[case]
    calls = report["calls"]
    assert len(calls) == (2 if case == "two_calls" else 1), report
    for call in calls:
        if case == "return":
            assert call == {"returned": "done"}, report
            continue
        # The caller's exception is whole: its type, what it came from, where it was raised.
        assert call["type"] == exc_type, (call, done.stderr[-4000:])
        assert shown in call["traceback"], call["traceback"]
        assert "LeaveJob" not in call["traceback"], call["traceback"]  # the engine's own unwinding is not shown
        if cause is not None:
            assert call["chain"][1:2] == [cause], call
        if case not in ("failing_initialize", "max_iterations", "two_calls"):
            # Raised in the user's own code: its frame (the function or the hook) is in the traceback.
            assert "test_call_end_reachability.py" in call["traceback"], call["traceback"]
    assert report["stores"] == [], report
    assert report["sockets"] == [], report
    assert report["threads"] == [], report
    assert report["native_threads"] == [], report
    assert report["runtimes"] == 0, report
    assert report["open_call_wrappers"] == 0, report


# -- the worker -------------------------------------------------------------------------------------

_case = ""  # the worker's CASE (argv[1])


class FailingInitialize(inprocess.initialize.Initialize):
    def __call__(self, state: Any) -> Any:
        if _case == "failing_initialize":
            raise ZeroDivisionError("initialize")
        return state


class FailingAbort(inprocess.abort.Abort):
    def __call__(self, state: Any) -> Any:
        if _case == "failing_abort":
            raise ZeroDivisionError("abort")
        return state


class FailingFinalize(inprocess.finalize.Finalize):
    def __call__(self, state: Any) -> Any:
        if _case == "failing_finalize":
            raise ZeroDivisionError("finalize")
        return state


class FailingHealthCheck(inprocess.health_check.HealthCheck):
    def __call__(self, state: Any) -> Any:
        # During the restart only (it also runs before every iteration).
        if _case == "failing_health_check" and state.iteration == 0 and state.fn_exception is not None:
            raise ZeroDivisionError("health check")
        return state


class FailingRankAssignment(inprocess.rank_assignment.RankAssignment):
    def __call__(self, ctx: Any) -> Any:
        if _case == "failing_rank_assignment" and ctx.state.iteration > 0:
            raise ZeroDivisionError("rank assignment")
        return ctx


def train(model: torch.nn.Module, call_wrapper: inprocess.CallWrapper | None = None) -> str:
    assert call_wrapper is not None
    dist.init_process_group("gloo", store=call_wrapper.store, rank=0, world_size=1)
    group = dist.new_group([0])  # a second group: what the frames held must release it too
    grad = model(torch.ones(4)).sum()
    dist.all_reduce(grad.detach(), group=group)
    if _case == "return":
        dist.destroy_process_group()
        return "done"
    if _case == "keyboard_interrupt":
        raise KeyboardInterrupt
    if _case == "system_exit":
        raise SystemExit(3)
    raise RuntimeError(f"fault in iteration {call_wrapper.iteration}")


def wrapped_train() -> Callable[..., str]:
    seconds = datetime.timedelta
    wrapped: Callable[..., str] = inprocess.Wrapper(
        initialize=inprocess.Compose(FailingInitialize(), inprocess.initialize.RetryController(max_iterations=2)),
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), FailingAbort()),
        finalize=FailingFinalize(),
        health_check=FailingHealthCheck(),
        rank_assignment=inprocess.Compose(FailingRankAssignment(), inprocess.rank_assignment.ActivateAllRanks(),
                                          inprocess.rank_assignment.ShiftRanks()),
        soft_timeout=seconds(seconds=10),
        hard_timeout=seconds(seconds=20),
        barrier_timeout=seconds(seconds=30),
        completion_timeout=seconds(seconds=30),
    )(train)
    return wrapped


def native_threads() -> dict[str, str]:
    """This process's threads (native ones included): task id -> name."""
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[tid] = f.read().strip()
        except OSError:
            pass
    return names


def describe(e: BaseException) -> dict[str, Any]:
    """What the caller sees of the exception it holds."""
    chain: list[str] = []
    c: BaseException | None = e
    while c is not None:
        chain.append(type(c).__name__)
        c = c.__cause__ or c.__context__
    return {"type": type(e).__name__, "chain": chain, "traceback": "".join(traceback.format_exception(e))}


def reachable() -> dict[str, Any]:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on every object touches torch's deprecated aliases
        objects = gc.get_objects()
        found = {
            "stores": sorted(type(o).__qualname__ for o in objects if isinstance(o, dist.Store)),
            "runtimes": sum(isinstance(o, RankRuntime) for o in objects),
            # A CallWrapper may stay reachable (the caller's frames in the traceback hold it): with nothing open.
            "open_call_wrappers": sum(isinstance(o, inprocess.CallWrapper) and o._recovery is not None
                                      for o in objects),
        }
    del objects
    return found


def run_worker(case: str) -> None:
    global _case
    _case = case
    train_fn = wrapped_train()
    model = torch.nn.Linear(4, 4)
    gc.collect()
    threads_before = {t.ident for t in threading.enumerate()}
    native_before = set(native_threads())
    sockets_before = sockets.socket_fds()
    held: list[BaseException] = []
    calls: list[dict[str, Any]] = []
    for _ in range(2 if case == "two_calls" else 1):
        try:
            calls.append({"returned": train_fn(model)})
        except BaseException as e:  # kept, as a caller that logs or re-raises it later does
            held.append(e)
    calls.extend(describe(e) for e in held)
    report = reachable()
    report.update(
        calls=calls,
        threads=sorted(t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()),
        native_threads=sorted(n for tid, n in native_threads().items() if tid not in native_before),
        sockets=sorted(sockets.new_since(sockets_before).values()),
    )
    print(json.dumps(report))


if __name__ == "__main__":
    run_worker(sys.argv[1])
