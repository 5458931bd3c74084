"""A restart's record: causes before consequences, and its one-line summary."""

from __future__ import annotations

import pytest

from inprocess.control.protocol import FaultRecord

pytestmark = pytest.mark.timeout(30)


def test_causes_come_first_and_consequences_are_marked():
    from inprocess.engine.restart_record import RestartRecord

    gloo = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4503"
    killed = FaultRecord(0, 2, "killed", "SIGKILL", "rank process 11 died in iteration 2")
    peer_error = FaultRecord(1, 2, "exception", "RuntimeError", gloo)
    own_bug = FaultRecord(3, 2, "exception", "ValueError", "bad batch")
    late = FaultRecord(2, 2, "after_restart", "RuntimeError", "interrupted")
    # The peer's gloo error was recorded first: it is still not a cause.
    record = RestartRecord(2, [peer_error, late, killed, own_bug], 4, [0], detected_ns=1_000_000,
                           aborted_ns=2_000_000, finalized_ns=3_000_000, health_checked_ns=4_000_000,
                           decided_ns=9_000_000, activated=[5])
    assert record.causes == [killed, own_bug]
    assert record.consequences == [peer_error, late]
    # Without a death, a communication error is a cause.
    assert RestartRecord(2, [peer_error], 1, []).causes == [peer_error]
    text = record.summary(active_world_size=3, world_size=4)
    assert text.startswith("restart after iteration 2: cause: rank 0 killed: SIGKILL: rank process 11 died")
    assert "consequences (not causes): rank 1 RuntimeError; rank 2 RuntimeError" in text
    assert "excluded: [0]; spares activated: [5]; now 3 active of 4" in text
    assert text.endswith("(slowest phase: barrier, 5 ms)")


def test_an_own_exception_that_came_out_after_the_restart_is_the_cause_of_the_peers_connection_errors():
    from inprocess.engine.restart_record import RestartRecord

    # Rank 2's exception destroyed its new gloo group; rank 1's first collective failed and
    # requested the restart before rank 2's exception was out of the function.
    closed = FaultRecord(1, 0, "exception", "RuntimeError", "[pair.cc:553] Connection closed by peer [127.0.0.1]:5007")
    reset = FaultRecord(3, 0, "exception", "RuntimeError", "[pair.cc:537] Read error: Connection reset by peer")
    injected = FaultRecord(2, 0, "after_restart", "InjectedException", "injected fault: exception on initial rank 2")
    record = RestartRecord(0, [closed, reset, injected], 3, [])
    assert record.causes == [injected]
    assert record.consequences == [closed, reset]
    assert record.summary(active_world_size=4, world_size=4).startswith(
        "restart after iteration 0: cause: rank 2 exception (out after the restart began): InjectedException: "
        "injected fault")


@pytest.mark.parametrize("first_hand", [
    FaultRecord(0, 0, "killed", "SIGKILL", "rank process 11 died"),
    FaultRecord(0, 0, "exception", "ValueError", "bad batch"),
    FaultRecord(0, 0, "health_check", "HealthCheckError", "device 0 unhealthy"),
], ids=["a_death", "an_own_exception", "another_kind"])
def test_a_late_exception_stays_a_consequence_when_a_first_hand_fault_explains_the_restart(first_hand):
    from inprocess.engine.restart_record import RestartRecord

    closed = FaultRecord(1, 0, "exception", "RuntimeError", "Connection closed by peer")
    late = FaultRecord(2, 0, "after_restart", "ValueError", "raised while the restart was under way")
    late_comm = FaultRecord(3, 0, "after_restart", "DistNetworkError", "Connection reset by peer")
    record = RestartRecord(0, [closed, late, late_comm, first_hand], 4, [])
    assert late in record.consequences and late_comm in record.consequences
    assert first_hand in record.causes


def test_communication_errors_alone_are_their_own_causes():
    from inprocess.engine.restart_record import RestartRecord

    closed = FaultRecord(1, 0, "exception", "RuntimeError", "Connection closed by peer")
    late_comm = FaultRecord(2, 0, "after_restart", "DistNetworkError", "Connection reset by peer")
    record = RestartRecord(0, [closed, late_comm], 2, [])
    assert record.causes == [closed] and record.consequences == [late_comm]
