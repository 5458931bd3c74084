"""Which sockets belong to a process group: those accepted by an older listener do not."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.timeout(30)


def test_a_socket_accepted_by_an_older_listener_is_not_the_new_groups():
    """A TCPStore server living in the process accepts clients at any time: a
    connection it accepts while a process group is built belongs to the store."""
    from inprocess.engine import sockets

    store_server = socket.socket()
    store_server.bind(("127.0.0.1", 0))
    store_server.listen()
    before = sockets.socket_fds()
    client = socket.create_connection(store_server.getsockname())  # a peer's store client
    accepted, _ = store_server.accept()  # what the server thread does meanwhile
    group_listener = socket.socket()  # the new group's own listener and pair
    group_listener.bind(("127.0.0.1", 0))
    group_listener.listen()
    pair = socket.create_connection(group_listener.getsockname())
    pair_accepted, _ = group_listener.accept()
    try:
        new = sockets.new_since(before)
        assert {client.fileno(), accepted.fileno(), group_listener.fileno(), pair.fileno(),
                pair_accepted.fileno()} <= set(new)
        assert set(sockets.accepted_by_older_listeners(new, before)) == {accepted.fileno()}
    finally:
        for s in (store_server, client, accepted, group_listener, pair, pair_accepted):
            s.close()


def test_a_socket_closed_by_its_owner_meanwhile_is_skipped_not_an_error():
    """gloo's and a store's threads close their sockets at any moment, also between the
    listing of /proc/self/fd and the look at each socket: that socket is skipped.
    (socket.socket(fileno=closed) raises EBADF; that OSError once came out of a rank's
    init_process_group.)"""
    from inprocess.engine import sockets

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    before = sockets.socket_fds()
    pair = socket.create_connection(listener.getsockname())
    new = sockets.new_since(before)
    closed_fd = pair.fileno()
    assert closed_fd in new
    pair.close()  # closed after the listing, before the look
    try:
        assert sockets.accepted_by_older_listeners(new, before) == {}
        before[closed_fd] = new[closed_fd]  # and a closed one among the older listeners' candidates
        assert sockets.accepted_by_older_listeners({}, before) == {}
    finally:
        listener.close()
