"""The join protocol's records and the leader's admission, against a real TCPStore in this process:
seat lives, outcomes, announcements, and admit() with every kind of joiner."""

from __future__ import annotations

import datetime
import json
from typing import Any

import pytest
import torch.distributed as dist

from inprocess.control import joining, seats
from inprocess.control.joining import Announcement, JoinKeys, Outcome
from inprocess.control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from inprocess.control.protocol import RestartProtocol
from inprocess.control.records import Decision
from inprocess.exception import InternalError
from inprocess.rank_assignment import ActivateAllRanks, Compose, MaxActiveWorldSize, ShiftRanks, initial_membership
from inprocess.rank_assignment.decision import decide

CONFIG = {"function": "train.main", "initial_world_size": "4", "soft_timeout": "0:01:00"}


@pytest.fixture
def protocol() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
    return RestartProtocol(store, 0, initial_world_size=4)


def keys_of(p: RestartProtocol) -> JoinKeys:
    return JoinKeys(p.counted, p.call, p.incarnation)


def admit(p: RestartProtocol, barrier: int, previous: Membership) -> list[tuple[int, int]]:
    return joining.admit(keys_of(p), barrier, previous, CONFIG, seat_table=p.seat_table,
                         publish_keys=p.topology.publish)


def shrunk(lost: list[int], n: int = 4) -> Membership:
    m = Membership.all_active(n)
    m.terminate(lost)
    return m


@pytest.mark.parametrize("value,parsed", [
    ("3", seats.Seat(3)), ("3@2", seats.Seat(3, 2)), ("t4:m1", seats.Seat(4, 0, "m1")),
    ("t4:self@5", seats.Seat(4, 5, "self")),
])
def test_seat_values_round_trip_and_life_0_keeps_the_old_form(value: str, parsed: seats.Seat) -> None:
    assert seats.parse(value) == parsed
    assert parsed.encode() == value


@pytest.mark.parametrize("value", ["", "x", "3@0", "3@-1", "3@a", "t:m1", "t4", "t4:"])
def test_a_seat_value_the_protocol_never_writes_is_an_internal_error_naming_it(value: str) -> None:
    with pytest.raises(InternalError, match="seat value"):
        seats.parse(value)


def test_before_barrier_is_empty_only_for_the_first_life_at_barrier_0() -> None:
    assert seats.before_barrier(0) == "" and seats.before_barrier(3) == "2"
    assert seats.before_barrier(3, 2) == "2@2"


@pytest.mark.parametrize("value", ["admitted/0a1b2c3d:3:1:2", "refused/ff:seat 9", "gone/1:died: a/b:c",
                                   "closed/x:the job ended"])
def test_outcomes_round_trip(value: str) -> None:
    outcome = Outcome.parse(value)
    assert outcome is not None and outcome.encode() == value


def test_two_writers_of_the_same_outcome_count_the_joiner_resolved_once(protocol: RestartProtocol) -> None:
    """Two live leaders admit the same joiner (a leader taken for lost that was not), two monitors
    withdraw the same one: the same outcome, written twice; the store's compare_set answers both the
    value held, and only the writer whose write it is counts the joiner resolved."""
    p = protocol
    k = keys_of(p)
    for token, seat in (("a", 1), ("b", 2), ("c", 3)):
        k.announce(Announcement(token, seat, "h", seat, CONFIG))
    assert k.waiting() == 3
    first, second = Outcome("admitted", 2, 1, 1), Outcome("admitted", 2, 1, 1)
    assert first == second and first.encode() != second.encode()  # the same outcome, two writes
    with joining.Pipe(p.counted) as pipe:
        assert k.resolve_many([("a", first)], pipe) == [first]
    with joining.Pipe(p.counted) as pipe:
        held = k.resolve_many([("a", second)], pipe)
    assert held == [first] and held[0].by == first.by  # the first write holds
    assert k.waiting() == 2  # counted once: before the writer tag, 1
    assert k.resolve("b", Outcome("gone", why="died")).kind == "gone"
    assert k.resolve("b", Outcome("gone", why="died")).kind == "gone"
    assert k.waiting() == 1


@pytest.mark.parametrize("value", ["maybe:x", "admitted:1:2", "admitted:a:b:c"])
def test_an_outcome_the_protocol_never_writes_is_an_internal_error(value: str) -> None:
    with pytest.raises(InternalError, match="joiner outcome"):
        Outcome.parse(value)


@pytest.mark.parametrize("line", ['{"token":"a/b","seat":1,"host":"h","pid":1,"config":{}}',
                                  '{"token":"a","seat":"1","host":"h","pid":1,"config":{}}',
                                  '{"token":"a","seat":1,"host":"h","pid":1,"config":{"x":1}}',
                                  '{"token":"a","seat":1,"host":"h","pid":1,"config":{},"keys":[[1]]}'])
def test_an_announcement_is_read_strictly(line: str) -> None:
    with pytest.raises((ValueError, KeyError)):
        Announcement.from_json(line)


def test_the_difference_of_two_configurations_names_the_first_entry_that_differs() -> None:
    assert joining.config_difference(CONFIG, dict(CONFIG)) is None
    why = joining.config_difference(CONFIG, {**CONFIG, "soft_timeout": "0:00:30"})
    assert why == "soft_timeout differs: the job has '0:01:00', this process has '0:00:30'"


def test_the_leader_refuses_admits_and_leaves_waiting_as_each_joiner_deserves(protocol: RestartProtocol) -> None:
    p = protocol
    # Seat 2 was counted out at barrier 1 (life 0); seat 3 is held by a running process.
    p.seat_table.write({2: seats.counted_out(1, "m2")})
    k = keys_of(p)
    k.announce(Announcement("unfit", 2, "h", 1, {**CONFIG, "soft_timeout": "0:00:30"}))
    k.announce(Announcement("held", 3, "h", 2, CONFIG))
    k.announce(Announcement("fit", 2, "h", 3, CONFIG, [["node-b"]]))
    k.announce(Announcement("second", 2, "h", 4, CONFIG))
    k.announce(Announcement("outside", 7, "h", 5, CONFIG))
    assert admit(p, 2, shrunk([2])) == [(2, 1)]
    assert k.read_outcome("unfit") == Outcome("refused", why="soft_timeout differs: the job has '0:01:00', "
                                                             "this process has '0:00:30'")
    assert k.read_outcome("fit") == Outcome("admitted", 2, 2, 1)
    assert k.read_outcome("held") is None and k.read_outcome("second") is None  # they wait
    assert "expected 0..3" in k.read_outcome("outside").why  # type: ignore[union-attr]
    assert p.read_seat(2) == "2@1"  # the admitted joiner takes part in iteration 2, seat life 1
    assert '[2,[["node-b"]]]' in (p.counted.peek(p.keys.topology()) or b"").decode()
    # A leader that takes the lead over at the same barrier reads the same admission.
    assert admit(p, 2, shrunk([2])) == [(2, 1)]
    # Every joiner resolved here was told (its told key wakes its wait); "held" and "second" wait on.
    assert k.wait_outcome("fit", 1.0) == Outcome("admitted", 2, 2, 1)
    assert k.wait_outcome("unfit", 1.0).kind == "refused"  # type: ignore[union-attr]
    assert not p.counted.check([k.told_key("held")])
    # Until barrier 2's decision is out, a leader that takes the lead over looks from line 1 ("held") on.
    assert k.read_mark()[1] == joining.ResolvedMark(settled=1, looked=1, barrier=2)
    # The next barrier: the admitted one is done with; "held" and "second" still wait.
    after = shrunk([]).with_joined([])
    assert admit(p, 3, after) == []
    assert k.read_mark()[1] == joining.ResolvedMark(1, 1, 3)  # the refused first line is skipped from now on
    assert [a.token for _, a in k.pending(4)[1]] == ["held", "fit", "second", "outside"]
    assert k.waiting() == 2


def test_a_joiner_withdrawn_first_is_not_admitted_and_an_admitted_one_cannot_be_withdrawn(
        protocol: RestartProtocol) -> None:
    p = protocol
    k = keys_of(p)
    p.seat_table.write({1: seats.counted_out(1, "m1")})
    k.announce(Announcement("early", 1, "h", 1, CONFIG))
    assert k.resolve("early", Outcome("gone", why="died")).kind == "gone"
    k.announce(Announcement("late", 1, "h", 2, CONFIG))
    assert admit(p, 2, shrunk([1])) == [(1, 1)]
    assert k.resolve("late", Outcome("gone", why="died")) == Outcome("admitted", 2, 1, 1)


def lost_seats(p: RestartProtocol, lost: list[int], n: int) -> Membership:
    """A membership of ``n`` seats in which ``lost`` were counted out at barrier 1 (life 0)."""
    for r in lost:
        p.seat_table.write({r: seats.counted_out(1, f"m{r}")})
    return shrunk(lost, n)


@pytest.mark.parametrize(("store_kind", "k"), [("tcp", 1), ("tcp", 2), ("tcp", 3), ("tcp", 16), ("hash", 16),
                                               ("tcp", 200)])
def test_the_leaders_admission_of_k_joiners_costs_2k_plus_9_calls_and_the_next_leader_2(
        store_kind: str, k: int) -> None:
    """The lines and the mark, one check and one multi_get of the k records and seats, the k outcomes'
    compare_sets (pipelined over a connection of their own from 3 on: one call to open it), the told
    values (one multi_set), the resolved counter, the k seats' compare_sets, the mark, and one append
    of the k joiners' topology keys. A store that is no TCPStore (here a HashStore) sends the
    compare_sets one after another: one call less. Past 256 keys, one check and multi_get more per 256
    (200 joiners: 400 records and seats, 2k + 11)."""
    n = 1024
    store = (dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10)) if store_kind == "tcp"
             else dist.HashStore())
    p = RestartProtocol(store, 0, initial_world_size=n)
    keys = keys_of(p)
    lost = list(range(1, 4 * k, 4))
    previous = lost_seats(p, lost, n)
    for r in lost:
        keys.announce(Announcement(f"j{r}", r, "h", r, CONFIG, [[f"node-{r}"]]))
    calls = p.ops
    joined = joining.admit(keys, 2, previous, CONFIG, seat_table=p.seat_table, publish_keys=p.topology.publish)
    pipelined = store_kind == "tcp" and k >= joining.PIPELINE_FROM
    assert joined == [(r, 1) for r in lost]
    reads = 2 * -(-2 * k // joining.KEYS_PER_REQUEST)  # a check and a multi_get per 256 records and seats
    assert p.ops - calls == 2 + reads + (1 if pipelined else 0) + k + 1 + 1 + k + 1 + 1
    assert p.ops - calls == (2 * k + 9 - (0 if pipelined else 1) if k <= 128 else 2 * k + 11)
    topology = [json.loads(line) for line in (p.counted.peek(p.keys.topology()) or b"").decode().splitlines()]
    assert topology == [[r, [[f"node-{r}"]]] for r in lost]
    assert [p.read_seat(r) for r in lost] == ["2@1"] * k
    assert [keys.wait_outcome(f"j{r}", 1.0) for r in lost] == [Outcome("admitted", 2, r, 1) for r in lost]
    assert keys.waiting() == 0
    calls = p.ops
    assert joining.admit(keys, 3, previous.with_joined(joined), CONFIG, seat_table=p.seat_table,
                         publish_keys=p.topology.publish) == []
    assert p.ops - calls == 2


class WithdrawnMeanwhile:
    """The leader's store, on which one joiner's monitor withdraws it (on a connection of its own)
    after the leader read every record pending and before the leader's compare_sets go out."""

    def __init__(self, counted: Any, withdraw: Any):
        self._counted = counted
        self._withdraw = withdraw
        self.withdrawn: Outcome | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._counted, name)

    def compare_set_many(self, items: list[tuple[str, str, str]], pipe: Any = None) -> list[bytes]:
        if self.withdrawn is None:
            self.withdrawn = self._withdraw()
        return list(self._counted.compare_set_many(items, pipe))


def test_a_joiner_withdrawn_while_the_leaders_batched_admission_runs_is_not_admitted_and_its_seat_stays_free(
        protocol: RestartProtocol) -> None:
    p = protocol
    k = keys_of(p)
    previous = lost_seats(p, [1, 2, 3], 4)
    for token, seat in [("a", 1), ("b", 2), ("c", 3), ("d", 2)]:
        k.announce(Announcement(token, seat, "h", 1, CONFIG))
    monitor = RestartProtocol(dist.TCPStore("127.0.0.1", p.counted.raw.port, 1, False,
                                            datetime.timedelta(seconds=10)), 0)
    racing = WithdrawnMeanwhile(p.counted, lambda: keys_of(monitor).resolve("b", Outcome("gone", why="died")))
    joined = joining.admit(JoinKeys(racing, p.call, p.incarnation), 2, previous, CONFIG, seat_table=p.seat_table,
                           publish_keys=p.topology.publish)
    # The withdrawal came first: b is gone, its seat was not moved, and d, which asked for the same
    # seat after b, waits for the next barrier. a and c are admitted.
    assert racing.withdrawn == Outcome("gone", why="died")
    assert joined == [(1, 1), (3, 1)]
    assert k.read_outcome("b") == Outcome("gone", why="died") and k.read_outcome("d") is None
    assert p.read_seat(2) == seats.counted_out(1, "m2") and p.read_seat(1) == p.read_seat(3) == "2@1"
    assert not p.counted.check([k.told_key("b")])  # nobody waits for a withdrawn joiner: it is not told
    assert k.waiting() == 1
    # A withdrawal after the batched admission finds it: the monitor counts that joiner out instead.
    assert keys_of(monitor).resolve("c", Outcome("gone", why="died")) == Outcome("admitted", 2, 3, 1)
    # The next barrier gives b's seat to d.
    assert admit(p, 3, previous.with_joined(joined)) == [(2, 1)]
    assert k.read_outcome("d") == Outcome("admitted", 3, 2, 1) and p.read_seat(2) == "3@1"


class OtherLeaderMeanwhile:
    """Leader A's store: after A read every record and before its compare_sets go out, ``meanwhile``
    runs (another leader of the same barrier, alive too after a false lost mark, on a connection of
    its own)."""

    def __init__(self, counted: Any, meanwhile: Any):
        self._counted = counted
        self._meanwhile = meanwhile
        self.ran: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._counted, name)

    def compare_set_many(self, items: list[tuple[str, str, str]], pipe: Any = None) -> list[bytes]:
        if self.ran is None:
            self.ran = self._meanwhile()
        return list(self._counted.compare_set_many(items, pipe))


@pytest.mark.parametrize("first_withdrawn", [False, True])
def test_two_live_leaders_of_one_barrier_never_admit_two_joiners_into_one_seat(
        protocol: RestartProtocol, first_withdrawn: bool) -> None:
    """Leaders A and B of barrier 2 both run (A was marked lost, falsely). Joiners j1 then j2 ask for
    seat 1. A reads both records pending; then B admits whole; then A writes. Without a withdrawal,
    both admit j1 (the same value: the first writer's record holds, A reads its own value back) and
    j2 waits. With j1 withdrawn before B looks, B admits j2, and A's admission of j1 fails on j1's
    record, so A moves no seat: seat 1 gets one joiner, in one life, whoever decides. The seat's own
    compare_set would not tell the two apart (both write "2@1"); the records' first-writer rule does."""
    p = protocol
    k = keys_of(p)
    previous = lost_seats(p, [1], 4)
    k.announce(Announcement("j1", 1, "h", 1, CONFIG))
    k.announce(Announcement("j2", 1, "h", 2, CONFIG))
    other = RestartProtocol(dist.TCPStore("127.0.0.1", p.counted.raw.port, 1, False,
                                          datetime.timedelta(seconds=10)), 0, initial_world_size=4)

    def leader_b() -> list[tuple[int, int]]:
        if first_withdrawn:
            keys_of(other).resolve("j1", Outcome("gone", why="died"))
        return admit(other, 2, previous)

    racing = OtherLeaderMeanwhile(p.counted, leader_b)
    by_a = joining.admit(JoinKeys(racing, p.call, p.incarnation), 2, previous, CONFIG, seat_table=p.seat_table,
                         publish_keys=p.topology.publish)
    by_b = racing.ran
    assert by_b == [(1, 1)] and p.read_seat(1) == "2@1"
    admitted = [t for t in ("j1", "j2") if (o := k.read_outcome(t)) is not None and o.kind == "admitted"]
    assert len(admitted) == 1
    if first_withdrawn:
        assert admitted == ["j2"] and by_a == [], by_a
        assert k.read_outcome("j1") == Outcome("gone", why="died")
    else:
        assert admitted == ["j1"] and by_a == [(1, 1)], by_a
        assert k.read_outcome("j2") is None  # it waits for a seat of its own
    assert k.read_outcome(admitted[0]) == Outcome("admitted", 2, 1, 1)


def test_a_leader_that_takes_the_lead_over_lists_moves_and_tells_an_admission_its_predecessor_wrote(
        protocol: RestartProtocol) -> None:
    """The leader of barrier 2 wrote an admission and was lost before it moved the seat or told the
    joiner. The joiner's wait still ends (it reads its record when a wait runs out); the leader that
    takes the lead over lists the admission, moves the seat and tells the joiner."""
    p = protocol
    k = keys_of(p)
    previous = lost_seats(p, [1], 4)
    k.announce(Announcement("j", 1, "h", 1, CONFIG))
    admission = Outcome("admitted", 2, 1, 1)
    assert p.counted.compare_set(k.joiner_key("j"), joining.PENDING, admission.encode()).decode() == admission.encode()
    assert k.wait_outcome("j", 0.2) == admission  # not told: found in its record once the wait ran out
    assert admit(p, 2, previous) == [(1, 1)]
    assert p.read_seat(1) == "2@1"
    assert p.counted.peek(k.told_key("j")) == admission.encode().encode()


def test_a_joiner_that_died_before_its_record_is_resolved_and_a_line_without_a_record_is_skipped(
        protocol: RestartProtocol) -> None:
    p = protocol
    k = keys_of(p)
    previous = lost_seats(p, [1, 2], 4)
    # Its monitor withdraws it before its record exists: the withdrawal becomes its record, and its
    # announcement, still on its way, is resolved already when a leader reads it.
    assert k.resolve("dead", Outcome("gone", why="died")) == Outcome("gone", why="died")
    with pytest.raises(InternalError, match="before it announced"):
        k.announce(Announcement("dead", 1, "h", 1, CONFIG))
    p.counted.append(k.lines_key, Announcement("dead", 1, "h", 1, CONFIG).to_json() + "\n")
    # A line without a record (no joiner of this protocol writes one): skipped, with a warning.
    p.counted.append(k.lines_key, Announcement("norecord", 2, "h", 2, CONFIG).to_json() + "\n")
    k.announce(Announcement("fit", 1, "h", 3, CONFIG))
    assert admit(p, 2, previous) == [(1, 1)]
    assert k.read_outcome("dead") == Outcome("gone", why="died") and p.read_seat(2) == seats.counted_out(1, "m2")
    assert k.read_mark()[1] == joining.ResolvedMark(2, 3, 2)  # "fit" (line 2) is looked at again by a takeover


@pytest.mark.parametrize("value", ["", "3", "1:2", "a:b:c", "3:2:1", "-1:2:3"])
def test_a_resolved_mark_the_protocol_never_writes_is_an_internal_error(value: str) -> None:
    with pytest.raises(InternalError, match="joiners.resolved"):
        joining.ResolvedMark.parse(value)


def test_a_resolved_mark_starts_a_later_barrier_past_the_admitted_lines() -> None:
    mark = joining.ResolvedMark.parse("2:5:7")
    assert mark == joining.ResolvedMark(2, 5, 7) and mark.encode() == "2:5:7"
    assert mark.start(7) == 2 and mark.start(8) == 5


def test_the_next_life_follows_the_seats_last_one(protocol: RestartProtocol) -> None:
    p = protocol
    p.seat_table.write({0: seats.counted_out(6, "m0", 2)})
    keys_of(p).announce(Announcement("third", 0, "h", 1, CONFIG))
    assert admit(p, 7, shrunk([0])) == [(0, 3)]
    assert p.read_seat(0) == "7@3"
    p.life = 3
    assert p.take_seat(8, 0)  # the joiner arrives at the next barrier in its own life
    assert p.read_seat(0) == "8@3"


def test_the_end_closes_waiting_joiners_and_says_so_to_later_ones(protocol: RestartProtocol) -> None:
    p = protocol
    k = keys_of(p)
    k.name_running_incarnation()
    k.announce(Announcement("waiting", 1, "h", 1, CONFIG))
    p.finish_job(3)
    assert k.read_outcome("waiting") == Outcome("closed", why="the job ended")
    assert k.running_incarnation() == joining.ENDED  # "ended:" and the (empty) incarnation


def test_a_decision_carries_its_joiners_only_when_it_has_some() -> None:
    m = shrunk([1])
    plain = Decision(2, m, [1], [], 0, 0)
    assert '"joined"' not in plain.to_json()
    joined = Decision(2, m.with_joined([(1, 2)]), [], [], 0, 0, joined=[(1, 2)])
    again = Decision.from_json(joined.to_json().encode())
    assert again.joined == [(1, 2)]
    with pytest.raises(InternalError, match="admitted as a joiner"):
        Membership.all_active(4).with_joined([(1, 1)])


def test_a_joiner_is_ranked_where_its_seat_stands_and_the_ranks_after_it_move_up() -> None:
    m = Membership.all_active(8)
    m.terminate([2, 5])
    for new, r in enumerate(m.alive()):  # as ShiftRanks leaves them: 0 1 3 4 6 7 -> 0..5
        m.rank[r] = m.active_rank[r] = new
    spare = m.with_joined([(5, 1)])
    assert spare.mode[5] == INACTIVE and spare.active_rank[5] == NONE
    assert spare.rank == [0, 1, NONE, 2, 3, 4, 5, 6]  # before seat 6, the first rank above it; 6 and 7 move up
    assert spare.active_rank == [0, 1, NONE, 2, 3, NONE, 4, 5]  # the activation step (ActivateAllRanks) sets these
    spare.validate()  # one rank each, 0..6
    # In a job whose ranks are out of seat order (seats 0, 3, 1 by rank), before the first rank above its seat.
    out_of_order = Membership([ACTIVE, ACTIVE, TERMINATED, ACTIVE], [0, 2, NONE, 1], [0, 2, NONE, 1])
    assert out_of_order.with_joined([(2, 1)]).rank == [0, 3, 1, 2]  # seats 0, 2, 3, 1 by rank
    # Past every rank: last.
    assert shrunk([3]).with_joined([(3, 1)]).rank == [0, 1, 2, 3]


@pytest.mark.parametrize("assignment", [
    Compose(ActivateAllRanks(), ShiftRanks()),
    Compose(MaxActiveWorldSize(6), ActivateAllRanks(), ShiftRanks()),
], ids=["all active", "6 active, 2 spares"])
def test_a_job_grown_back_is_numbered_and_encoded_as_before_its_loss(assignment: Any) -> None:
    n = 8
    first = decide(assignment, initial_membership(n), set(), [], 0, 0)
    assert len(first.membership.encode()) <= 2  # the active ranks, then the spares
    lost = decide(assignment, first.membership, {2, 3}, [], 1, 0)
    assert lost.membership.world_size == n - 2 and len(lost.membership.encode()) > len(first.membership.encode())
    back = decide(assignment, lost.membership.with_joined([(2, 1), (3, 1)]), set(), [], 2, 0)
    assert back.membership == first.membership
    assert back.membership.encode() == first.membership.encode()
