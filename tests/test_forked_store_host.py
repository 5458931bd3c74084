"""The store host forked from the rank: fast, and holding nothing of the rank's."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch.distributed as dist

from inprocess.processes import store_host
from inprocess.processes.contract import StoreHostConfig
from inprocess.processes.forked import fork_helper

pytestmark = pytest.mark.multiprocess


def test_the_forked_store_host_serves_at_once_and_holds_none_of_the_ranks_descriptors() -> None:
    rank_connection = socket.socket()  # stands for a rank's gloo pair or a user's store client
    rank_connection.bind(("127.0.0.1", 0))
    rank_connection.listen()
    start = time.monotonic()
    host = fork_helper(StoreHostConfig(port=0, world_size=1, idle_timeout_s=30.0, parent_pid=os.getpid()),
                       store_host.serve, ready_timeout_s=30.0, name="inprocess-store")
    try:
        started_s = time.monotonic() - start
        client = dist.TCPStore("127.0.0.1", int(host.ready), None, False, datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        with open(f"/proc/{host.pid}/comm") as f:
            assert f.read().strip() == "inprocess-store"
        inodes = set()
        for fd in os.listdir(f"/proc/{host.pid}/fd"):
            try:
                inodes.add(os.readlink(f"/proc/{host.pid}/fd/{fd}"))
            except OSError:
                pass
        mine = os.readlink(f"/proc/self/fd/{rank_connection.fileno()}")
        assert mine not in inodes, "the store host holds a descriptor of the rank"
        # No import of torch on the way: well under the second a fresh interpreter takes.
        assert started_s < 5.0
        del client
    finally:
        status = host.stop()
        rank_connection.close()
    assert status == 0  # SIGTERM is a stop request it honours
    assert host.poll() == 0


def test_a_forked_store_host_that_cannot_serve_says_why_and_is_reaped() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match=f"cannot serve on port {port}"):
            fork_helper(StoreHostConfig(port=port, world_size=1, idle_timeout_s=30.0), store_host.serve,
                        ready_timeout_s=30.0, name="inprocess-store")
    finally:
        taken.close()
