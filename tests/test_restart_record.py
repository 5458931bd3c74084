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
