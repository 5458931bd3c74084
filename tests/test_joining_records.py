"""The join protocol's records and the leader's admission, against a real TCPStore in this process:
seat lives, outcomes, announcements, and admit() with every kind of joiner."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch.distributed as dist

from inprocess.control import joining, seats
from inprocess.control.joining import Announcement, JoinKeys, Outcome
from inprocess.control.membership import TERMINATED, Membership
from inprocess.control.protocol import RestartProtocol
from inprocess.control.records import Decision
from inprocess.exception import InternalError

CONFIG = {"function": "train.main", "initial_world_size": "4", "soft_timeout": "0:01:00"}


@pytest.fixture
def protocol() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
    return RestartProtocol(store, 0, initial_world_size=4)


def keys_of(p: RestartProtocol) -> JoinKeys:
    return JoinKeys(p.counted, p.call, p.incarnation)


def admit(p: RestartProtocol, barrier: int, previous: Membership) -> list[tuple[int, int]]:
    return joining.admit(keys_of(p), barrier, previous, CONFIG, seat_key=p.seat_key, publish_keys=p.publish_local_keys)


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


@pytest.mark.parametrize("value", ["admitted:3:1:2", "refused:seat 9", "gone:died", "closed:the job ended"])
def test_outcomes_round_trip(value: str) -> None:
    outcome = Outcome.parse(value)
    assert outcome is not None and outcome.encode() == value


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
    p.counted.set(p.seat_key(2), seats.counted_out(1, "m2"))
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
    assert '[2,[["node-b"]]]' in (p.counted.peek(p.job_key("topology")) or b"").decode()
    # A leader that takes the lead over at the same barrier reads the same admission.
    assert admit(p, 2, shrunk([2])) == [(2, 1)]
    # The next barrier: the admitted one is done with; "held" and "second" still wait.
    after = shrunk([]).with_joined([])
    assert admit(p, 3, after) == []
    assert k.pending()[0] == 1  # the refused first line is skipped from now on
    assert [a.token for _, a in k.pending()[1]] == ["held", "fit", "second", "outside"]


def test_a_joiner_withdrawn_first_is_not_admitted_and_an_admitted_one_cannot_be_withdrawn(
        protocol: RestartProtocol) -> None:
    p = protocol
    k = keys_of(p)
    p.counted.set(p.seat_key(1), seats.counted_out(1, "m1"))
    k.announce(Announcement("early", 1, "h", 1, CONFIG))
    assert k.resolve("early", Outcome("gone", why="died")).kind == "gone"
    k.announce(Announcement("late", 1, "h", 2, CONFIG))
    assert admit(p, 2, shrunk([1])) == [(1, 1)]
    assert k.resolve("late", Outcome("gone", why="died")) == Outcome("admitted", 2, 1, 1)


def test_the_next_life_follows_the_seats_last_one(protocol: RestartProtocol) -> None:
    p = protocol
    p.counted.set(p.seat_key(0), seats.counted_out(6, "m0", 2))
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
    with_spare = m.with_joined([(1, 2)])
    assert with_spare.mode[1] != TERMINATED and with_spare.rank[1] == 3  # ranked after every rank in the job
    with pytest.raises(InternalError, match="admitted as a joiner"):
        Membership.all_active(4).with_joined([(1, 1)])
