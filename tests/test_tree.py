"""Tree, Layer, LayerFlag and FilterCountGroupedByKey on synthetic topologies, job-wide.

The standard layout is 4 nodes x 8 ranks (node = initial rank // 8). Every
decision goes through ``run_job_wide``, as the leader makes it; the per-rank
form of the same classes is compared with it in tests/test_rank_assignment.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inprocess import Compose, FrozenState, rank_assignment
from inprocess.control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    EnvKey,
    FillGaps,
    FilterCountGroupedByKey,
    HostnameKey,
    Layer,
    LayerFlag,
    MaxActiveWorldSize,
    RankAssignment,
    ShiftRanks,
    Topology,
    Tree,
    check_composition,
    check_rank_assignment,
    initial_membership,
    key_gathering_leaves,
    run_job_wide,
)

pytestmark = pytest.mark.timeout(60)

RESERVE, BACKFILL = LayerFlag.RESERVE, LayerFlag.BACKFILL
NODES, PER_NODE = 4, 8
N = NODES * PER_NODE


def node_of(state) -> str:
    return f"node{state.initial_rank // PER_NODE}"


def initial_state(rank: int, world_size: int = N) -> FrozenState:
    """A rank's state at the initial barrier, when it evaluates its keys."""
    return FrozenState(rank=rank, world_size=world_size)


def topology_for(ra, world_size: int = N) -> Topology:
    """What the Wrapper gathers at the initial barrier: every owner's local_keys on every rank."""
    owners = key_gathering_leaves(ra)
    return Topology(owners, [[o.local_keys(initial_state(r, world_size)) for r in range(world_size)] for o in owners])


def decide(ra, previous: Membership, lost, iteration: int, topo: Topology):
    """One leader decision, as the Wrapper makes it."""
    return run_job_wide(ra, previous, set(lost), iteration, topo)


def start(ra, world_size: int = N):
    topo = topology_for(ra, world_size)
    m, newly = decide(ra, initial_membership(world_size), set(), 0, topo)
    return m, topo


def spares_per_node_tree(**kw) -> Tree:
    """Every node keeps 2 spares; a lost rank is replaced within its node first, then anywhere."""
    return Tree([Layer(key_or_fn="job", flag=RESERVE), Layer(max_ranks=6, key_or_fn=node_of, flag=RESERVE)], **kw)


def spare_node_tree(**kw) -> Tree:
    """24 active ranks: nodes 0-2 run, node 3 is a whole spare node."""
    return Tree([Layer(max_ranks=24, key_or_fn="job", flag=RESERVE), Layer(key_or_fn=node_of, flag=RESERVE)], **kw)


def active_of(m: Membership) -> dict[int, int]:
    return {r: m.active_rank[r] for r in range(len(m.mode)) if m.mode[r] == ACTIVE}


# -- construction ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"min_ranks": 0}, "min_ranks=0"),
        ({"min_ranks": True}, "min_ranks=True"),
        ({"max_ranks": 0}, "max_ranks=0"),
        ({"max_ranks": 2.5}, "max_ranks=2.5"),
        ({"key_or_fn": [3]}, "key_or_fn=[3]"),
        ({"flag": "RESERVE"}, "flag='RESERVE'"),
    ],
)
def test_layer_refuses_bad_arguments(kwargs, fragment):
    with pytest.raises(ValueError, match="expected") as info:
        Layer(**kwargs)
    assert fragment in str(info.value)


def test_tree_refuses_bad_arguments():
    with pytest.raises(ValueError, match="layers=\\[\\]"):
        Tree([])
    with pytest.raises(ValueError, match="expected a non-empty list of Layer"):
        Tree(Layer())
    with pytest.raises(ValueError, match=r"layers\[1\]='node'"):
        Tree([Layer(), "node"])
    with pytest.raises(ValueError, match="world_size_filter=4"):
        Tree([Layer()], world_size_filter=4)
    with pytest.raises(ValueError, match="condition=None"):
        FilterCountGroupedByKey("x", None)
    with pytest.raises(ValueError, match="key_or_fn=None"):
        FilterCountGroupedByKey(None, bool)


def test_flags_combine_and_layers_report_them():
    layer = Layer(key_or_fn="job", flag=RESERVE | BACKFILL)
    assert layer.has(RESERVE) and layer.has(BACKFILL)
    assert not Layer().has(RESERVE)
    assert "RESERVE" in repr(layer)


def test_tree_and_filter_are_rank_assignments_and_gather_keys():
    tree, filt = spares_per_node_tree(), FilterCountGroupedByKey(node_of, lambda c: c == PER_NODE)
    ra = Compose(tree, filt)
    check_rank_assignment(ra)
    assert isinstance(tree, RankAssignment) and isinstance(filt, RankAssignment)
    assert key_gathering_leaves(ra) == [filt, tree]  # execution order
    assert tree.local_keys(initial_state(13)) == ("job", "node1")
    assert filt.local_keys(initial_state(13)) == ("node1",)


# -- keys -------------------------------------------------------------------------


def test_key_sources(monkeypatch):
    monkeypatch.setenv("TREE_TEST_NODE", "nodeA")
    assert Layer(key_or_fn=EnvKey("TREE_TEST_NODE")).key_or_fn(initial_state(0, 1)) == "nodeA"
    monkeypatch.delenv("TREE_TEST_NODE")
    with pytest.raises(ValueError, match="TREE_TEST_NODE is not set on initial rank 5"):
        Tree([Layer(key_or_fn=EnvKey("TREE_TEST_NODE"))]).local_keys(initial_state(5, 8))
    assert EnvKey("TREE_TEST_NODE", default="none")(initial_state(0, 1)) == "none"
    assert Tree([Layer(key_or_fn=HostnameKey())]).local_keys(initial_state(0, 1))[0]
    # A plain str is the key itself, never an environment variable's name.
    monkeypatch.setenv("HOME_NODE", "x")
    assert Tree([Layer(key_or_fn="HOME_NODE")]).local_keys(initial_state(0, 1)) == ("HOME_NODE",)
    # Any hashable result (an int, a tuple) is compared by its str(); an unhashable one is refused.
    assert Tree([Layer(key_or_fn=lambda s: s.initial_rank // 4)]).local_keys(initial_state(9, 16)) == ("2",)
    assert Tree([Layer(key_or_fn=lambda s: (s.initial_rank,))]).local_keys(initial_state(1, 16)) == ("(1,)",)
    with pytest.raises(ValueError, match=r"returned \[1\] \(list\) on initial rank 1"):
        Tree([Layer(key_or_fn=lambda s: [s.initial_rank])]).local_keys(initial_state(1, 16))
    # A value that is not callable is this rank's own key (computed per rank, as NVRx's users write it).
    assert Tree([Layer(key_or_fn=9 // 2)]).local_keys(initial_state(9, 16)) == ("4",)
    assert FilterCountGroupedByKey(key_or_fn=9 // 2, condition=bool).local_keys(initial_state(9, 16)) == ("4",)


def test_missing_or_malformed_keys_are_refused():
    tree = spares_per_node_tree()
    with pytest.raises(ValueError, match="ctx.topology has no keys"):
        run_job_wide(tree, initial_membership(4), set(), 0, Topology.empty())
    bad = Topology([tree], [[("job",)] * 4])
    with pytest.raises(ValueError, match="expected a tuple of 2 str"):
        run_job_wide(tree, initial_membership(4), set(), 0, bad)


# -- iteration 0 ------------------------------------------------------------------


def test_iteration_zero_keeps_max_ranks_per_node_and_numbers_spares_after():
    m, _ = start(spares_per_node_tree())
    for node in range(NODES):
        base = node * PER_NODE
        assert m.mode[base : base + 8] == [ACTIVE] * 6 + [INACTIVE] * 2
        assert m.active_rank[base : base + 6] == list(range(node * 6, node * 6 + 6))
    assert m.active_world_size == 24 and m.world_size == 32
    # rank == active_rank for active ranks; spares follow in tree order.
    assert [m.rank[r] for r in (6, 7, 14, 15, 22, 23, 30, 31)] == list(range(24, 32))


def test_iteration_zero_groups_interleaved_keys_by_node():
    tree = Tree([Layer(key_or_fn="job"), Layer(max_ranks=3, key_or_fn=lambda s: f"n{s.initial_rank % 2}")])
    m, _ = start(tree, 8)
    # Node n0 holds initial ranks 0,2,4,6: they come first in tree order.
    assert active_of(m) == {0: 0, 2: 1, 4: 2, 1: 3, 3: 4, 5: 5}
    assert m.mode[6] == m.mode[7] == INACTIVE


def test_iteration_zero_spare_node():
    m, _ = start(spare_node_tree())
    assert m.mode[:24] == [ACTIVE] * 24 and m.mode[24:] == [INACTIVE] * 8
    assert m.active_rank[:24] == list(range(24))


def test_iteration_zero_min_ranks_drops_an_undersized_node():
    # 3 nodes of 8 and one of 4 (initial ranks 24..27): min_ranks=8 drops the short one.
    tree = Tree([Layer(key_or_fn="job"), Layer(min_ranks=8, key_or_fn=node_of)])
    m, newly = decide(tree, initial_membership(28), set(), 0, topology_for(tree, 28))
    assert newly == set(range(24, 28))
    assert m.active_world_size == 24 and m.active_rank[:24] == list(range(24))


# -- restarts ------------------------------------------------------------------------


def test_lost_rank_is_replaced_by_a_spare_of_its_node_with_its_exact_rank():
    tree = spares_per_node_tree()
    m0, topo = start(tree)
    m1, newly = decide(tree, m0, {11}, 1, topo)  # node 1, active_rank 9
    assert newly == {11}
    assert m1.mode[14] == ACTIVE and m1.active_rank[14] == 9 and m1.rank[14] == 9
    before = active_of(m0)
    del before[11]
    after = active_of(m1)
    del after[14]
    assert after == before  # nobody else moved
    assert m1.active_world_size == 24 and m1.world_size == 31


def test_lost_top_active_rank_is_replaced_too():
    tree = spares_per_node_tree()
    m0, topo = start(tree)
    m1, _ = decide(tree, m0, {29}, 1, topo)  # the highest active rank, 23
    assert m1.active_rank[30] == 23 and m1.active_world_size == 24


def test_lost_spare_changes_no_active_rank():
    tree = spares_per_node_tree()
    m0, topo = start(tree)
    m1, _ = decide(tree, m0, {14}, 1, topo)
    assert active_of(m1) == active_of(m0)
    assert m1.world_size == 31
    assert [m1.rank[r] for r in (6, 7, 15, 22, 23, 30, 31)] == list(range(24, 31))


def test_spares_of_another_node_are_used_once_a_node_has_none():
    # Job cap 24, node cap 7: nodes 0-2 run 7 ranks and keep 1 spare; node 3 runs 3 and keeps 5.
    tree = Tree([
        Layer(max_ranks=24, key_or_fn="job", flag=RESERVE),
        Layer(max_ranks=7, key_or_fn=node_of, flag=RESERVE),
    ])
    m0, topo = start(tree)
    assert [m0.mode[r] for r in (7, 15, 23)] == [INACTIVE] * 3 and m0.mode[24:32] == [ACTIVE] * 3 + [INACTIVE] * 5
    m1, _ = decide(tree, m0, {0, 1, 2}, 1, topo)  # node 0 loses 3 actives, has 1 spare
    assert m1.active_rank[7] == 0  # its own spare first, for the lowest number
    # Then the first spares in tree order with room: nodes 1 and 2 are full, node 3 is not.
    assert (m1.active_rank[27], m1.active_rank[28]) == (1, 2)
    assert m1.mode[15] == m1.mode[23] == INACTIVE
    assert m1.active_world_size == 24


def test_lost_ranks_without_room_anywhere_shrink_the_world():
    tree = spares_per_node_tree()  # every node already runs max_ranks=6
    m0, topo = start(tree)
    m1, _ = decide(tree, m0, {0, 1, 2}, 1, topo)  # node 0 has 2 spares for 3 gaps
    assert (m1.active_rank[6], m1.active_rank[7]) == (0, 1)
    assert m1.active_world_size == 23
    assert [m1.active_rank[r] for r in range(3, 6)] == [2, 3, 4]  # the third gap closed by shifting


def test_lost_node_is_replaced_by_the_spare_node_rank_for_rank():
    tree = spare_node_tree()
    m0, topo = start(tree)
    m1, newly = decide(tree, m0, set(range(8, 16)), 1, topo)
    assert newly == set(range(8, 16))
    assert [m1.active_rank[r] for r in range(24, 32)] == list(range(8, 16))
    assert [m1.active_rank[r] for r in range(8)] == list(range(8))
    assert [m1.active_rank[r] for r in range(16, 24)] == list(range(16, 24))


def test_lost_node_without_room_shrinks_the_world_by_shifting():
    tree = spares_per_node_tree()  # every node already holds max_ranks=6 active ranks
    m0, topo = start(tree)
    m1, _ = decide(tree, m0, set(range(8, 16)), 1, topo)
    assert m1.active_world_size == 18
    assert [m1.active_rank[r] for r in range(16, 22)] == list(range(6, 12))


def test_everything_lost():
    tree = spares_per_node_tree()
    m0, topo = start(tree)
    m1, newly = decide(tree, m0, set(range(N)), 1, topo)
    assert newly == set(range(N))
    assert m1.world_size == 0 and m1.active_world_size == 0
    d = rank_assignment.decide(tree, m0, set(range(N)), [], 1, 0, topo)
    assert d.abort is None and d.membership.world_size == 0


def test_min_ranks_terminates_a_weakened_node_whole():
    tree = Tree([Layer(max_ranks=24, key_or_fn="job", flag=RESERVE), Layer(min_ranks=7, key_or_fn=node_of)])
    m0, topo = start(tree)
    m1, newly = decide(tree, m0, {2, 5}, 1, topo)  # node 0 keeps 6 < 7
    assert newly == set(range(8))
    # The spare node takes node 0's numbers (first spares in tree order).
    assert [m1.active_rank[r] for r in range(24, 32)] == list(range(8))
    assert m1.active_world_size == 24


def test_reserve_only_at_node_level_never_crosses_nodes():
    tree = Tree([Layer(key_or_fn="job"), Layer(max_ranks=6, key_or_fn=node_of, flag=RESERVE)])
    m0, topo = start(tree)
    m1, _ = decide(tree, m0, {0, 1, 2}, 1, topo)
    assert m1.active_world_size == 23
    assert m1.mode[14] == m1.mode[15] == INACTIVE


def test_backfill_node_moves_the_node_s_highest_rank_into_the_gap():
    tree = Tree([Layer(key_or_fn="job"), Layer(key_or_fn=node_of, flag=BACKFILL)])
    m0, topo = start(tree)
    m1, _ = decide(tree, m0, {10}, 1, topo)  # node 1 holds 8..15
    assert m1.active_rank[15] == 10  # node 1's highest moved into the gap
    assert [m1.active_rank[r] for r in range(8, 15) if r != 10] == [8, 9, 11, 12, 13, 14]
    assert [m1.active_rank[r] for r in range(16, 32)] == list(range(15, 31))  # later nodes shift by one


def test_backfill_root_fills_the_gap_from_the_top_like_fill_gaps():
    tree = Tree([Layer(key_or_fn="job", flag=BACKFILL), Layer(key_or_fn=node_of)])
    m0, topo = start(tree)
    m1, _ = decide(tree, m0, {3}, 1, topo)
    assert m1.active_rank[31] == 3
    assert all(m1.active_rank[r] == r for r in range(31) if r != 3)


def test_spare_first_then_backfill():
    tree = Tree([Layer(key_or_fn="job", flag=BACKFILL), Layer(max_ranks=7, key_or_fn=node_of, flag=RESERVE)])
    m0, topo = start(tree)  # one spare per node
    m1, _ = decide(tree, m0, {1, 2}, 1, topo)  # node 0 has one spare for two gaps
    assert m1.active_rank[7] == 1  # the spare takes the lower number
    assert m1.active_rank[30] == 2  # the job's highest active rank backfills the other
    assert m1.active_world_size == 27


def test_world_size_filter_keeps_a_multiple_and_its_extra_ranks_become_spares():
    tree = Tree([Layer(key_or_fn="job", flag=RESERVE), Layer(key_or_fn=node_of)], world_size_filter=lambda n: n - n % 4)
    m0, topo = start(tree)
    assert m0.active_world_size == 32
    m1, _ = decide(tree, m0, {5}, 1, topo)
    assert m1.active_world_size == 28
    assert [m1.mode[r] for r in (29, 30, 31)] == [INACTIVE] * 3
    # Those three are spares now: the next lost rank is replaced, the world stays 28.
    m2, _ = decide(tree, m1, {0}, 2, topo)
    assert m2.active_world_size == 28 and m2.active_rank[29] == 0


@pytest.mark.parametrize("returned", [33, -1, 2.0, None])
def test_world_size_filter_bad_result_is_refused(returned):
    tree = Tree([Layer(key_or_fn="job")], world_size_filter=lambda n: returned)
    topo = topology_for(tree)
    with pytest.raises(ValueError, match=f"returned {returned!r} for an active world size of 32"):
        decide(tree, initial_membership(N), set(), 0, topo)
    # Through the engine, the error ends the job with a clear message.
    d = rank_assignment.decide(tree, initial_membership(N), set(), [], 0, 0, topo)
    assert d.abort is not None and "world_size_filter" in d.abort


# -- FilterCountGroupedByKey --------------------------------------------------------------


def test_filter_drops_a_whole_node_and_shift_ranks_closes_the_gap():
    filt = FilterCountGroupedByKey(node_of, lambda count: count == PER_NODE)
    ra = Compose(ActivateAllRanks(), ShiftRanks(), filt)
    topo = topology_for(ra)
    m0, _ = decide(ra, initial_membership(N), set(), 0, topo)
    m1, newly = decide(ra, m0, {9}, 1, topo)
    assert newly == set(range(8, 16))
    assert m1.active_world_size == 24 and [m1.active_rank[r] for r in range(16, 32)] == list(range(8, 24))


def test_filter_before_tree_lets_the_spare_node_take_the_dropped_node():
    tree = spare_node_tree()
    filt = FilterCountGroupedByKey(node_of, lambda count: count == PER_NODE)
    ra = Compose(tree, filt)
    topo = topology_for(ra)
    m0, _ = decide(ra, initial_membership(N), set(), 0, topo)
    m1, newly = decide(ra, m0, {9}, 1, topo)
    assert newly == set(range(8, 16))
    assert [m1.active_rank[r] for r in range(24, 32)] == list(range(8, 16))
    assert m1.active_world_size == 24


def test_filter_condition_is_called_once_per_group_with_healthy_counts():
    seen = []
    filt = FilterCountGroupedByKey(node_of, lambda count: seen.append(count) or True)
    ra = Compose(ActivateAllRanks(), ShiftRanks(), filt)
    topo = topology_for(ra)
    decide(ra, Membership.all_active(N), {0, 1, 30}, 1, topo)
    assert seen == [6, 8, 8, 7]


# -- composition -------------------------------------------------------------------


def test_check_composition_accepts_the_documented_orders():
    tree = spares_per_node_tree()
    filt = FilterCountGroupedByKey(node_of, lambda c: c == PER_NODE)
    for ok in (
        tree,
        Compose(tree, filt),
        Compose(ActiveWorldSizeDivisibleBy(4), MaxActiveWorldSize(20), ShiftRanks(), FillGaps(), tree, filt),
        Compose(ActivateAllRanks(), ShiftRanks(), filt),
        Compose(MaxActiveWorldSize(8), FillGaps()),
        Compose(ActivateAllRanks(), ShiftRanks()),
    ):
        check_composition(ok)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda t, f: Compose(t, ShiftRanks()), "ShiftRanks runs before Tree"),
        (lambda t, f: Compose(t, MaxActiveWorldSize(8)), "MaxActiveWorldSize runs before Tree"),
        (lambda t, f: Compose(ActivateAllRanks(), t), "ActivateAllRanks runs after Tree"),
        (lambda t, f: Compose(t, spares_per_node_tree()), "2 Tree instances"),
        (lambda t, f: Compose(f, t), "runs last"),
        (lambda t, f: f, "runs last"),
        (lambda t, f: ShiftRanks(), "ShiftRanks runs after every activation step"),
        (lambda t, f: Compose(ShiftRanks(), ActivateAllRanks()), "ShiftRanks runs after every activation step"),
        (lambda t, f: Compose(ShiftRanks(), f), "ShiftRanks runs after every activation step"),
        (lambda t, f: ActivateAllRanks(), "never removes the ranks that leave"),
    ],
)
def test_check_composition_refuses_what_cannot_work(make, fragment):
    with pytest.raises(ValueError, match="expected") as info:
        check_composition(make(spares_per_node_tree(), FilterCountGroupedByKey(node_of, bool)))
    assert fragment in str(info.value)


def test_tree_refuses_a_table_renumbered_before_it_ran():
    tree = spares_per_node_tree()
    m0, topo = start(tree)
    with pytest.raises(ValueError, match="before Tree ran: expected Tree to run first"):
        decide(Compose(tree, ShiftRanks()), m0, {3}, 1, topo)


def test_simple_algorithms_after_tree_compose_as_documented():
    tree = spares_per_node_tree()
    m0, topo = start(tree)
    plain, _ = decide(tree, m0, {3}, 1, topo)
    for after in (ShiftRanks(), FillGaps()):
        m1, _ = decide(Compose(after, tree), m0, {3}, 1, topo)
        assert m1 == plain  # Tree leaves no gap: nothing to shift or fill
    m1, _ = decide(Compose(MaxActiveWorldSize(20), tree), m0, {3}, 1, topo)
    assert m1.active_world_size == 20 and all(m1.active_rank[r] == plain.active_rank[r] for r in active_of(m1))
    divisible, _ = decide(Compose(ActiveWorldSizeDivisibleBy(16), tree), m0, {3}, 1, topo)
    filtered = spares_per_node_tree(world_size_filter=lambda n: n - n % 16)
    same, _ = decide(filtered, m0, {3}, 1, topology_for(filtered))
    # The same ranks run with the same numbers; only the spares' rank numbers differ.
    assert (divisible.mode, divisible.active_rank) == (same.mode, same.active_rank)


# -- determinism ----------------------------------------------------------------------

_DETERMINISM_SCRIPT = textwrap.dedent(
    """
    import json
    from inprocess import FrozenState
    from inprocess.rank_assignment import Layer, LayerFlag, Topology, Tree, initial_membership, run_job_wide
    names = ["rack%d/node%d" % (r // 16, r // 4) for r in range(64)]
    tree = Tree([Layer(key_or_fn="job", flag=LayerFlag.RESERVE),
                 Layer(key_or_fn=lambda s: names[s.initial_rank].split("/")[0],
                       flag=LayerFlag.RESERVE | LayerFlag.BACKFILL),
                 Layer(max_ranks=3, key_or_fn=lambda s: names[s.initial_rank])])
    topo = Topology([tree], [[tree.local_keys(FrozenState(rank=r, world_size=64)) for r in range(64)]])
    m, _ = run_job_wide(tree, initial_membership(64), set(), 0, topo)
    out = [m.encode()]
    for i, lost in enumerate([{1, 17, 40}, {0, 4, 5, 6, 7}, set(range(20, 33))]):
        m, _ = run_job_wide(tree, m, lost, i + 1, topo)
        out.append(m.encode())
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(60)
def test_same_inputs_same_assignment_across_hash_seeds():
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=50)
        assert res.returncode == 0, res.stderr
        outputs.add(res.stdout)
    assert len(outputs) == 1
    assert len(json.loads(outputs.pop())) == 4


# -- properties -----------------------------------------------------------------------


@st.composite
def scenarios(draw):
    nodes = draw(st.integers(1, 6))
    per_node = draw(st.integers(1, 6))
    n = nodes * per_node
    node_cap = draw(st.one_of(st.none(), st.integers(1, per_node)))
    job_cap = draw(st.one_of(st.none(), st.integers(1, n)))
    node_flag = draw(st.sampled_from([None, RESERVE, BACKFILL, RESERVE | BACKFILL]))
    job_flag = draw(st.sampled_from([None, RESERVE, BACKFILL, RESERVE | BACKFILL]))
    node_min = draw(st.integers(1, per_node))
    divisor = draw(st.sampled_from([None, 1, 2, 3]))
    losses = draw(st.lists(st.sets(st.integers(0, n - 1), max_size=n), min_size=1, max_size=5))
    return nodes, per_node, node_cap, job_cap, node_flag, job_flag, node_min, divisor, losses


def _tree_for(per_node, node_cap, job_cap, node_flag, job_flag, node_min, divisor):
    wsf = None if divisor is None else (lambda a: a - a % divisor)
    return Tree(
        [
            Layer(max_ranks=job_cap, key_or_fn="job", flag=job_flag),
            Layer(min_ranks=node_min, max_ranks=node_cap, key_or_fn=lambda s: f"n{s.initial_rank // per_node}",
                  flag=node_flag),
        ],
        world_size_filter=wsf,
    )


def _room(m: Membership, r: int, per_node: int, node_cap, job_cap) -> bool:
    """Whether spare r could be activated without exceeding a max_ranks."""
    node = r // per_node
    node_active = sum(1 for x in range(len(m.mode)) if x // per_node == node and m.mode[x] == ACTIVE)
    return (node_cap is None or node_active < node_cap) and (job_cap is None or m.active_world_size < job_cap)


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_properties(scenario):
    nodes, per_node, node_cap, job_cap, node_flag, job_flag, node_min, divisor, losses = scenario
    n = nodes * per_node
    tree = _tree_for(per_node, node_cap, job_cap, node_flag, job_flag, node_min, divisor)
    topo = topology_for(tree, n)
    m, _ = decide(tree, initial_membership(n), set(), 0, topo)
    for iteration, lost in enumerate(losses, start=1):
        lost = {r for r in lost if m.mode[r] != TERMINATED}
        prev = m
        m, newly = decide(tree, prev, lost, iteration, topo)
        # validate() ran inside decide: ranks 0..W-1 and active ranks 0..A-1, each once,
        # and terminated ranks stayed terminated. Check them once more, explicitly.
        act = sorted(m.active_rank[r] for r in range(n) if m.mode[r] == ACTIVE)
        assert act == list(range(m.active_world_size))
        assert sorted(m.rank[r] for r in range(n) if m.mode[r] != TERMINATED) == list(range(m.world_size))
        assert all(m.mode[r] == TERMINATED for r in range(n) if prev.mode[r] == TERMINATED)
        assert lost <= newly
        # rank == active_rank for every active rank (Tree's numbering).
        assert all(m.rank[r] == m.active_rank[r] for r in range(n) if m.mode[r] == ACTIVE)
        if node_cap is not None:
            for node in range(nodes):
                assert sum(m.mode[r] == ACTIVE for r in range(node * per_node, (node + 1) * per_node)) <= node_cap
        if divisor not in (None, 1):
            continue
        lost_active = sum(1 for r in newly if prev.mode[r] == ACTIVE)
        survivors_before = prev.active_world_size - lost_active
        if job_flag is not None and job_flag & RESERVE:
            # Spares are used before the world shrinks: a smaller world leaves no spare with room.
            if m.active_world_size < prev.active_world_size:
                assert not any(
                    m.mode[r] == INACTIVE and _room(m, r, per_node, node_cap, job_cap) for r in range(n)
                ), (prev, m)
        if not (node_flag and node_flag & BACKFILL) and not (job_flag and job_flag & BACKFILL):
            if m.active_world_size == prev.active_world_size == survivors_before + lost_active and lost_active:
                # Nothing shrank: every surviving active rank kept its number, and every
                # newly active spare took a number a lost rank held.
                lost_numbers = {prev.active_rank[r] for r in newly if prev.mode[r] == ACTIVE}
                for r in range(n):
                    if m.mode[r] == ACTIVE:
                        if prev.mode[r] == ACTIVE:
                            assert m.active_rank[r] == prev.active_rank[r]
                        else:
                            assert m.active_rank[r] in lost_numbers


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=24),
    st.sets(st.integers(0, 23), max_size=24),
    st.integers(1, 6),
)
def test_filter_properties(groups, lost, keep_at_least):
    n = len(groups)
    lost = {r for r in lost if r < n}
    filt = FilterCountGroupedByKey(lambda s: f"g{groups[s.initial_rank]}", lambda count: count >= keep_at_least)
    ra = Compose(ActivateAllRanks(), ShiftRanks(), filt)
    m, newly = decide(ra, Membership.all_active(n), lost, 1, topology_for(ra, n))
    for g in set(groups):
        members = [r for r in range(n) if groups[r] == g]
        healthy = [r for r in members if r not in lost]
        if len(healthy) < keep_at_least:
            assert all(m.mode[r] == TERMINATED for r in members)
        else:
            assert all(m.mode[r] == ACTIVE for r in healthy)
    assert newly == {r for r in range(n) if m.mode[r] == TERMINATED}
    assert m.rank.count(NONE) == len(newly)
