"""The native heartbeat page: private, nameless, refuses what is not a page."""

from __future__ import annotations

import os
import stat

import pytest

from inprocess import _native

pytestmark = pytest.mark.timeout(30)


# -- the heartbeat page -------------------------------------------------------


def test_heartbeat_page_is_private_and_nameless():
    before = set(os.listdir("/dev/shm"))
    hb = _native.HeartbeatPage.create()
    try:
        mode = os.fstat(hb.fd).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert set(os.listdir("/dev/shm")) == before  # memfd: nothing to leak
        snap = hb.snapshot()
        assert not snap.flags & _native.FLAG_MANUAL_ARMED
        hb.ping()
        assert hb.snapshot().flags & _native.FLAG_MANUAL_ARMED
        assert hb.snapshot().manual_progress_ns >= snap.manual_progress_ns
        hb.begin_iteration(3, 7)
        s = hb.snapshot()
        assert (s.iteration, s.world_size) == (3, 7) and not s.flags & _native.FLAG_MANUAL_ARMED
        other = _native.HeartbeatPage.attach(hb.fd)
        hb.set_phase(_native.Phase.RUNNING)
        assert other.snapshot().phase == _native.Phase.RUNNING
        other.close()
    finally:
        hb.close()
    assert hb.closed


def test_attach_refuses_a_descriptor_that_is_not_a_page(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 4096)
    with open(f, "rb+") as fh:
        with pytest.raises(ValueError, match="holds no inprocess heartbeat page"):
            _native.HeartbeatPage.attach(fh.fileno())
