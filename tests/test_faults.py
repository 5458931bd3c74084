"""inprocess.faults and inprocess.tools.inject_fault: the plan language, determinism from the
seed, every fault kind in a real child process (exit status, signal, hang with or without the
GIL), the timer and its cleanup, NVRx's API, and a 4-rank job rehearsing a fault from
INPROCESS_FAULTS alone."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inprocess.faults as faults
from inprocess.faults import FaultPlan, FaultSpec, FaultUnavailable, InjectedException, Kind, Ranks, arming
from inprocess.state import FrozenState, Mode
from inprocess.tools import inject_fault as nvrx_api

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def fresh_fault_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no plan in the environment and no fault fired in this process."""
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    monkeypatch.setattr(arming, "_fired", {})
    monkeypatch.setattr(arming, "_current", None)
    yield


def state(rank: int = 0, world_size: int = 4, iteration: int = 0, mode: Mode = Mode.ACTIVE) -> FrozenState:
    return FrozenState(initial_rank=rank, initial_world_size=world_size, rank=rank, world_size=world_size,
                       active_rank=rank, active_world_size=world_size, iteration=iteration, mode=mode)


# -- the plan language -------------------------------------------------------

ROUND_TRIPS = [
    ("sigkill@rank=2,step=30", "sigkill@rank=2,step=30"),
    ("sigkill@rank=2,step=30;exception@rank=1,after=5s,iteration=1",
     "sigkill@rank=2,step=30;exception@rank=1,after=5s,iteration=1"),
    (" SIGTERM @ rank = 3|1 , step = 7 ", "sigterm@rank=1|3,step=7"),
    ("seed=42;hang@rank=random,after=1.5s..2m,iteration=*,for=500ms",
     "seed=42;hang@rank=random,after=1500ms..120s,iteration=*,for=500ms"),
    ("gil_hang@rank=random:3,step=10..20,iteration=0|2", "gil_hang@rank=random:3,step=10..20,iteration=0|2"),
    ("os_exit@rank=*,step=0,code=0", "os_exit@rank=*,step=0,code=0"),
    ("abort@rank=0,after=0ms;segfault@rank=1,after=1h", "abort@rank=0,after=0s;segfault@rank=1,after=3600s"),
    ("sigint@rank=0,step=1;sigstop@rank=1,step=2;seed=0", "sigint@rank=0,step=1;sigstop@rank=1,step=2"),
    ("gpu_error@rank=0,step=3;gpu_sleep@rank=1,after=2s,for=10s",
     "gpu_error@rank=0,step=3;gpu_sleep@rank=1,after=2s,for=10s"),
    ("sigkill@rank=*,phase=Reassignment;hang@rank=1,phase=finalize,iteration=2,for=1s",
     "sigkill@rank=*,phase=reassignment;hang@rank=1,phase=finalize,iteration=2,for=1s"),
]


@pytest.mark.parametrize("text, canonical", ROUND_TRIPS)
def test_plans_print_canonically_and_parse_back_equal(text: str, canonical: str) -> None:
    plan = FaultPlan.parse(text)
    assert str(plan) == canonical
    assert FaultPlan.parse(canonical) == plan


def test_a_plan_holds_what_it_says() -> None:
    plan = FaultPlan.parse("seed=9;exception@rank=1|3,after=250ms..1s,iteration=*;os_exit@rank=2,step=4,code=5")
    assert plan.seed == 9
    first, second = plan.faults
    assert first == FaultSpec(Kind.EXCEPTION, Ranks(listed=(1, 3)), after_ms=(250, 1000), iterations=None)
    assert second == FaultSpec(Kind.OS_EXIT, Ranks(listed=(2,)), step=(4, 4), iterations=(0,), code=5)


# (plan text, a piece of it the error must quote)
MALFORMED = [
    (";", "empty entry"),
    ("sigkill@rank=1,step=1;", "entry 2"),
    ("sigkill@rank=1,step=1;;abort@rank=0,step=0", "entry 2"),
    ("seed=3", "at least one fault"),
    ("seed=1;seed=2;abort@rank=0,step=0", "'seed=2'"),
    ("seed=-1;abort@rank=0,step=0", "'-1'"),
    ("seed=x;abort@rank=0,step=0", "'x'"),
    ("kill@rank=1,step=1", "'kill'"),
    ("@rank=1,step=1", "unknown fault kind"),
    ("sigkill", "'sigkill'"),
    ("sigkill@", "nothing after '@'"),
    ("sigkill@step=3", "rank=... is missing"),
    ("sigkill@rank=1", "exactly one of step"),
    ("sigkill@rank=1,step=3,after=1s", "exactly one of step"),
    ("sigkill@rank=1,,step=3", "empty field"),
    ("sigkill@rank=1,step=3,", "empty field"),
    ("sigkill@rank,step=3", "'rank'"),
    ("sigkill@rank=,step=3", "'rank='"),
    ("sigkill@rank=1,step=3,colour=red", "'colour=red'"),
    ("sigkill@rank=1,step=3,step=4", "'step=4'"),
    ("sigkill@rank=1,step=3,RANK=2", "'RANK=2'"),
    ("sigkill@rank=-1,step=3", "'-1'"),
    ("sigkill@rank=1.5,step=3", "'1.5'"),
    ("sigkill@rank=1|1,step=3", "'1|1'"),
    ("sigkill@rank=1|,step=3", "'1|'"),
    ("sigkill@rank=٣,step=3", "'٣'"),
    ("sigkill@rank=+1,step=3", "'+1'"),
    ("sigkill@rank=1_0,step=3", "'1_0'"),
    ("sigkill@rank=99999999999,step=3", "'99999999999'"),
    ("sigkill@rank=random:0,step=3", "'random:0'"),
    ("sigkill@rank=random:x,step=3", "'x'"),
    ("sigkill@rank=randomly,step=3", "'randomly'"),
    ("sigkill@rank=1,step=x", "'x'"),
    ("sigkill@rank=1,step=5..3", "'5..3'"),
    ("sigkill@rank=1,step=3..", "'3..'"),
    ("sigkill@rank=1,step=1..2..3", "'2..3'"),
    ("sigkill@rank=1,step=1e3", "'1e3'"),
    ("sigkill@rank=1,after=5", "'5'"),
    ("sigkill@rank=1,after=5sec", "'5sec'"),
    ("sigkill@rank=1,after=-5s", "'-5s'"),
    ("sigkill@rank=1,after=1.0001s", "'1.0001s'"),
    ("sigkill@rank=1,after=0.5ms", "'0.5ms'"),
    ("sigkill@rank=1,after=5s..1s", "'5s..1s'"),
    ("sigkill@rank=1,after=10000000000s", "'10000000000s'"),
    ("sigkill@rank=1,after=nan", "'nan'"),
    ("sigkill@rank=1,after=infs", "'infs'"),
    ("sigkill@rank=1,step=1,iteration=", "'iteration='"),
    ("sigkill@rank=1,step=1,iteration=x", "'x'"),
    ("sigkill@rank=1,step=1,iteration=2|2", "'2|2'"),
    ("sigkill@rank=1,step=1,iteration=**", "'**'"),
    ("sigkill@rank=1,step=1,code=3", "only os_exit takes an exit code"),
    ("os_exit@rank=1,step=1,code=256", "'256'"),
    ("os_exit@rank=1,step=1,code=-1", "'-1'"),
    ("sigkill@rank=1,step=1,for=1s", "only gil_hang, gpu_sleep, hang take a duration"),
    ("hang@rank=1,step=1,for=0s", "'0s'"),
    ("hang@rank=1,step=1,for=forever", "'forever'"),
    ("sigkill@rank=1@2,step=1", "'1@2'"),
    ("sigkill@rank=1;step=1", "entry 1 'sigkill@rank=1'"),
    ("sigkill@rank=1 step=1", "'1 step=1'"),
    ("sigkill@rank=1,step=1\x00", "'1\\x00'"),
    ("sigkill@rank=1,phase=lunch", "'lunch'"),
    ("sigkill@rank=1,phase=", "'phase='"),
    ("sigkill@rank=1,phase=abort,step=2", "exactly one of step"),
    ("sigkill@rank=1,phase=abort,phase=finalize", "'phase=finalize'"),
]


@pytest.mark.parametrize("text, quoted", MALFORMED)
def test_malformed_plans_are_rejected_naming_the_bad_part(text: str, quoted: str) -> None:
    with pytest.raises(ValueError) as info:
        FaultPlan.parse(text)
    message = str(info.value)
    assert message.startswith("INPROCESS_FAULTS"), message
    assert quoted in message, message


def test_the_environment_variable_blank_or_unset_means_no_plan() -> None:
    assert faults.plan_from_environment({}) is None
    assert faults.plan_from_environment({faults.ENV_VAR: "  "}) is None
    with pytest.raises(ValueError, match="'bogus'"):
        faults.plan_from_environment({faults.ENV_VAR: "bogus@rank=1,step=1"})


@pytest.mark.parametrize("build, problem", [
    (lambda: FaultSpec(Kind.SIGKILL, Ranks(listed=(1,))), "exactly one of step"),
    (lambda: FaultSpec("sigkill", Ranks(listed=(1,)), step=(1, 1)), "expected an inprocess.faults.Kind"),
    (lambda: FaultSpec(Kind.SIGKILL, Ranks(listed=(1,)), step=(3, 1)), "start is after its end"),
    (lambda: FaultSpec(Kind.SIGKILL, Ranks(listed=(1,)), step=(1, 1), iterations=()), "distinct iterations"),
    (lambda: FaultSpec(Kind.HANG, Ranks(listed=(1,)), step=(1, 1), for_ms=0), "for=0"),
    (lambda: FaultSpec(Kind.OS_EXIT, Ranks(listed=(1,)), step=(1, 1), code=True), "code=True"),
    (lambda: FaultSpec(Kind.SIGKILL, Ranks(listed=(1,)), phase="lunch"), "phase='lunch'"),
    (lambda: Ranks(), "exactly one of"),
    (lambda: Ranks(listed=(2, 1)), "increasing order"),
    (lambda: Ranks(listed=(1,), every=True), "exactly one of"),
    (lambda: FaultPlan(()), "non-empty tuple"),
    (lambda: FaultPlan((FaultSpec(Kind.ABORT, Ranks(every=True), step=(0, 0)),), seed=-1), "seed=-1"),
])
def test_plan_objects_check_their_fields(build: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        build()


# Plans built from parts: what prints must parse back equal.
_durations = st.integers(0, 10**10)
_steps = st.integers(0, 10**15)
_specs = st.builds(
    lambda kind, ranks, when, iterations, extra: FaultSpec(
        kind, ranks, step=when[1] if when[0] == "step" else None,
        after_ms=when[1] if when[0] == "after" else None, phase=when[1] if when[0] == "phase" else None,
        iterations=iterations,
        code=extra if kind is Kind.OS_EXIT else None,
        for_ms=(extra + 1) if kind in (Kind.HANG, Kind.GIL_HANG, Kind.GPU_SLEEP) and extra % 2 else None),
    st.sampled_from(list(Kind)),
    st.one_of(
        st.builds(lambda rs: Ranks(listed=tuple(sorted(rs))), st.sets(st.integers(0, 4096), min_size=1, max_size=4)),
        st.just(Ranks(every=True)),
        st.builds(lambda k: Ranks(random=k), st.integers(1, 64)),
    ),
    st.one_of(
        st.tuples(st.just("phase"), st.sampled_from(sorted(faults.PHASES))),
        st.tuples(st.just("step"), st.tuples(_steps, _steps).map(lambda p: tuple(sorted(p)))),
        st.tuples(st.just("after"), st.tuples(_durations, _durations).map(lambda p: tuple(sorted(p)))),
    ),
    st.one_of(st.none(), st.sets(st.integers(0, 100), min_size=1, max_size=3).map(lambda s: tuple(sorted(s)))),
    st.integers(0, 255),
)
_plans = st.builds(lambda specs, seed: FaultPlan(tuple(specs), seed), st.lists(_specs, min_size=1, max_size=4),
                   st.integers(0, 2**64 - 1))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans)
def test_any_plan_prints_and_parses_back_equal(plan: FaultPlan) -> None:
    assert FaultPlan.parse(str(plan)) == plan


_TOKENS = ["sigkill", "exception", "hang", "gil_hang", "os_exit", "seed", "rank", "step", "after", "iteration",
           "code", "for", "phase", "abort", "barrier", "random", "random:", "@", "=", ",", ";", "|", "..", "*", "0",
           "1", "7", "99", "1.5", "s", "ms", "m", "h", " ", "-", "+", ".", ":", "\x00", "é", "٣", "e3"]


def _parses_or_rejects_clearly(text: str) -> None:
    try:
        plan = FaultPlan.parse(text)
    except ValueError as e:
        assert str(e).startswith("INPROCESS_FAULTS"), e
        return
    assert FaultPlan.parse(str(plan)) == plan  # what was accepted means what it prints


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_TOKENS), max_size=30).map("".join))
def test_grammar_shaped_noise_is_parsed_or_rejected_with_a_value_error(text: str) -> None:
    _parses_or_rejects_clearly(text)


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_is_parsed_or_rejected_with_a_value_error(text: str) -> None:
    _parses_or_rejects_clearly(text)


def test_a_huge_plan_is_rejected_quickly() -> None:
    start = time.monotonic()
    with pytest.raises(ValueError):
        FaultPlan.parse("sigkill@rank=" + "1|" * 200_000 + ",step=1")
    with pytest.raises(ValueError):
        FaultPlan.parse("sigkill@rank=1,after=" + "9" * 100_000 + "s")
    assert time.monotonic() - start < 5


# -- determinism -------------------------------------------------------------

RANDOM_PLAN = "seed=1234;sigkill@rank=random:2,step=10..50;exception@rank=random,after=1s..9s,iteration=*"


def _schedules(plan: FaultPlan, world_size: int, iterations: int) -> list[list[tuple[int, int, Any, Any]]]:
    return [[(f.index, f.iteration, f.step, f.delay_s)
             for it in range(iterations) for f in plan.schedule(r, world_size, it)]
            for r in range(world_size)]


def test_every_process_draws_the_same_faults_from_the_seed() -> None:
    plan = FaultPlan.parse(RANDOM_PLAN)
    here = _schedules(plan, 8, 3)
    code = textwrap.dedent(f"""
        import json
        from inprocess.faults import FaultPlan
        plan = FaultPlan.parse({RANDOM_PLAN!r})
        print(json.dumps([[(f.index, f.iteration, f.step, f.delay_s) for it in range(3)
                           for f in plan.schedule(r, 8, it)] for r in range(8)]))
    """)
    for hash_seed in ("0", "4242"):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=hash_seed),
                             capture_output=True, text=True, timeout=30, check=True).stdout
        assert json.loads(out) == [[list(t) for t in r] for r in here]


def test_random_choices_are_consistent_across_ranks_and_change_with_the_seed() -> None:
    outcomes = set()
    for seed in range(20):
        plan = FaultPlan.parse(f"seed={seed};sigkill@rank=random:2,step=10..50")
        hit = {r: plan.schedule(r, 8, 0) for r in range(8)}
        chosen = sorted(r for r, due in hit.items() if due)
        assert len(chosen) == 2  # every rank computed the same two
        steps = {due[0].step for due in hit.values() if due}
        assert len(steps) == 1 and 10 <= steps.pop() <= 50
        outcomes.add((tuple(chosen), hit[chosen[0]][0].step))
        assert _schedules(plan, 8, 1) == _schedules(FaultPlan.parse(str(plan)), 8, 1)
    assert len(outcomes) >= 10  # the seed matters


def test_iterations_select_when_a_fault_is_due() -> None:
    plan = FaultPlan.parse(
        "exception@rank=1,step=3;sigkill@rank=1,step=4,iteration=*;abort@rank=1,step=5,iteration=2|4")
    due = {it: [f.spec.kind for f in plan.schedule(1, 2, it)] for it in range(5)}
    assert due == {0: [Kind.EXCEPTION, Kind.SIGKILL], 1: [Kind.SIGKILL], 2: [Kind.SIGKILL, Kind.ABORT],
                   3: [Kind.SIGKILL], 4: [Kind.SIGKILL, Kind.ABORT]}
    assert plan.schedule(0, 2, 0) == []


def test_ranks_outside_the_job_are_named() -> None:
    with pytest.raises(ValueError, match=r"rank=5: the job has WORLD_SIZE=4"):
        FaultPlan.parse("sigkill@rank=5,step=1").schedule(0, 4, 0)
    with pytest.raises(ValueError, match=r"random:5: the job has only WORLD_SIZE=4"):
        FaultPlan.parse("sigkill@rank=random:5,step=1").schedule(0, 4, 0)
    with pytest.raises(ValueError, match="rank=4"):
        faults.arm(FaultPlan.parse("sigkill@rank=1,step=1"), 4, 4, 0)


# -- every kind, in a child process --------------------------------------------

STEP_CHILD = """
import sys, inprocess.faults as faults
for step in range(6):
    print("step", step, flush=True)
    faults.maybe_inject(step)
print("done", flush=True)
"""


def run_child(code: str, plan: str, rank: int = 2, timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = dict(os.environ, INPROCESS_FAULTS=plan, RANK=str(rank), WORLD_SIZE="4")
    child_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("spec, returncode, in_stderr", [
    ("exception", 1, "inprocess.faults.actions.InjectedException: injected fault: exception on initial rank 2"),
    ("sigkill", -signal.SIGKILL, "injected fault: sigkill"),
    ("sigterm", -signal.SIGTERM, "injected fault: sigterm"),
    ("sigint", -signal.SIGINT, "KeyboardInterrupt"),  # Python dies of SIGINT after an uncaught KeyboardInterrupt
    ("os_exit", 1, "injected fault: os_exit"),
    ("os_exit@code=7", 7, "injected fault: os_exit"),
    ("abort", -signal.SIGABRT, "injected fault: abort"),
    ("segfault", -signal.SIGSEGV, "injected fault: segfault"),
])
def test_a_step_fault_does_what_its_kind_says_at_that_step(spec: str, returncode: int, in_stderr: str) -> None:
    kind, _, extra = spec.partition("@")
    plan = f"{kind}@rank=2,step=3" + (f",{extra}" if extra else "")
    res = run_child(STEP_CHILD, plan)
    assert res.returncode == returncode, res.stderr
    assert res.stdout.split("\n")[-2] == "step 3", res.stdout  # not before, not after
    assert in_stderr in res.stderr, res.stderr
    # The other ranks run the same code to the end.
    other = run_child(STEP_CHILD, plan, rank=1)
    assert other.returncode == 0 and other.stdout.endswith("done\n"), other.stderr


def test_sigstop_stops_the_rank_until_it_is_continued() -> None:
    child = subprocess.Popen([sys.executable, "-c", STEP_CHILD], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, INPROCESS_FAULTS="sigstop@rank=0,step=2", RANK="0", WORLD_SIZE="1"))
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 0 and out.endswith("step 5\ndone\n"), out
    finally:
        child.kill()
        child.wait()


# Counts ticks of a thread that needs the GIL for each one, around a bounded hang.
TICKER_CHILD = """
import json, threading, time, inprocess.faults as faults
ticks = 0
def tick():
    global ticks
    while True:
        ticks += 1
        time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.1)
before, start = ticks, time.monotonic()
faults.maybe_inject(0)
print(json.dumps({"ticks": ticks - before, "elapsed": time.monotonic() - start}))
"""


def test_a_hang_releases_the_gil_and_lasts_its_duration() -> None:
    res = run_child(TICKER_CHILD, "hang@rank=0,step=0,for=1500ms", rank=0)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen["elapsed"] >= 1.5
    assert seen["ticks"] >= 20, seen  # about 150 unless the machine is very busy


def test_a_gil_hang_holds_the_gil_for_its_duration() -> None:
    res = run_child(TICKER_CHILD, "gil_hang@rank=0,step=0,for=1500ms", rank=0)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen["elapsed"] >= 1.5
    # Released, the GIL would let the other thread tick ~150 times; held, it ticks only at the edges
    # (between reading `before` and the call taking the GIL, and as the GIL comes back), once each.
    assert seen["ticks"] <= 2, seen


# Two counters in a file, bumped by the main thread and by a second thread; for a parent to watch.
WATCHED_CHILD = """
import os, sys, threading, time, inprocess.faults as faults
from inprocess.state import FrozenState, Mode
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
counts = [0, 0]
def bump(slot):
    counts[slot] += 1
    os.pwrite(fd, b"%12d%12d" % tuple(counts), 0)
def background():
    while True:
        bump(1)
        time.sleep(0.01)
threading.Thread(target=background, daemon=True).start()
state = FrozenState(0, 1, 0, 1, 0, 1, 0, Mode.ACTIVE)
print("ready", flush=True)
with faults.arm_from_environment(state):
    step = 0
    while True:
        bump(0)
        faults.maybe_inject(step)
        step += 1
        time.sleep(0.01)
"""


def _watch(tmp_path: pathlib.Path, plan: str) -> tuple[int, int, subprocess.Popen[str]]:
    """Starts WATCHED_CHILD, waits for the fault, returns how far each counter moved in the next second."""
    counters = tmp_path / "counters"
    child = subprocess.Popen([sys.executable, "-c", WATCHED_CHILD, str(counters)], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, INPROCESS_FAULTS=plan, RANK="0", WORLD_SIZE="1"))
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    time.sleep(1.0)  # the fault is due 0.3 s after arming, or at step 5

    def read() -> tuple[int, int]:
        raw = counters.read_bytes()
        return int(raw[:12]), int(raw[12:24])

    main0, background0 = read()
    time.sleep(1.0)
    main1, background1 = read()
    assert child.poll() is None, "the hung child exited"
    return main1 - main0, background1 - background0, child


@pytest.mark.parametrize("plan, gil_free", [
    ("hang@rank=0,step=5", True),
    ("hang@rank=0,after=300ms", True),
    ("gil_hang@rank=0,step=5", False),
    ("gil_hang@rank=0,after=300ms", False),
])
def test_a_hang_without_duration_lasts_until_the_rank_is_killed(tmp_path: pathlib.Path, plan: str,
                                                                gil_free: bool) -> None:
    child: subprocess.Popen[str] | None = None
    try:
        main_moved, background_moved, child = _watch(tmp_path, plan)
        assert main_moved <= 1, "the main thread still runs"
        if gil_free:
            assert background_moved >= 20, "the other thread should run on while the GIL is free"
        else:
            assert background_moved <= 1, "the other thread ran: the GIL was not held"
        # Signals without a Python handler keep their default action.
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        if child is not None:
            child.kill()
            child.wait()


TIMED_CHILD = """
import json, sys, time, inprocess.faults as faults
from inprocess.state import FrozenState, Mode
state = FrozenState(2, 4, 2, 4, 2, 4, 0, Mode.ACTIVE)
start = time.monotonic()
try:
    with faults.arm_from_environment(state):
        time.sleep(30)
except faults.InjectedException as e:
    print(json.dumps({"after": time.monotonic() - start, "message": str(e)}))
"""


def test_a_timed_exception_interrupts_a_sleeping_main_thread() -> None:
    res = run_child(TIMED_CHILD, "exception@rank=2,after=300ms")
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert 0.3 <= seen["after"] < 5, seen
    assert seen["message"] == "injected fault: exception on initial rank 2, iteration 0, 0.3s after arming"


@pytest.mark.parametrize("plan, returncode", [
    ("sigkill@rank=2,after=300ms", -signal.SIGKILL),
    ("os_exit@rank=2,after=300ms,code=9", 9),
    ("segfault@rank=2,after=300ms", -signal.SIGSEGV),
])
def test_a_timed_fault_acts_on_the_whole_process(plan: str, returncode: int) -> None:
    start = time.monotonic()
    res = run_child(TIMED_CHILD, plan)
    assert res.returncode == returncode, res.stderr
    assert time.monotonic() - start < 20  # long before the child's 30 s sleep ends


def test_a_plan_for_other_ranks_leaves_this_one_alone() -> None:
    # A second is ten times the faults' delay: whatever was due for rank 2 would have fired by then.
    child = TIMED_CHILD.replace("time.sleep(30)", "time.sleep(1.0)") + "\nprint('survived')"
    res = run_child(child, "sigkill@rank=1,after=100ms;exception@rank=3,after=100ms", timeout=60)
    assert res.returncode == 0 and "survived" in res.stdout, res.stderr


# -- the timer in this process: delivery and cleanup -------------------------------


def test_a_timed_exception_reaches_the_main_thread_and_the_timer_leaves_nothing() -> None:
    threads = threading.active_count()
    handler = signal.getsignal(faults.DELIVERY_SIGNAL)
    plan = FaultPlan.parse("exception@rank=0,after=100ms")
    start = time.monotonic()
    with pytest.raises(InjectedException, match="rank 0"):
        with faults.arm(plan, 0, 1, 0):
            time.sleep(20)
    assert time.monotonic() - start < 5
    assert threading.active_count() == threads
    assert signal.getsignal(faults.DELIVERY_SIGNAL) == handler


def test_disarming_before_a_fault_is_due_cancels_it() -> None:
    threads = threading.active_count()
    handler = signal.getsignal(faults.DELIVERY_SIGNAL)
    plan = FaultPlan.parse("exception@rank=0,after=300ms;sigkill@rank=0,after=400ms")
    with faults.arm(plan, 0, 1, 0) as armed:
        assert threading.active_count() == threads + 1  # the timer
        assert len(armed.scheduled) == 2
        time.sleep(0.05)
    time.sleep(0.6)  # past both: had either fired, this test would have died or raised
    assert threading.active_count() == threads
    assert signal.getsignal(faults.DELIVERY_SIGNAL) == handler


def test_a_fault_fires_once_per_entry_and_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV_VAR, "exception@rank=0,step=2,iteration=*")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    faults.maybe_inject(1)
    with pytest.raises(InjectedException):
        faults.maybe_inject(2)
    faults.maybe_inject(2)  # fired already in iteration 0
    with faults.arm_from_environment(state(rank=0, world_size=2, iteration=1)):
        with pytest.raises(InjectedException, match="iteration 1"):
            faults.maybe_inject(2)
        faults.maybe_inject(2)


def test_maybe_inject_is_inert_without_a_plan_and_checks_the_step() -> None:
    faults.maybe_inject(0)
    with faults.arm_from_environment(state()) as armed:
        assert armed.scheduled == []
        faults.maybe_inject(3)
    with pytest.raises(ValueError, match="step=-1"):
        faults.maybe_inject(-1)
    with pytest.raises(ValueError, match="step='3'"):
        faults.maybe_inject("3")


class _CallWrapperStandIn:
    """What maybe_inject reads of a CallWrapper: its frozen state and iteration."""

    def __init__(self, frozen: FrozenState):
        self.frozen_state = frozen
        self.iteration = frozen.iteration


def test_without_an_arming_the_call_wrappers_rank_and_iteration_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV_VAR, "exception@rank=1,step=3,iteration=1")
    monkeypatch.setenv("RANK", "0")  # what the launcher said; the wrapper's state wins
    for frozen in (state(rank=0, iteration=1), state(rank=1, iteration=0),
                   state(rank=1, iteration=1, mode=Mode.INACTIVE)):
        faults.maybe_inject(3, _CallWrapperStandIn(frozen))  # type: ignore[arg-type]
    faults.maybe_inject(2, _CallWrapperStandIn(state(rank=1, iteration=1)))  # type: ignore[arg-type]
    with pytest.raises(InjectedException, match="initial rank 1, iteration 1, step 3"):
        faults.maybe_inject(3, _CallWrapperStandIn(state(rank=1, iteration=1)))  # type: ignore[arg-type]


def test_a_spare_skips_the_faults_that_need_training_code() -> None:
    plan = FaultPlan.parse("exception@rank=1,step=1;hang@rank=1,after=1s;sigkill@rank=1,after=1h")
    with faults.arm(plan, 1, 2, 0, active=False) as armed:
        assert [f.spec.kind for f in armed.scheduled] == [Kind.SIGKILL]


def test_a_phase_fault_fires_on_entering_its_phase_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV_VAR, "exception@rank=1,phase=finalize,iteration=2;sigkill@rank=3,phase=barrier")
    for phase, rank, iteration in [("FINALIZING", 1, 1), ("FINALIZING", 0, 2), ("HEALTH_CHECK", 1, 2),
                                   ("RESTART_BARRIER", 1, 2), ("DONE", 1, 2), ("reassignment", 1, 2)]:
        faults.enter_phase(phase, rank, 4, iteration, Mode.ACTIVE)  # nothing due there
    monkeypatch.setenv(faults.ENV_VAR, "exception@rank=1,phase=finalize,iteration=2;exception@rank=1,phase=initialize")
    faults.enter_phase("RUNNING", 1, 4, 0, Mode.INACTIVE)  # a spare initializes nothing: skipped
    with pytest.raises(InjectedException, match="entering phase initialize"):
        faults.enter_phase("RUNNING", 1, 4, 0, Mode.ACTIVE)
    with pytest.raises(InjectedException, match="initial rank 1, iteration 2, entering phase finalize"):
        faults.enter_phase("FINALIZING", 1, 4, 2, Mode.ACTIVE)
    faults.enter_phase("FINALIZING", 1, 4, 2, Mode.ACTIVE)  # once per process and iteration


def test_phase_names_match_the_wrappers_phases() -> None:
    from inprocess import _native
    from inprocess.faults import phases

    assert set(phases.WRAPPER_PHASES) <= set(_native.Phase.__members__)
    assert set(phases.WRAPPER_PHASES.values()) | {"reassignment", "takeover"} == set(faults.PHASES)


def test_a_timed_hang_armed_outside_the_main_thread_is_refused() -> None:
    errors: list[BaseException] = []

    def arm_here() -> None:
        try:
            faults.arm(FaultPlan.parse("hang@rank=0,after=1s"), 0, 1, 0).disarm()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    t = threading.Thread(target=arm_here)
    t.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], FaultUnavailable), errors
    assert "main thread" in str(errors[0])


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda_available(), reason="this machine has a CUDA device: the GPU faults are tested for real")
def test_gpu_faults_are_refused_without_a_cuda_device() -> None:
    plan = FaultPlan.parse("gpu_error@rank=1,step=3;gpu_sleep@rank=2,after=1s")
    for rank in (1, 2):
        with pytest.raises(FaultUnavailable, match="needs a CUDA device"):
            faults.arm(plan, rank, 4, 0)
    faults.arm(plan, 0, 4, 0).disarm()  # not due on rank 0: nothing to refuse
    for kind in (Kind.GPU_ERROR, Kind.GPU_SLEEP):
        with pytest.raises(FaultUnavailable, match=f"{kind.value} needs a CUDA device"):
            faults.perform(kind)


GPU_CHILD = """
import json, sys, time, torch, inprocess.faults as faults
x = torch.ones(1, device="cuda")
start = time.monotonic()
try:
    faults.maybe_inject(0)
    torch.cuda.synchronize()
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
print(json.dumps({"waited": time.monotonic() - start}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs an NVIDIA GPU with CUDA")
def test_gpu_error_poisons_the_device() -> None:
    res = run_child(GPU_CHILD, "gpu_error@rank=0,step=0", rank=0, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "device-side assert" in json.loads(res.stdout)["error"]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs an NVIDIA GPU with CUDA")
def test_gpu_sleep_keeps_the_device_busy_for_its_duration() -> None:
    res = run_child(GPU_CHILD, "gpu_sleep@rank=0,step=0,for=2s", rank=0, timeout=120)
    assert res.returncode == 0, res.stderr
    assert 1.5 <= json.loads(res.stdout)["waited"] < 10


# -- NVRx's inprocess.tools.inject_fault ---------------------------------------------


def test_nvrx_names_are_there() -> None:
    import inprocess.tools.inject_fault as module

    assert module is nvrx_api
    assert [(f.name, f.value) for f in nvrx_api.Fault] == [
        ("GPU_ERROR", 1), ("GPU_SLEEP", 2), ("WORKLOAD_EXC", 3), ("ASYNC_EXC", 4), ("SIGNAL_EXC", 5),
        ("OS_ABORT", 6), ("LOCK_GIL", 7), ("SEGFAULT", 8), ("SIGINT", 9), ("SIGKILL", 10), ("SIGTERM", 11),
        ("SIGSTOP", 12)]
    assert nvrx_api.InjectedException is InjectedException and issubclass(InjectedException, Exception)
    assert list(inspect.signature(nvrx_api.inject_fault).parameters) == [
        "faults", "num_faults", "keep_alive", "delay", "seed", "callback"]


def test_a_workload_exception_is_raised_where_the_loop_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    nvrx_api.clear_workload_exception()
    called = threading.Event()
    # keep_alive=1 of 2 ranks: rank 1 is the only candidate.
    nvrx_api.inject_fault(faults=(nvrx_api.Fault.WORKLOAD_EXC,), num_faults=1, keep_alive=1, delay=0.05, seed=3,
                          callback=called.set)
    nvrx_api.maybe_raise_workload_exception()  # not yet due
    assert called.wait(10)
    time.sleep(0.05)
    with pytest.raises(InjectedException):
        nvrx_api.maybe_raise_workload_exception()
    nvrx_api.maybe_raise_workload_exception()  # raised once


def test_rank_zero_kept_alive_gets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    calls: list[float] = []
    fault = nvrx_api.register_fault("record_rank_zero", lambda delay, callback: calls.append(delay))
    for seed in range(20):
        nvrx_api.inject_fault(faults=(fault,), num_faults=(1, 3), keep_alive=1, delay=(0.0, 1.0), seed=seed)
    assert calls == []


@pytest.mark.parametrize("kwargs, named", [
    (dict(faults=()), "faults=()"),
    (dict(faults="SIGKILL"), "faults='SIGKILL'"),
    (dict(faults=("SIGKILL",)), "'SIGKILL'"),
    (dict(num_faults=-1), "num_faults=-1"),
    (dict(num_faults=(3, 1)), "num_faults=(3, 1)"),
    (dict(num_faults=1.5), "num_faults=1.5"),
    (dict(keep_alive=-1), "keep_alive=-1"),
    (dict(delay=-1.0), "delay=-1.0"),
    (dict(delay=(2.0, 1.0)), "delay=(2.0, 1.0)"),
    (dict(delay="soon"), "delay='soon'"),
    (dict(seed="x"), "seed='x'"),
    (dict(callback=3), "callback=3"),
])
def test_inject_fault_arguments_are_checked(kwargs: dict[str, Any], named: str) -> None:
    args: dict[str, Any] = dict(faults=(nvrx_api.Fault.SIGKILL,), num_faults=0, keep_alive=0, delay=1.0, seed=0)
    args.update(kwargs)
    with pytest.raises(ValueError) as info:
        nvrx_api.inject_fault(**args)
    assert named in str(info.value)


def test_register_fault_replaces_a_handler_or_adds_a_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrx_api, "_handlers", {})
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    seen: list[tuple[str, float, Any]] = []
    same = nvrx_api.register_fault(nvrx_api.Fault.SIGKILL, lambda d, c: seen.append(("sigkill", d, c)))
    assert same is nvrx_api.Fault.SIGKILL
    custom = nvrx_api.register_fault("flaky_disk", lambda d, c: seen.append(("flaky_disk", d, c)))
    assert custom == nvrx_api.CustomFault("flaky_disk")
    nvrx_api.inject_fault(faults=(nvrx_api.Fault.SIGKILL,), num_faults=1, keep_alive=0, delay=0.25, seed=0)
    nvrx_api.dispatch_fault_injection(custom, 1.5, None)
    assert seen == [("sigkill", 0.25, None), ("flaky_disk", 1.5, None)]
    with pytest.raises(ValueError, match="not registered"):
        nvrx_api.dispatch_fault_injection(nvrx_api.CustomFault("unknown"), 0.0, None)
    with pytest.raises(ValueError, match="fault_name_or_enum=3"):
        nvrx_api.register_fault(3, lambda d, c: None)


NVRX_CHILD = """
import time
from inprocess.tools import inject_fault as m
start = time.monotonic()
try:
    m.inject_fault(faults=(m.Fault.{fault},), num_faults=1, keep_alive=0, delay=0.3, seed=0)
    {wait}
except m.InjectedException:
    print("raised after %.2f" % (time.monotonic() - start))
"""


@pytest.mark.parametrize("fault, wait, returncode, out", [
    ("SIGNAL_EXC", "time.sleep(30)", 0, "raised after"),
    ("ASYNC_EXC", "while True: pass", 0, "raised after"),
    ("SIGKILL", "time.sleep(30)", -signal.SIGKILL, ""),
    ("SIGTERM", "time.sleep(30)", -signal.SIGTERM, ""),
    ("OS_ABORT", "time.sleep(30)", -signal.SIGABRT, ""),
    ("SEGFAULT", "time.sleep(30)", -signal.SIGSEGV, ""),
])
def test_inject_fault_does_the_fault_after_the_delay(fault: str, wait: str, returncode: int, out: str) -> None:
    start = time.monotonic()
    res = run_child(NVRX_CHILD.format(fault=fault, wait=wait), "", rank=0, WORLD_SIZE="1")
    assert res.returncode == returncode, res.stderr
    assert out in res.stdout
    assert time.monotonic() - start < 20


DRAWS_SCRIPT = """
import json, os, sys, importlib
m = importlib.import_module(sys.argv[1])
picked = []
for fault in m.Fault:
    m.register_fault(fault, lambda delay, callback, name=fault.name: picked.append((name, round(delay, 9))))
result = {}
for seed in range(12):
    for rank in range(8):
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), "8"
        picked.clear()
        m.inject_fault(faults=tuple(m.Fault), num_faults=(1, 4), keep_alive=2, delay=(0.5, 3.0), seed=seed)
        result[f"{seed}/{rank}"] = picked[:]
print(json.dumps(result))
"""


def test_a_seed_picks_what_nvrx_picks() -> None:
    """Needs NVRx: INPROCESS_NVRX_PYTHON names a Python with nvidia_resiliency_ext installed."""
    nvrx_python = os.environ.get("INPROCESS_NVRX_PYTHON")
    if not nvrx_python:
        pytest.skip("set INPROCESS_NVRX_PYTHON to a Python with nvidia_resiliency_ext to compare draws with NVRx")
    theirs = subprocess.run([nvrx_python, "-c", DRAWS_SCRIPT, "nvidia_resiliency_ext.inprocess.tools.inject_fault"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    ours = subprocess.run([sys.executable, "-c", DRAWS_SCRIPT, "inprocess.tools.inject_fault"],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    theirs_json, ours_json = json.loads(theirs.splitlines()[-1]), json.loads(ours)
    assert sum(bool(v) for v in ours_json.values()) > 12  # faults were picked at all
    assert ours_json == theirs_json


# -- a real job rehearsing faults from the environment alone -------------------------


def _expected_total(steps: int, world_size: int) -> float:
    total = 0.0
    for _ in range(steps):
        total = (total + 1) * world_size  # every rank adds 1, then the allreduce sums
    return total


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_job_rehearses_an_exception_named_only_in_the_environment(tmp_path: pathlib.Path) -> None:
    from conftest import run_job

    res = run_job(tmp_path, {}, worker="faults_worker.py", timeout=100,
                  env={"INPROCESS_FAULTS": "exception@rank=2,step=3", "FAULTS_TEST_STEPS": "8"})
    for r in range(4):
        log = res.rank(r)
        assert res.returncodes[r] == 0, res.describe()
        assert log["result"] == {"iteration": 1, "total": _expected_total(8, 4)}
        assert [(i["iteration"], i["world_size"]) for i in log["iterations"]] == [(0, 4), (1, 4)]
        restart, = log["restarts"]
        assert restart["terminated"] == []
        assert {"rank": 2, "type": "InjectedException", "kind": "exception",
                "message": "injected fault: exception on initial rank 2, iteration 0, step 3"} in restart["faults"]
    assert res.rank(2)["iterations"][0]["steps"] == 3  # it raised at step 3, before that step's allreduce


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_job_rehearses_a_timed_sigkill_named_only_in_the_environment(tmp_path: pathlib.Path) -> None:
    from conftest import assert_excluded, run_job

    res = run_job(tmp_path, {}, worker="faults_worker.py", timeout=100,
                  env={"INPROCESS_FAULTS": "sigkill@rank=1,after=1500ms", "FAULTS_TEST_STEPS": "30"})
    assert res.returncodes[1] == -signal.SIGKILL and res.logs[1] is None
    assert_excluded(res, 1, {"killed", "exception", "after_restart"})
    for r in (0, 2, 3):
        assert res.rank(r)["result"] == {"iteration": 1, "total": _expected_total(30, 3)}
