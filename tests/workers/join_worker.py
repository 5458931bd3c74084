"""A rank of a small gloo DDP job for the join tests: SIGKILLed processes, respawned ones that join.

Configured by environment variables (the tests set them):
  INPROCESS_TEST_OUT      directory for this process's JSON result, seat<r>.life<k>.json
  INPROCESS_TEST_PLAN     JSON: {"steps": 60, "step_s": 0.02, "active": 4 (MaxActiveWorldSize; absent: all),
                          "kills": [{"seat": 1, "life": 0, "step": 10}, {"active_rank": 2, "step": 20,
                          "after_joiners": 1}, {"seat": 3, "life": 1, "step": "init"} (before its
                          process group), {"seat": 3, "life": 0, "steps_in": 5, "from_iteration": 2,
                          "at_world": 4} (the 5th step of an iteration >= 2 whose active world is 4)],
                          "end_after_joiners": 1, "until_world": 4,
                          "steps_at_full": 20 (with until_world: at least this many steps once the world
                          is that large again), "grow": {...} (GrowPolicy's keywords), "pg_timeout": 30,
                          "wrapper": {"soft_timeout": 20, ..., "heartbeat_interval": 1 (absent: the
                          Wrapper's default), ...},
                          "end_safe_points": 5 (safe points after the loop, before it returns),
                          "hold": {"step": 12, "file": "go"} (every rank waits there for OUT/go),
                          "kill_admitted": true: the first leader to admit a joiner SIGKILLs the
                          joiner's process before it moves the seat (kill_admitted_wait_s: 3),
                          "die_admitting": true: the first process of the job to write an admission
                          as a restart's leader SIGKILLs itself right after (before it moves the seat
                          and tells the joiner)}
  INPROCESS_RESPAWN_COUNT which life of its seat this process is (0: the job's first processes)

The state a process resumes from is what a user's code would load: a checkpoint
file that active rank 0 writes at every step (model, optimizer, step), read by
every active rank at the start of every iteration. A process that takes a seat
over (a spare or a joiner) thus starts from the same step as everyone.
"""

import datetime
import faulthandler
import io
import json
import logging
import os
import time

import torch
import torch._dynamo  # noqa: F401  (DDP imports it lazily: seconds, which a spare's first iteration must not pay)
import torch.distributed as dist

import inprocess

PLAN = json.loads(os.environ.get("INPROCESS_TEST_PLAN", "{}"))
OUT = os.environ["INPROCESS_TEST_OUT"]
SEAT = int(os.environ["RANK"])
LIFE = int(os.environ.get("INPROCESS_RESPAWN_COUNT", "0"))
CHECKPOINT = os.path.join(OUT, "checkpoint.pt")
logging.basicConfig(level=os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
                    format=f"%(relativeCreated)d s{SEAT}.{LIFE} %(threadName)s %(message)s")
if os.environ.get("INPROCESS_TEST_DUMP_AFTER"):
    faulthandler.dump_traceback_later(float(os.environ["INPROCESS_TEST_DUMP_AFTER"]), exit=False)

R = inprocess.rank_assignment
log = {"seat": SEAT, "life": LIFE, "pid": os.getpid(), "iterations": []}


def td(seconds):
    return datetime.timedelta(seconds=seconds)


def write_log():
    path = os.path.join(OUT, f"seat{SEAT}.life{LIFE}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(log, f)
    os.replace(path + ".tmp", path)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def load_checkpoint(model, opt):
    if not os.path.exists(CHECKPOINT):
        return 0
    saved = torch.load(CHECKPOINT)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return saved["step"]


def save_checkpoint(model, opt, step):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, CHECKPOINT + ".tmp")
    os.replace(CHECKPOINT + ".tmp", CHECKPOINT)


# What a process's first iteration would otherwise pay (lazy imports of the optimizer and of torch.save/load).
_model, _opt = model_and_optimizer()
_opt.step()
_buffer = io.BytesIO()
torch.save({"model": _model.state_dict(), "opt": _opt.state_dict()}, _buffer)
_buffer.seek(0)
torch.load(_buffer)


def die_while_admitting(enabled):
    """The first leader of the job to admit a joiner dies in the middle of the admission: its
    admission records are written (Pipe.compare_set_many's first call), its seats not yet moved,
    its joiners not told. Once in the whole job (a marker file): whichever rank leads then."""
    if not enabled:
        return
    from inprocess.control import joining

    original = joining.Pipe.compare_set_many

    def then_die(self, items):
        values = original(self, items)
        try:
            os.close(os.open(os.path.join(OUT, "died_admitting"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return values
        log["died_admitting"] = [key for key, _, _ in items]
        write_log()
        os.kill(os.getpid(), 9)
        return values

    joining.Pipe.compare_set_many = then_die


die_while_admitting(PLAN.get("die_admitting"))


def kill_the_admitted(enabled):
    """The first leader of the job to admit a joiner SIGKILLs the joiner's process (its monitor
    lives on) right after writing the admission and before it moves the seat, then waits until the
    joiner is dead and its monitor has had the time to count it out, and goes on. Once in the whole
    job (a marker file). The joiner's pid is in its token (control/joining.py: host-pid-hex)."""
    if not enabled:
        return
    import signal

    from inprocess.control import joining

    original = joining.Pipe.compare_set_many

    def then_kill(self, items):
        values = original(self, items)
        admitted = [key.rsplit("/", 1)[1] for (key, _, desired), value in zip(items, values, strict=True)
                    if desired.startswith("admitted/") and value.decode() == desired]
        if not admitted:
            return values
        try:
            os.close(os.open(os.path.join(OUT, "killed_admitted"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return values
        pids = [int(token.rsplit("-", 2)[1]) for token in admitted]
        log["killed_admitted"] = pids
        log["killed_admitted_t"] = time.time()
        write_log()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.02)
        time.sleep(PLAN.get("kill_admitted_wait_s", 3.0))  # its monitor's count-out runs meanwhile
        return values

    joining.Pipe.compare_set_many = then_kill


def _alive(pid):
    """Whether ``pid`` runs (a zombie, dead and not reaped by its parent yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


kill_the_admitted(PLAN.get("kill_admitted"))


def hold_here(step):
    """"hold": {"step": 12, "file": "go"}: every rank waits at that step until the test creates the
    file (OUT/go): the job stays at a known point while the test does its part."""
    hold = PLAN.get("hold")
    if hold is None or hold["step"] != step:
        return
    log["held_at"] = step  # this process waits at the hold (a test's cue)
    write_log()
    deadline = time.monotonic() + hold.get("timeout", 240)
    while not os.path.exists(os.path.join(OUT, hold["file"])) and time.monotonic() < deadline:
        inprocess.current_call().ping()
        time.sleep(0.05)


def kill_here(step, active_rank, start_step=0, iteration=0, world=0):
    """The kill of the plan due here, if any: by seat and life, or by active rank (whoever holds it
    at that step). Each fires once in the whole job (a marker file), also when a restart resumes
    the job at its step. A kill with "steps_in" fires at that many steps into an iteration (from
    "from_iteration" on, of active world "at_world" where given) instead of at a step."""
    for index, k in enumerate(PLAN.get("kills", [])):
        if "steps_in" in k:
            if (step == "init" or step - start_step != k["steps_in"] or iteration < k.get("from_iteration", 0)
                    or world != k.get("at_world", world)):
                continue
        elif k["step"] != step:
            continue
        if "active_rank" in k:
            if k["active_rank"] != active_rank:
                continue
        elif k["seat"] != SEAT or k.get("life", 0) != LIFE:
            continue
        try:
            os.close(os.open(os.path.join(OUT, f"kill{index}.fired"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return k
    return None


def wait_for_joiners(count, timeout=240.0):
    """Until ``count`` joiners announced themselves (a test's own look at the store, through
    the engine's internals): the kill that follows then finds them waiting."""
    from inprocess.control.joining import JoinKeys

    p = inprocess.current_call()._runtime.protocol
    keys = JoinKeys(p.counted, p.call, p.incarnation)
    deadline = time.monotonic() + timeout

    def waiting():
        return [a for _, a in keys.pending()[1] if keys.read_outcome(a.token) is None]

    while count and len(waiting()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
spec = PLAN.get("wrapper", {})
assignment = R.ShiftRanks()
if "active" in PLAN:
    assignment = inprocess.Compose(R.MaxActiveWorldSize(PLAN["active"]), R.ActivateAllRanks(), R.ShiftRanks())
grow = inprocess.GrowPolicy(**PLAN["grow"]) if "grow" in PLAN else None
wrapper = inprocess.Wrapper(
    grow=grow,
    rank_assignment=assignment,
    soft_timeout=td(spec.get("soft_timeout", 20)),
    hard_timeout=td(spec.get("hard_timeout", 40)),
    barrier_timeout=td(spec.get("barrier_timeout", 60)),
    completion_timeout=td(spec.get("completion_timeout", 60)),
    heartbeat_timeout=td(spec.get("heartbeat_timeout", 30)),
    **{name: td(spec[name]) for name in ("heartbeat_interval", "termination_grace_time") if name in spec},
    # "monitor_logs": each process's monitor logs at INFO level to OUT/monitor.seat<r>.life<k>.log.
    monitor_process_logfile=(os.path.join(OUT, f"monitor.seat{SEAT}.life{LIFE}.log") if PLAN.get("monitor_logs")
                             else None),
)


def restart_entry(r):
    return {"iteration": r.iteration, "terminated": r.terminated, "joined": r.joined, "activated": r.activated,
            "faults": [f"{f.rank}:{f.kind}:{f.type}:{f.message[:80]}" for f in r.faults],
            "causes": [f.kind for f in r.causes]}


@wrapper
def train(call_wrapper: inprocess.CallWrapper = None):
    state = call_wrapper.frozen_state
    model, opt = model_and_optimizer()
    step = start_step = load_checkpoint(model, opt)
    log["iterations"].append({"iteration": call_wrapper.iteration, "active_rank": state.active_rank,
                              "active_world_size": state.active_world_size, "world_size": state.world_size,
                              "start_step": step, "t": time.time()})
    write_log()
    kill = kill_here("init", state.active_rank)  # a kill with "step": "init" fires before the group exists
    if kill is not None:
        log["killed_at"] = "init"
        write_log()
        os.kill(os.getpid(), 9)
    dist.init_process_group("gloo", store=call_wrapper.store, rank=state.active_rank,
                            world_size=state.active_world_size, timeout=td(PLAN.get("pg_timeout", 30)))
    # Every rank must resume at the same step: the checkpoint is the one truth.
    steps = torch.tensor([step])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    assert int(steps) == step, f"seat {SEAT}: resumed at {step}, another rank at {int(steps)}"
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # "until_world": the loop goes on past "steps" while the world is smaller (a grow test's wait);
    # "steps_at_full": once it is that large, it trains at least so many steps more (the same end on
    # every rank: they all resumed at the same step).
    last_step = PLAN.get("steps", 60)
    if state.active_world_size >= PLAN.get("until_world", 0):
        last_step = max(last_step, step + PLAN.get("steps_at_full", 0))
    while step < last_step or state.active_world_size < PLAN.get("until_world", 0):
        call_wrapper.ping()
        hold_here(step)
        kill = kill_here(step, state.active_rank, start_step, call_wrapper.iteration, state.active_world_size)
        if kill is not None:
            wait_for_joiners(kill.get("after_joiners", 0))
            log["killed_at"] = step
            write_log()
            os.kill(os.getpid(), 9)
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True)).backward()
        opt.step()
        step += 1
        with call_wrapper.atomic():
            if state.active_rank == 0:
                save_checkpoint(model, opt, step)
        time.sleep(PLAN.get("step_s", 0.0))
    # A test that wants the last joiner waiting when the job ends (closed, not too late to be told).
    wait_for_joiners(PLAN.get("end_after_joiners", 0))
    # "end_safe_points": safe points after the loop, then the function returns: with a grow policy whose
    # check_every is this many, exactly one of them is a look, and the grow it schedules is never reached.
    for _ in range(PLAN.get("end_safe_points", 0)):
        call_wrapper.safe_point()
    dist.destroy_process_group()
    return {"step": step, "params": [p.detach().flatten().tolist() for p in model.parameters()],
            "active_world_size": state.active_world_size, "world_size": state.world_size,
            "iteration": call_wrapper.iteration,
            "restarts": [restart_entry(r) for r in call_wrapper.restarts]}


try:
    result = train()
    log["result"] = result
    log["outcome"] = "returned"
except BaseException as e:
    log["outcome"] = f"{type(e).__name__}: {e}"
    write_log()
    raise
write_log()
