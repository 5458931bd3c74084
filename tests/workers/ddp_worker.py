"""A rank of a small DDP job under inprocess.Wrapper, with faults from a plan.

Configured by environment variables (tests set them):
  INPROCESS_TEST_OUT    directory for this rank's JSON result
  INPROCESS_TEST_PLAN   JSON: {"steps": 40, "faults": [{"iteration": 0, "rank": 2,
                        "step": 5, "kind": "exception"}], "wrapper": {...}}
Fault kinds: exception, nccl_error (an exception worded as NCCL's), system_exit, keyboard_interrupt,
restart_abort, swallow_restart,
hang (sleep outside any collective: the peers block in theirs), and
delayed_exception (raise after "delay" seconds, so the peers are certainly
blocked in a collective waiting for a rank that hangs).
"no_ping": true: the loop never calls ping() (a function that reports no steps).
"wrapper": {"slow_initialize": {"rank": R, "from_iteration": I, "seconds": S}}: initial rank R sleeps S
seconds at the start of ``initialize`` from iteration I on (before a RetryController's check, if any):
a rank that comes late to its initialize. Every rank lists the iterations it entered initialize in.
Under torchrun a fault with "restart_count": N fires only in the launcher's
incarnation N (TORCHELASTIC_RESTART_COUNT); one without it fires in every one.
"""

import datetime
import faulthandler
import json
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import inprocess
from inprocess.engine import pg_tracker

PLAN = json.loads(os.environ.get("INPROCESS_TEST_PLAN", "{}"))
OUT = os.environ["INPROCESS_TEST_OUT"]
INITIAL_RANK = int(os.environ["RANK"])
# torchrun's incarnation of the workers (0 before its first restart; absent elsewhere).
RESTART_COUNT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d r{INITIAL_RANK} %(threadName)s %(message)s")
if os.environ.get("INPROCESS_TEST_DUMP_AFTER"):
    faulthandler.dump_traceback_later(float(os.environ["INPROCESS_TEST_DUMP_AFTER"]), exit=False)


def td(seconds):
    return datetime.timedelta(seconds=seconds)


def inject(kind):  # noqa: C901 - one branch per fault kind, read as a table
    log["injected"] = log.get("injected", 0) + 1
    log["fault_ns"] = time.monotonic_ns()
    if kind == "exception":
        raise RuntimeError(f"injected fault on initial rank {INITIAL_RANK}")
    if kind == "nccl_error":
        # Worded as torch's ProcessGroupNCCL words a failed collective: one message whatever the rank.
        raise RuntimeError("NCCL error in: /opt/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1968, "
                           "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5")
    if kind == "system_exit":
        sys.exit(3)
    if kind == "keyboard_interrupt":
        raise KeyboardInterrupt
    if kind == "restart_abort":
        raise inprocess.RestartAbort("injected")
    if kind == "hang":
        time.sleep(3600)
    if kind == "sigkill":
        os.kill(os.getpid(), 9)
    if kind == "sigstop":
        os.kill(os.getpid(), 19)  # SIGSTOP: frozen, neither dead nor progressing
    if kind == "os_exit":
        os._exit(1)
    if kind == "segfault":
        import ctypes

        ctypes.string_at(0)
    if kind == "gil_hang":
        # Native code that never releases the GIL: only the hard timeout can help.
        from inprocess import _native

        _native.testing.spin_holding_gil(3600)
    if kind == "livelock":
        # Keeps running Python (automatic progress goes on) but stops pinging.
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            pass
    if kind in ("kill_monitor", "stop_monitor"):
        # The rank's own monitor process (its child) is killed or frozen; the rank goes on.
        sig = 9 if kind == "kill_monitor" else 19
        for pid in os.listdir("/proc"):
            try:
                if not pid.isdigit():
                    continue
                parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                if parent != os.getpid():
                    continue
                if b"inprocess.processes.monitor" in open(f"/proc/{pid}/cmdline", "rb").read():
                    os.kill(int(pid), sig)
                    log["monitor_signalled"] = int(pid)
                    return
            except OSError:
                continue
        raise RuntimeError("no monitor process found among this rank's children")
    if kind == "kill_node_agent":
        # This node's agent process is SIGKILLed; the node's ranks go on without it.
        link = LAST_CALL["call"]._runtime.node_link
        if link is None:
            raise RuntimeError("kill_node_agent: this rank has no node agent")
        os.kill(link.board.agent_pid, 9)
        log["node_agent_killed"] = link.board.agent_pid
        return
    if kind == "swallow_restart":
        # A loop that swallows every exception, the restart's interruption included, and
        # pings (so no timeout takes it for a hang): only the release deadline ends it. Bounded: 60 s.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                LAST_CALL["call"].ping()
                time.sleep(0.05)
            except BaseException as e:
                log["swallowed"] = type(e).__name__
        return
    if kind.startswith("protected_sleep"):
        # Longer than both timeouts, but inside disable_hang_protection(): no restart.
        with LAST_CALL["call"].disable_hang_protection():
            time.sleep(float(kind.split(":")[1]))
        return
    if kind.startswith("delayed_exception"):
        time.sleep(float(kind.split(":")[1]))
        log["fault_ns"] = time.monotonic_ns()
        raise RuntimeError(f"delayed fault on initial rank {INITIAL_RANK}")
    raise ValueError(f"unknown fault kind {kind!r}")


def make_hooks(spec):
    """Hooks that raise on a chosen initial rank and iteration (the hook rule tests)."""
    hooks = {}
    target = spec.get("raise_in_hook")
    if not target:
        return hooks
    name, rank, iteration = target["hook"], target["rank"], target["iteration"]
    exc_kind = target.get("kind", "exception")

    def hook(state):
        hits = log.setdefault("hook_calls", {})
        hits[name] = hits.get(name, 0) + 1
        if (state.initial_rank == rank and state.iteration == iteration and hits[name] >= target.get("from_call", 1)
                and target.get("restart_count", RESTART_COUNT) == RESTART_COUNT):
            if exc_kind == "exception":
                raise RuntimeError(f"injected {name} failure")
            if exc_kind == "restart_abort":
                raise inprocess.RestartAbort(f"injected in {name}")
            if exc_kind == "context_lost":
                # The rank ends in os._exit(76): what the test reads is written now.
                with open(os.path.join(OUT, result_name()), "w") as f:
                    json.dump(log, f)
                raise inprocess.gpu.CudaContextLost(f"injected lost context in {name}", 700,
                                                    "CUDA_ERROR_ILLEGAL_ADDRESS")
            raise SystemExit(7)
        if name == "abort":
            inprocess.abort.AbortTorchDistributed()(state)
        return state

    hooks[name] = hook
    return hooks


class RaisingAssignment(inprocess.rank_assignment.JobAssignment):
    """A (job-wide) rank assignment that fails at one iteration (the hook rule test)."""

    def __init__(self, iteration):
        self.iteration = iteration

    def assign_job(self, ctx):
        if ctx.iteration == self.iteration:
            raise RuntimeError(f"injected rank assignment failure at iteration {ctx.iteration}")
        return ctx


def build_rank_assignment(spec):
    ra = spec.get("rank_assignment")
    R = inprocess.rank_assignment
    if ra is None:
        return None
    parts = []
    if "raise_at_iteration" in ra:
        parts.append(RaisingAssignment(ra["raise_at_iteration"]))
    if "max_active" in ra:
        parts.append(R.MaxActiveWorldSize(ra["max_active"]))
    parts += [R.ActivateAllRanks(), R.ShiftRanks()]
    return inprocess.Compose(*parts)


wrapper_spec = PLAN.get("wrapper", {})
kwargs = dict(
    barrier_timeout=td(wrapper_spec.get("barrier_timeout", 30)),
    completion_timeout=td(wrapper_spec.get("completion_timeout", 30)),
    soft_timeout=td(wrapper_spec.get("soft_timeout", 10)),
    hard_timeout=td(wrapper_spec.get("hard_timeout", 20)),
    progress_watchdog_interval=td(wrapper_spec.get("progress_watchdog_interval", 1)),
    monitor_thread_interval=td(wrapper_spec.get("progress_watchdog_interval", 1)),
)
kwargs.update(make_hooks(wrapper_spec))
if wrapper_spec.get("store_kwargs") is not None:
    kwargs["store_kwargs"] = wrapper_spec["store_kwargs"]
if wrapper_spec.get("node_agent") is not None:
    kwargs["node_agent"] = wrapper_spec["node_agent"]
for name in ("heartbeat_interval", "heartbeat_timeout"):
    if wrapper_spec.get(name) is not None:
        kwargs[name] = td(wrapper_spec[name])


class SlowInitialize(inprocess.initialize.Initialize):
    """Records the iteration, and sleeps first on the rank and iterations the plan names (slow_initialize)."""

    def __init__(self, spec):
        self.spec = spec or {}

    def __call__(self, state):
        log.setdefault("initialized", []).append(state.iteration)
        if state.initial_rank == self.spec.get("rank") and state.iteration >= self.spec.get("from_iteration", 0):
            time.sleep(self.spec["seconds"])
        return state


if wrapper_spec.get("max_iterations") is not None:
    kwargs["initialize"] = inprocess.Compose(
        inprocess.initialize.RetryController(max_iterations=wrapper_spec["max_iterations"]),
        SlowInitialize(wrapper_spec.get("slow_initialize")),
    )
if wrapper_spec.get("max_rank_faults") is not None:
    kwargs["health_check"] = inprocess.health_check.FaultCounter(wrapper_spec["max_rank_faults"])
ra = build_rank_assignment(wrapper_spec)
if ra is not None:
    kwargs["rank_assignment"] = ra

LAST_CALL = {}
log = {"initial_rank": INITIAL_RANK, "restart_count": RESTART_COUNT, "iterations": [], "fds": [], "threads": []}


def result_name():
    """rank<r>.json; under torchrun one file per incarnation of the workers: rank<r>.torchrun<N>.json."""
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return f"rank{INITIAL_RANK}.torchrun{RESTART_COUNT}.json"
    return f"rank{INITIAL_RANK}.json"

if PLAN.get("time_clones"):
    # Every new store connection the engine opens goes through inprocess.store.clone: time each one.
    _clone = inprocess.store.clone

    def _timed_clone(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return _clone(*args, **kwargs)
        finally:
            log.setdefault("clone_s", []).append(time.monotonic() - t0)

    inprocess.store.clone = _timed_clone


def count_fds():
    """This process's descriptors, less the store server's side of other
    ranks' connections: rank 0 hosts the server, and those sockets come and
    go with the other processes' connections, not with this process's state."""
    port = int(os.environ["MASTER_PORT"])
    served = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] != "0A":  # 0A: LISTEN, this process's own server
                served.add(fields[9])  # inode
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in served:
            continue
        count += 1
    return count


@inprocess.Wrapper(**kwargs)
def train(model_seed, call_wrapper: inprocess.CallWrapper = None):
    LAST_CALL["call"] = call_wrapper
    it = call_wrapper.iteration
    state = call_wrapper.frozen_state
    # The failed iteration's gloo connections are held open until the next process group is made
    # (engine.connection_release): "fds_pg", counted once it is made, is what must not grow.
    log.setdefault("held", []).append(pg_tracker.held_connections())
    log["fds"].append(count_fds())
    log["threads"].append(threading.active_count())
    log.setdefault("excepthooks", []).append(repr(sys.excepthook))
    entry = {
        "iteration": it,
        "rank": state.active_rank,
        "world_size": state.active_world_size,
        "env_rank": os.environ.get("RANK"),
        "env_world_size": os.environ.get("WORLD_SIZE"),
        "steps": 0,
        "started_ns": time.monotonic_ns(),
    }
    link = call_wrapper._runtime.node_link
    entry["node_agent"] = None if link is None else link.board.agent_pid
    # The last barrier at which the agent counted this rank (its arrival went through the board).
    entry["forwarded"] = None if link is None else link.board.forwarded(link.slot)
    log["iterations"].append(entry)
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=td(PLAN.get("pg_timeout", 10)))
    log.setdefault("fds_pg", []).append(count_fds())
    torch.manual_seed(model_seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234 + state.active_rank)
    loss = None
    for step in range(PLAN.get("steps", 20)):
        if not PLAN.get("no_ping"):
            call_wrapper.ping()
        for f in PLAN.get("faults", []):
            if (f["iteration"] == it and f["rank"] == INITIAL_RANK and f["step"] == step
                    and f.get("restart_count", RESTART_COUNT) == RESTART_COUNT):
                inject(f["kind"])
        if PLAN.get("step_sleep"):
            time.sleep(PLAN["step_sleep"])
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        try:
            loss.backward()
        except BaseException:
            entry["released_ns"] = time.monotonic_ns()
            raise
        opt.step()
        entry["steps"] = step + 1
    # Identical parameters on every rank prove the collectives really ran together.
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    dist.destroy_process_group()
    return {"loss": float(loss.detach()), "checksum": checksum, "iteration": it}


def main():
    result = None
    exc_name = None
    log["threads_before"] = threading.active_count()
    log["fds_before"] = count_fds()
    try:
        result = train(7)
    except BaseException as e:
        exc_name = type(e).__name__
        log["exception"] = exc_name
        log["message"] = str(e)
    log["result"] = result
    call = LAST_CALL.get("call")
    log["final_iteration"] = call.iteration if call is not None else None
    log["restarts"] = [
        {"iteration": r.iteration, "terminated": r.terminated, "n_faults": r.n_faults,
         "faults": [{"rank": f.rank, "type": f.type, "kind": f.kind} for f in r.faults],
         "duration_s": r.duration_s, "backoff_s": r.backoff_s, "repeats": r.repeats}
        for r in (call.restarts if call is not None else [])
    ]
    del call
    LAST_CALL.clear()  # the CallWrapper holds the store; let it go before counting
    log["final_fds"] = count_fds()
    log["final_threads"] = threading.active_count()
    with open(os.path.join(OUT, result_name()), "w") as f:
        json.dump(log, f)
    if exc_name is not None:
        sys.exit(17)


if __name__ == "__main__":
    main()
