"""No reverse DNS lookup on the store's path.

torch's TCPStore names every connection it opens or accepts with
``getnameinfo()`` of the peer's address, for its log lines: a reverse DNS
lookup, made on the thread that opens the connection (a rank in
``store.clone``) or accepts it (the server's only thread, which serves no
client meanwhile). An address missing from /etc/hosts (``::ffff:127.0.0.1``
on most machines; any peer's address on a cluster) goes to the resolver, and a
resolver that drops the query stalls that thread for its timeout (5 s by
default, times its attempts). Measured in a network namespace whose resolver
drops every query, torch 2.13 (``tests/test_host_names.py``): the first
connection of a process waits the resolver's timeout; with the redirection
below no query leaves and no connection takes more than a millisecond.

:func:`numeric_host_names` redirects the ``getnameinfo`` that torch's own
libraries call (their global offset table, ``csrc/numeric_host_names.cpp``) to
one that adds ``NI_NUMERICHOST``: the name is the address in numbers, at once.
Only torch's log text changes; every other caller in the process (Python's
socket module, libc itself, other libraries) still resolves names as before.
It is applied once per process, before the process opens or serves a TCPStore:
by :class:`inprocess.store.TCPStore`, by the engine before any store factory,
and by the store host (a process forked from a rank inherits it).
"""

from __future__ import annotations

import logging
import threading

from .. import _native

log = logging.getLogger("inprocess")

# torch's libraries (libtorch_cpu holds the TCPStore, libtorch_python its bindings).
TORCH_LIBRARIES = ("libtorch", "libc10")

_lock = threading.Lock()
_done = False


def numeric_host_names() -> list[str]:
    """Redirect torch's ``getnameinfo`` to the numeric form; once per process.

    Returns the libraries redirected by this call (empty when done before or
    when torch calls no ``getnameinfo``). A failure is logged, not raised: the
    store still works, only with reverse lookups.
    """
    global _done
    with _lock:
        if _done:
            return []
        try:
            libraries = _native.force_numeric_host_names(list(TORCH_LIBRARIES))
        except RuntimeError as e:
            log.warning("torch's store connections keep their reverse DNS lookups (%s): a slow resolver "
                        "can stall them", e)
            libraries = []
        _done = True
        log.debug("no reverse DNS lookup by %s", ", ".join(libraries) or "nothing (torch calls no getnameinfo)")
        return libraries
