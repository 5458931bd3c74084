"""Rank assignment: State, Compose, the built-in assignments per rank and job-wide, per-rank hooks.

The central property: every built-in assignment called per rank, as
nvidia_resiliency_ext calls it, gives each rank exactly its row of the
decision the leader makes for the whole job, on random topologies and fault
sets; and a composition run per rank on the leader (as the Wrapper runs one
that holds a per-rank hook) gives the same table again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inprocess
from inprocess import Compose, FrozenState, Mode, State
from inprocess.control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from inprocess.control.protocol import Decision, FaultRecord
from inprocess.control.records import ENDS_JOB
from inprocess.health_check import HealthCheck as HealthCheckHook
from inprocess.initialize import Initialize
from inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    FillGaps,
    FilterCountGroupedByKey,
    JobAssignment,
    JobAssignmentCtx,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignment,
    RankAssignmentCtx,
    RankAssignmentMismatch,
    RankDiscarded,
    ShiftRanks,
    Topology,
    Tree,
    decide,
    initial_membership,
    key_gathering_leaves,
    run_job_wide,
)
from inprocess.rank_assignment.agreed import AgreedInputs
from inprocess.rank_assignment.decision import run_per_rank, verify_own_row
from inprocess.rank_assignment.store_gather import StoreNamespace

pytestmark = pytest.mark.timeout(120)

RESERVE, BACKFILL = LayerFlag.RESERVE, LayerFlag.BACKFILL


class PassThrough(RankAssignment):
    """A per-rank hook that changes nothing: the composition it is in then runs per rank."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        return ctx


def topology_for(ra: Any, n: int) -> Topology:
    owners = key_gathering_leaves(ra)
    return Topology(owners, [[o.local_keys(FrozenState(rank=r, world_size=n)) for r in range(n)] for o in owners])


def row(m: Membership, r: int) -> tuple[int, int, int, int, int | None]:
    return (m.mode[r], m.rank[r], m.active_rank[r], m.world_size, m.active_world_size)


def state_row(s: Any) -> tuple[int, int, int, int, int | None]:
    return (int(s.mode), s.rank, NONE if s.active_rank is None else s.active_rank, s.world_size, s.active_world_size)


# -- State ------------------------------------------------------------------------------


def test_state_reads_rank_and_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    for s in (State(), State.from_env(), FrozenState()):
        assert (s.rank, s.world_size, s.initial_rank, s.initial_world_size) == (3, 8, 3, 8)
        assert (s.active_rank, s.active_world_size, s.iteration, s.mode, s.fn_exception) == (
            None, None, 0, Mode.INITIALIZED, None)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (State().rank, State().world_size) == (0, 1)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x': expected an int"):
        State()


def test_state_takes_the_nvrx_arguments_in_their_order():
    s = State(2, 6, 1, 5, iteration=4, mode=Mode.ACTIVE)
    assert (s.rank, s.world_size, s.active_rank, s.active_world_size) == (2, 6, 1, 5)
    assert (s.initial_rank, s.initial_world_size) == (2, 6)  # default to rank and world size
    assert State(1, 4, initial_rank=3, initial_world_size=8).initial_rank == 3
    assert [f.name for f in dataclasses.fields(State)] == [f.name for f in dataclasses.fields(FrozenState)] == [
        "rank", "world_size", "active_rank", "active_world_size", "initial_rank", "initial_world_size",
        "iteration", "mode", "fn_exception",
    ]
    assert [m.name for m in Mode] == ["INITIALIZED", "ACTIVE", "INACTIVE", "TERMINATED"]
    # The wrapper's own call stays valid.
    w = State(initial_rank=1, initial_world_size=4, rank=1, world_size=4)
    assert (w.rank, w.world_size, w.initial_rank, w.mode) == (1, 4, 1, Mode.INITIALIZED)


def test_freeze_copies_every_field_and_the_copy_is_read_only():
    error = RuntimeError("boom")
    s = State(1, 4, 1, 4, iteration=2, mode=Mode.ACTIVE, fn_exception=error)
    f = s.freeze()
    assert all(getattr(f, x.name) is getattr(s, x.name) for x in dataclasses.fields(State))
    assert f.fn_exception is error  # the exception itself, not a copy
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.rank = 0  # type: ignore[misc]
    s.advance()
    assert (s.iteration, s.fn_exception) == (3, None) and f.iteration == 2
    t = State(0, 1)
    t.copy_from(f, fields=["iteration", "mode"])
    assert (t.iteration, t.mode, t.rank) == (2, Mode.ACTIVE, 0)


def test_set_distributed_vars(monkeypatch):
    monkeypatch.setenv("RANK", "9")
    State(3, 4, 2, 3, mode=Mode.ACTIVE).set_distributed_vars()
    assert (inprocess.state.os.environ["RANK"], inprocess.state.os.environ["WORLD_SIZE"]) == ("2", "3")
    State(3, 4, None, 3, mode=Mode.INACTIVE).set_distributed_vars()
    assert "RANK" not in inprocess.state.os.environ and "WORLD_SIZE" not in inprocess.state.os.environ


# -- Compose ------------------------------------------------------------------------------


class _Healthy(HealthCheckHook):
    def __call__(self, state: Any) -> Any:
        return state


class _Seen(Initialize):
    def __init__(self, name: str, seen: list[str]):
        self.name, self.seen = name, seen

    def __call__(self, state: Any) -> Any:
        self.seen.append(self.name)
        return state


def test_compose_runs_the_last_instance_first():
    order: list[str] = []

    def tag(name):
        def f(x):
            order.append(name)
            return x + name

        return f

    assert Compose(tag("a"), tag("b"), tag("c"))("") == "cba"
    assert order == ["c", "b", "a"]


def test_compose_with_no_argument_and_with_several():
    calls = []
    assert Compose(lambda: calls.append("f") or 7, lambda: calls.append("g"))() == 7
    assert calls == ["g", "f"]
    # A tuple is passed on as the next member's arguments; any other value as its only one.
    assert Compose(lambda a, b, c: (a, b, c), lambda a, b, c: (c, b, a))(1, 2, 3) == (3, 2, 1)
    assert Compose(lambda x: x * 10, lambda a, b, c: a + b + c)(1, 2, 3) == 60


def test_a_member_returning_none_warns_and_its_input_goes_on():
    with pytest.warns(UserWarning, match="returned None for arguments \\(5,\\)"):
        assert Compose(lambda x: x + 1, lambda x: None)(5) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Compose(lambda: None)() is None  # nothing to chain: no warning
        assert Compose(lambda x: x)(None) is None


def test_compose_is_an_instance_of_the_members_nearest_common_base():
    seen: list[str] = []
    c = Compose(_Seen("a", seen), _Seen("b", seen))
    assert isinstance(c, Initialize) and isinstance(c, Compose)
    assert c("state") == "state" and seen == ["b", "a"]
    assert isinstance(Compose(ShiftRanks(), FillGaps()), JobAssignment)
    assert isinstance(Compose(ShiftRanks(), PassThrough()), RankAssignment)
    assert not isinstance(Compose(ShiftRanks(), PassThrough()), JobAssignment)
    assert isinstance(Compose(c, Compose(_Seen("c", seen))), Initialize)  # compositions of compositions
    assert not isinstance(Compose(_Seen("a", seen), ShiftRanks()), Initialize)
    assert not isinstance(Compose(_Seen("a", seen), _Healthy()), Initialize)
    assert isinstance(Compose(_Healthy(), _Healthy()), HealthCheckHook)
    # Plain functions share only `function`, which cannot be a base: a plain Compose.
    assert type(Compose(len, abs)) is Compose
    assert "Compose(" in repr(c)


def test_compose_refuses_what_is_not_callable():
    with pytest.raises(ValueError, match="Compose argument 1=3 \\(int\\) is not callable"):
        Compose(len, 3)
    with pytest.raises(ValueError, match="at least one instance"):
        Compose()


# -- the built-in assignments per rank, as there --------------------------------------------


def per_rank(ra: Any, state: State, terminated: set[int], store: Any = None) -> RankAssignmentCtx:
    return ra(RankAssignmentCtx(state, store, set(terminated)))


def test_shift_ranks_per_rank_with_the_state_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    store = dist.HashStore()
    ctx = ShiftRanks()(RankAssignmentCtx(State(), store, {1}))
    assert (ctx.state.rank, ctx.state.world_size, ctx.state.initial_rank, ctx.terminated_ranks) == (1, 3, 2, set())
    with pytest.raises(RankDiscarded):
        ShiftRanks()(RankAssignmentCtx(State(), store, {2}))


def test_shift_and_fill_per_rank_follow_the_documented_pictures():
    gone = {1, 4, 5}
    shift = {r: per_rank(ShiftRanks(), State(r, 8), gone).state.rank for r in (0, 2, 3, 6, 7)}
    assert shift == {0: 0, 2: 1, 3: 2, 6: 3, 7: 4}
    fill = {r: per_rank(FillGaps(), State(r, 8), gone).state.rank for r in (0, 2, 3, 6, 7)}
    assert fill == {0: 0, 2: 2, 3: 3, 6: 1, 7: 4}  # 0 6 2 3 7
    assert per_rank(FillGaps(), State(7, 8), gone).state.world_size == 5


def test_activation_per_rank():
    s = State(3, 6)
    a = per_rank(ActivateAllRanks(), s, set()).state
    assert (a.mode, a.active_rank, a.active_world_size) == (Mode.ACTIVE, 3, 6)
    m = per_rank(MaxActiveWorldSize(3), s, set()).state
    assert (m.mode, m.active_rank, m.active_world_size) == (Mode.INACTIVE, None, 3)
    d = per_rank(ActiveWorldSizeDivisibleBy(4), State(2, 6), set()).state
    assert (d.mode, d.active_rank, d.active_world_size) == (Mode.ACTIVE, 2, 4)
    # The previous active world size bounds it: a spare fills in while the world allows.
    spare = State(3, 4, None, 3, mode=Mode.INACTIVE)
    after = per_rank(Compose(MaxActiveWorldSize(3), ShiftRanks()), spare, {0}).state
    assert (after.mode, after.rank, after.active_rank, after.active_world_size) == (Mode.ACTIVE, 2, 2, 3)


def test_a_job_wide_assignment_called_per_rank_outside_the_wrapper_says_how_to_use_it():
    class Custom(JobAssignment):
        def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx:
            return ctx

    with pytest.raises(TypeError, match="decides for the whole job"):
        per_rank(Custom(), State(0, 2), set())


# -- the simple assignments, job-wide --------------------------------------------------------


def assign(ra, n, dead, previous: Membership | None = None):
    if previous is None:
        previous, _ = run_job_wide(ra, initial_membership(n), set(), 0, Topology.empty())
    m, _ = run_job_wide(ra, previous, set(dead), 1, Topology.empty())
    return m


def test_shift_ranks_keeps_order_and_closes_gaps():
    m = assign(Compose(ActivateAllRanks(), ShiftRanks()), 8, {1, 4, 5})
    assert [m.rank[r] for r in (0, 2, 3, 6, 7)] == [0, 1, 2, 3, 4]
    assert m.active_rank == m.rank


def test_fill_gaps_moves_only_the_highest_ranks():
    m = assign(Compose(ActivateAllRanks(), FillGaps()), 8, {1, 4, 5})
    # Ranks below the new world size (5) keep theirs; 6 and 7 fill the gaps 1 and 4.
    assert [m.rank[r] for r in (0, 2, 3)] == [0, 2, 3]
    assert (m.rank[6], m.rank[7]) == (1, 4)


def test_max_active_world_size_makes_spares_and_reuses_them():
    for ra in (Compose(MaxActiveWorldSize(4), ActivateAllRanks(), ShiftRanks()),
               Compose(MaxActiveWorldSize(4), ShiftRanks())):
        m0 = assign(ra, 6, set(), previous=run_job_wide(ra, initial_membership(6), set(), 0, Topology.empty())[0])
        assert m0.mode == [ACTIVE] * 4 + [INACTIVE] * 2 and m0.active_world_size == 4
        m1 = assign(ra, 6, {1}, previous=m0)
        # The first spare (initial 4) becomes active rank 3; initial 5 stays a spare.
        assert m1.active_rank[4] == 3 and m1.mode[5] == INACTIVE and m1.active_world_size == 4


def test_active_world_size_divisible_by():
    m = assign(Compose(ActiveWorldSizeDivisibleBy(4), ActivateAllRanks(), ShiftRanks()), 10, {0})
    assert m.active_world_size == 8 and m.world_size == 9
    assert m.mode[9] == INACTIVE


def test_failing_assignment_becomes_an_abort_decision():
    class Boom(JobAssignment):
        def assign_job(self, ctx):
            raise RuntimeError("boom")

    d = decide(Compose(ActivateAllRanks(), ShiftRanks(), Boom()), Membership.all_active(4), {2}, [], 3, 0)
    assert d.abort is not None and "boom" in d.abort
    assert d.membership.mode[2] == TERMINATED


# -- the property: per rank == job-wide ------------------------------------------------------

Factory = Callable[[], Any]


@st.composite
def scenarios(draw):
    nodes = draw(st.integers(1, 4))
    per_node = draw(st.integers(1, 4))
    n = nodes * per_node
    node = lambda s: f"n{s.initial_rank // per_node}"  # noqa: E731
    k = draw(st.integers(1, n))
    d = draw(st.integers(1, 3))
    keep = draw(st.integers(1, per_node))
    seconds = datetime.timedelta(seconds=20)

    def filt() -> FilterCountGroupedByKey:
        return FilterCountGroupedByKey(node, lambda count: count >= keep, timeout=seconds)

    flags = st.sampled_from([None, RESERVE, BACKFILL, RESERVE | BACKFILL])
    job_cap = draw(st.one_of(st.none(), st.integers(1, n)))
    node_cap = draw(st.one_of(st.none(), st.integers(1, per_node)))
    job_flag, node_flag, node_min = draw(flags), draw(flags), draw(st.integers(1, per_node))

    def tree() -> Tree:
        return Tree([Layer(max_ranks=job_cap, key_or_fn="job", flag=job_flag),
                     Layer(min_ranks=node_min, max_ranks=node_cap, key_or_fn=node, flag=node_flag)])

    factories: dict[str, Factory] = {
        "activate+shift": lambda: Compose(ActivateAllRanks(), ShiftRanks()),
        "activate+fill": lambda: Compose(ActivateAllRanks(), FillGaps()),
        "max+shift": lambda: Compose(MaxActiveWorldSize(k), ShiftRanks()),
        "max+activate+shift": lambda: Compose(MaxActiveWorldSize(k), ActivateAllRanks(), ShiftRanks()),
        "divisible+max+shift+filter": lambda: Compose(
            ActiveWorldSizeDivisibleBy(d), MaxActiveWorldSize(k), ShiftRanks(), filt()),
        "max+fill+filter": lambda: Compose(MaxActiveWorldSize(k), FillGaps(), filt()),
        "tree": tree,
        "tree+filter": lambda: Compose(tree(), filt()),
        "divisible+tree": lambda: Compose(ActiveWorldSizeDivisibleBy(d), tree()),
    }
    name = draw(st.sampled_from(sorted(factories)))
    losses = draw(st.lists(st.sets(st.integers(0, n - 1), max_size=n), min_size=1, max_size=4))
    return name, factories[name], n, losses


# Called per rank outside the Wrapper, Tree decides from the table it kept (as there): nothing may run
# after it. Inside the Wrapper every composition reads the agreed previous decision instead.
KEEPS_ITS_OWN_TABLE = {"divisible+tree"}


def _row_view(m: Membership, r: int, state: State) -> RankAssignmentCtx | None:
    """Rank r's row of ``m`` as a per-rank result (where the per-rank call is not compared)."""
    if m.mode[r] == TERMINATED:
        return None
    act = None if m.active_rank[r] == NONE else m.active_rank[r]
    new = dataclasses.replace(state, rank=m.rank[r], world_size=m.world_size, active_rank=act,
                              active_world_size=m.active_world_size, mode=Mode(m.mode[r]))
    return RankAssignmentCtx(new, None, set())


def build_per_process(factory: Factory, n: int) -> list[Any]:
    """One instance per rank, each built as in its own process (the store namespaces match)."""
    out = []
    for _ in range(n):
        StoreNamespace._counters.clear()
        out.append(factory())
    return out


def call_every_rank(instances: list[Any], states: dict[int, State], leaving: set[int], store: Any) -> dict[int, Any]:
    """Every rank in ``states`` calls its own instance at once (Tree and the filter exchange keys)."""

    def one(r: int) -> Any:
        try:
            return instances[r](RankAssignmentCtx(states[r], store, set(leaving)))
        except RankDiscarded:
            return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(states))) as pool:
        futures = {r: pool.submit(one, r) for r in states}
        return {r: f.result(timeout=60) for r, f in futures.items()}


@pytest.mark.timeout(300)
@settings(max_examples=int(os.environ.get("INPROCESS_TEST_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_rank_gets_its_row_of_the_job_wide_decision(scenario):
    name, factory, n, losses = scenario
    job_wide = factory()
    topo = topology_for(job_wide, n)
    instances = build_per_process(factory, n)
    with_hook = Compose(job_wide, PassThrough())
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    previous = initial_membership(n)
    states = {r: State(rank=r, world_size=n) for r in range(n)}
    for iteration, lost in enumerate([set()] + losses):
        lost = {r for r in lost if previous.mode[r] != TERMINATED}
        m, newly = run_job_wide(job_wide, previous, lost, iteration, topo)
        leaving = {previous.rank[r] for r in lost}
        # 1. Per rank, exactly as there: each rank its own instance, its own state.
        results = {r: _row_view(m, r, states[r]) for r in states if r not in lost}
        if name not in KEEPS_ITS_OWN_TABLE:
            results = call_every_rank(instances, {r: s for r, s in states.items() if r not in lost}, leaving, store)
        for r, out in results.items():
            if out is None:
                assert m.mode[r] == TERMINATED, (name, iteration, r, row(m, r))
            else:
                assert state_row(out.state) == row(m, r), (name, iteration, r, out.state, m)
                assert out.terminated_ranks == set()
        # 2. Per rank on the leader, as the Wrapper runs a composition holding a per-rank hook.
        inputs = AgreedInputs(previous, iteration, max(iteration - 1, 0), lambda: topo)
        assert run_per_rank(with_hook, inputs, lost) == (m, newly), (name, iteration)
        # 3. Each rank's own check of its row passes.
        decision = Decision(iteration, m, sorted(newly), [], 0, 0)
        for r in range(n):
            if m.mode[r] != TERMINATED:
                before = AgreedInputs(previous, iteration, max(iteration - 1, 0), lambda: topo).state_of(r)
                verify_own_row(with_hook, AgreedInputs(previous, iteration, 0, lambda: topo), before.freeze(),
                               decision)
        states = {r: out.state for r, out in results.items() if out is not None}
        previous = m
        if m.world_size == 0:
            break


# -- per-rank hooks in the decision ---------------------------------------------------------------


def decide_twice(ra, n, lost, faults=()):
    d0 = decide(ra, initial_membership(n), set(), [], 0, 0)
    assert d0.abort is None, d0.abort
    return d0, decide(ra, d0.membership, set(lost), list(faults), 1, 0)


def test_a_per_rank_hook_sees_agreed_states_and_the_ranks_leaving():
    seen = []

    class Observe(RankAssignment):
        def __call__(self, ctx):
            seen.append((ctx.state.initial_rank, ctx.state.mode, ctx.state.iteration, sorted(ctx.terminated_ranks)))
            return ctx

    d0, d1 = decide_twice(Compose(ActivateAllRanks(), ShiftRanks(), Observe()), 4, {2})
    assert sorted(seen[:4]) == [(r, Mode.INITIALIZED, 0, []) for r in range(4)]
    assert sorted(seen[4:]) == [(r, Mode.ACTIVE, 0, [2]) for r in (0, 1, 3)]
    assert d1.abort is None and d1.terminated == [2] and [d1.membership.rank[r] for r in (0, 1, 3)] == [0, 1, 2]


def test_ranks_a_hook_discards_are_leaving_for_every_rank():
    class DiscardOne(RankAssignment):
        def __call__(self, ctx):
            if ctx.state.initial_rank == 1 and ctx.terminated_ranks:
                raise RankDiscarded("initial rank 1 goes with the first loss")
            return ctx

    _, d1 = decide_twice(Compose(ActivateAllRanks(), ShiftRanks(), DiscardOne()), 4, {3})
    assert d1.abort is None and d1.terminated == [1, 3]
    assert (d1.membership.rank[0], d1.membership.rank[2]) == (0, 1)


class _NoShift(RankAssignment):
    """Forgets to renumber: clears terminated_ranks and keeps every rank."""

    def __call__(self, ctx):
        ctx.terminated_ranks = set()
        return ctx


class _SameRank(RankAssignment):
    def __call__(self, ctx):
        if ctx.state.initial_rank == 3:
            ctx.state = dataclasses.replace(ctx.state, rank=1, active_rank=1)
        return ctx


@pytest.mark.parametrize(
    "ra, lost, message",
    [
        (Compose(ActivateAllRanks(), _NoShift()), {1}, "initial rank 3 has rank=3, outside 0..2"),
        (Compose(_SameRank(), ActivateAllRanks(), ShiftRanks()), set(), "initial ranks 1 and 3 both have rank=1"),
        (PassThrough(), set(), "are INITIALIZED: nothing made them active or spare"),
    ],
)
def test_an_inconsistent_result_ends_the_job_naming_the_ranks(ra, lost, message):
    d0 = decide(ra, initial_membership(4), set(), [], 0, 0)
    d = d0 if d0.abort is not None else decide(ra, d0.membership, lost, [], 1, 0)
    assert d.abort is not None and message in d.abort, d.abort


def test_a_hook_that_uses_the_store_is_told_why_it_cannot():
    class UsesStore(RankAssignment):
        def __call__(self, ctx):
            ctx.store.add("x", 1)
            return ctx

    d = decide(Compose(ActivateAllRanks(), ShiftRanks(), UsesStore()), initial_membership(2), set(), [], 0, 0)
    assert d.abort is not None and "cannot use the store" in d.abort


def test_a_rank_whose_own_run_differs_fails_its_check_and_the_next_decision_ends_the_job():
    class SpareAfterOwnFault(RankAssignment):
        def __call__(self, ctx):
            if ctx.state.fn_exception is not None:
                ctx.state = dataclasses.replace(ctx.state, mode=Mode.INACTIVE, active_rank=None)
            return ctx

    ra = Compose(SpareAfterOwnFault(), ActivateAllRanks(), ShiftRanks())
    d0, d1 = decide_twice(ra, 4, set())
    assert d1.abort is None  # the leader knows no rank's exception
    inputs = AgreedInputs(d0.membership, 1, 0, Topology.empty)
    own = inputs.state_of(2, fn_exception=RuntimeError("fault of rank 2"))
    with pytest.raises(RankAssignmentMismatch, match="initial rank 2: the rank assignment gives INACTIVE"):
        verify_own_row(ra, inputs, own.freeze(), d1)
    verify_own_row(ra, inputs, inputs.state_of(1).freeze(), d1)  # the others agree
    record = FaultRecord.from_exception(2, 1, "terminated", RankAssignmentMismatch("initial rank 2: ..."))
    d2 = decide(ra, d1.membership, {2}, [record], 2, 0)
    assert d2.abort is not None and "initial ranks 2 disagree with the decision" in d2.abort


def test_a_restart_abort_on_a_rank_ends_the_job_without_running_the_rank_assignment():
    """Issue 31: a rank's RestartAbort (a fault of kind ENDS_JOB) is a decision that ends the job on
    every rank, naming the ranks and the first one's message (RetryController's "iteration=<n>")."""
    class MustNotRun(RankAssignment):
        def __call__(self, ctx):
            raise AssertionError("the rank assignment ran for a job that ends")

    previous = decide(Compose(ActivateAllRanks(), ShiftRanks()), initial_membership(4), set(), [], 0, 0).membership
    ending = [FaultRecord.from_exception(r, 4, ENDS_JOB, inprocess.RestartAbort("iteration=4 reached max_iterations=4"))
              for r in (3, 1)]
    other = FaultRecord.from_exception(0, 4, "exception", RuntimeError("boom"))
    d = decide(Compose(MustNotRun(), ActivateAllRanks(), ShiftRanks()), previous, {2}, [other, *ending], 5, 0)
    assert d.abort == "initial ranks 1, 3 raised RestartAbort in iteration 4: iteration=4 reached max_iterations=4"
    assert d.terminated == [2] and d.membership.mode == [ACTIVE, ACTIVE, TERMINATED, ACTIVE]
    one = decide(ActivateAllRanks(), previous, set(), ending[:1], 5, 0)
    assert one.abort is not None and one.abort.startswith("initial rank 3 raised RestartAbort in iteration 4:")
    # A rank that disagreed with a decision leaves with a RankAssignmentMismatch (a RestartAbort): named so.
    mismatch = FaultRecord.from_exception(2, 1, ENDS_JOB, RankAssignmentMismatch("initial rank 2: ..."))
    d = decide(ActivateAllRanks(), previous, {2}, [mismatch], 2, 0)
    assert d.abort is not None and "initial ranks 2 disagree with the decision" in d.abort


def test_standalone_tree_gathers_through_the_store_once_and_keeps_its_table():
    n = 6
    node = lambda s: f"n{s.initial_rank // 3}"  # noqa: E731

    def make() -> Tree:
        return Tree([Layer(key_or_fn="job", flag=RESERVE), Layer(max_ranks=2, key_or_fn=node, flag=RESERVE)])

    instances = build_per_process(make, n)
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    first = call_every_rank(instances, {r: State(r, n) for r in range(n)}, set(), store)
    assert [first[r].state.mode for r in range(n)] == [Mode.ACTIVE] * 2 + [Mode.INACTIVE] + [Mode.ACTIVE] * 2 + [
        Mode.INACTIVE]
    states = {r: first[r].state for r in range(n) if r != 3}
    # Later calls decide from the kept table: no store (None would fail the exchange), no waiting on peers.
    second = {r: instances[r](RankAssignmentCtx(states[r], None, {first[3].state.rank})) for r in states}
    assert second[5].state.active_rank == first[3].state.active_rank == 2  # node 1's spare takes the exact rank
    assert [second[r].state.active_rank for r in (0, 1, 4)] == [0, 1, 3]


def test_a_restarted_incarnation_never_reads_its_predecessors_exchange(monkeypatch):
    """torchrun restarts its workers with the agent's store still holding what the previous ones
    wrote: a standalone Tree of the new incarnation must wait for its peers, not read stale keys."""
    n = 2
    store = dist.HashStore()

    def make() -> Tree:
        return Tree([Layer(key_or_fn="job", flag=RESERVE)])

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job 1/a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    store.set_timeout(datetime.timedelta(seconds=30))
    old = call_every_rank(build_per_process(make, n), {r: State(r, n) for r in range(n)}, set(), store)
    assert [old[r].state.mode for r in range(n)] == [Mode.ACTIVE] * n
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    (alone,) = build_per_process(make, 1)
    store.set_timeout(datetime.timedelta(seconds=0.5))
    # Rank 1 of the new incarnation is not there: rank 0 waits for it (here until the store's timeout).
    with pytest.raises(Exception, match="(?i)timeout|timed out"):
        alone(RankAssignmentCtx(State(0, n), store, set()))
    keys = [k for k in ("inprocess/rank_assignment/torchrun.job%201%2Fa.0/Tree_0/0/0",
                        "inprocess/rank_assignment/torchrun.job%201%2Fa.1/Tree_0/0/0") if store.check([k])]
    assert len(keys) == 2, keys  # each incarnation under its own, quoted, name


# -- the Wrapper, end to end ---------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_per_rank_hook_runs_in_the_wrapper_and_a_spare_takes_over(job):
    res = job({}, world_size=4, worker="per_rank_worker.py", env={"INPROCESS_TEST_SCENARIO": "spare"}, timeout=100)
    context = res.describe()
    assert res.returncodes == [0, 3, 0, 0], context
    for r in (0, 2, 3):
        # Calls for this rank made on this rank: its own check, and the leader's evaluation if it led.
        own = [c for c in res.rank(r)["hook_calls"] if c["for"] == r]
        start = [c for c in own if c["mode"] == "INITIALIZED"]
        after = [c for c in own if c["mode"] != "INITIALIZED"]
        # At the start: the state as there before the first assignment.
        assert start and all(c == {"for": r, "iteration": 0, "mode": "INITIALIZED", "rank": r, "world_size": 4,
                                   "active_world_size": None, "terminated": [], "fn_exception": None}
                             for c in start), (r, own)
        # After the fault: its previous state, and initial rank 1 (then rank 1) leaving.
        assert after and all(c["terminated"] == [1] and c["iteration"] == 0 and c["active_world_size"] == 3
                             and c["mode"] == ("INACTIVE" if r == 3 else "ACTIVE") for c in after), (r, own)
    # The leader ran the hook for the other ranks too, on the same inputs.
    assert any(c["for"] != r for r in (0, 2, 3) for c in res.rank(r)["hook_calls"]), context
    # Iteration 0: ranks 0-2 active, 3 a spare. Iteration 1: 3 took the place of the rank that left.
    assert res.rank(3)["iterations"][0]["iteration"] == 1
    final = {r: res.rank(r)["iterations"][-1] for r in (0, 2, 3)}
    assert {r: e["active_rank"] for r, e in final.items()} == {0: 0, 2: 1, 3: 2}, context
    for r, e in final.items():
        assert e["iteration"] == 1 and e["active_world_size"] == 3 and e["env_rank"] == str(e["active_rank"])
        assert e["steps"] == 4 and e["holders"] == [0, 2, 3], (r, e)
        assert res.rank(r)["result"] == {"iteration": 1, "sum": 6.0}


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_rank_that_disagrees_with_the_decision_ends_the_job_with_its_name(job):
    res = job({}, world_size=4, worker="per_rank_worker.py", env={"INPROCESS_TEST_SCENARIO": "mismatch"}, timeout=100)
    context = res.describe()
    assert res.returncodes == [17] * 4, context
    assert res.rank(2)["exception"] == "RankAssignmentMismatch", context
    assert "initial rank 2: the rank assignment gives INACTIVE" in res.rank(2)["message"]
    for r in (0, 1, 3):
        assert res.rank(r)["exception"] == "RestartAbort", (r, res.rank(r))
        assert "initial ranks 2 disagree with the decision" in res.rank(r)["message"], res.rank(r)
