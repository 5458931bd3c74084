"""Releasing the gloo collectives of a failed iteration without making any send fail.

Why (torch 2.13's gloo, tcp transport): a pair fails when a read returns end
of file or an error, and then wakes every buffer waiting on it, except the
unbound buffers whose send sits in the pair's transmit queue: those waits
end only at the process group's timeout. A send is queued there when its
write fails (EPIPE and ECONNRESET do not fail an asynchronous write: the op
is queued and the read side is left to report the error) or would block.
Shutting the sockets down for writing, or closing them, therefore strands
every send issued between the break and the moment the pair's loop reads
the end of file, including the send the loop itself starts when it reads a
peer's "ready to receive" notice still queued before that end of file. gdb
on a rank stuck 30 s showed exactly that: the pair closed, its exception
set, and in its transmit queue one unbound send with nothing written, whose
buffer was the one the ring allreduce waited on.

So no write may fail. Per connected socket of the failed iteration's groups:

1. hold: a second descriptor keeps the socket open after gloo closes its
   own, so the peer's writes keep succeeding;
2. once the socket is quiet: nothing this rank wrote still waits to be
   sent, nothing received is unread, and no data went either way for
   ``quiet_ms`` (bounded by ``gate_s``): ``shutdown(SHUT_RD)``. This rank's
   gloo loop reads what is queued, then end of file: the pair fails and
   wakes its waiters, while this rank's own sends still go out. Waiting for
   quiet lets a message that is being sent or read finish first: gloo does
   not wake the buffer of a message cut by the end of file either (seen
   here: a 256 MB recv cut that way waited for the group's timeout);
3. once gloo has closed its descriptor: read and drop whatever the peer
   still sends, so that its writes never block;
4. close the hold when the peer closed its end, or at :meth:`close_all`
   (called before this rank creates its next process group: every peer has
   then passed the restart barrier and destroyed the failed groups).

What it cannot prevent: a peer that is dead has closed its end already (a
send to it may still be stranded until the timeout), and a message still
being read when the gate gives up, or whose sender stalled for longer than
``quiet_ms`` in its middle, is cut by the end of file.

Nor can it release a rank still inside gloo's full-mesh connect
(``init_process_group``, ``connectFullMesh``), found by the chaos runner:
the addresses travel through the iteration's store, whose connections the
restart shuts down (that wait ends), but a pair whose peer died after
publishing its address waits for the handshake inside gloo, in C++ without
the GIL, until the group's timeout. None of its sockets is connected yet
(nothing here to shut down) and the main thread's interrupt is delivered
only once the call returns. The rank's hard timeout bounds it (its monitor
kills it and counts it out); a short ``timeout=`` to
``init_process_group`` bounds it sooner.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

from . import sockets

log = logging.getLogger("inprocess")


@dataclasses.dataclass
class _Held:
    fd: int  # the owner's descriptor
    ident: str  # "socket:[inode]"
    hold: int  # our descriptor of the same socket
    shut_by: float  # monotonic deadline for shutting the read side down
    shut: bool = False


class ConnectionRelease:
    """Holds, shuts and drains the connections of a failed iteration (see the module)."""

    def __init__(self, gate_s: float = 2.0, quiet_ms: int = 3, busy_poll_s: float = 0.001,
                 idle_poll_s: float = 0.02):
        if gate_s < 0 or quiet_ms < 0 or busy_poll_s <= 0 or idle_poll_s < busy_poll_s:
            raise ValueError(f"gate_s={gate_s}, quiet_ms={quiet_ms}, busy_poll_s={busy_poll_s}, "
                             f"idle_poll_s={idle_poll_s}: expected gate_s >= 0, quiet_ms >= 0 and "
                             "0 < busy_poll_s <= idle_poll_s")
        self._gate_s = gate_s
        self._quiet_ms = quiet_ms
        self._busy_poll_s = busy_poll_s
        self._idle_poll_s = idle_poll_s
        self._lock = threading.Lock()
        self._held: list[_Held] = []
        self._thread: threading.Thread | None = None

    def release(self, connections: dict[int, str]) -> int:
        """Hold every connected socket of connections (fd -> identity) and shut the read
        side of those that are quiet now, the others as soon as they are (see the module).
        Returns how many sockets are being released."""
        deadline = time.monotonic() + self._gate_s
        added = []
        for fd, ident in connections.items():
            hold = sockets.hold_connected(fd, ident)
            if hold is None:
                continue  # closed already, not connected, or a listener
            h = _Held(fd, ident, hold, deadline)
            if self._quiet(hold):
                sockets.shutdown_read(hold)
                h.shut = True
            added.append(h)
        with self._lock:
            self._held.extend(added)
            if added and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="inprocess-gloo-release", daemon=True)
                self._thread.start()
        deferred = sum(1 for h in added if not h.shut)
        log.debug("releasing %d connections (%d wait until they are quiet)", len(added), deferred)
        return len(added)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def close_all(self) -> int:
        """Close every hold (the peers' sends to this rank are over). Returns how many."""
        with self._lock:
            held, self._held = self._held, []
        for h in held:
            _close(h)
        return len(held)

    def _quiet(self, fd: int) -> bool:
        return (sockets.unsent_bytes(fd) == 0 and sockets.unread_bytes(fd) == 0
                and sockets.quiet_ms(fd) >= self._quiet_ms)

    def _run(self) -> None:
        idle = self._busy_poll_s
        while True:
            with self._lock:
                if not self._held:
                    self._thread = None
                    return
                busy = self._step(time.monotonic())
            idle = self._busy_poll_s if busy else min(idle * 2, self._idle_poll_s)
            time.sleep(idle)

    def _step(self, now: float) -> bool:
        """One pass over the holds (lock held); True while something is still moving."""
        busy = False
        keep = []
        for h in self._held:
            if not h.shut:
                if self._quiet(h.hold) or now >= h.shut_by:
                    if now >= h.shut_by:
                        log.debug("%s: not quiet after %gs, shut anyway", h.ident, self._gate_s)
                    sockets.shutdown_read(h.hold)
                    h.shut = True
                busy = True
                keep.append(h)
            elif sockets.identity(h.fd) == h.ident:
                keep.append(h)  # gloo still owns it: its loop is reading up to the end of file
                busy = True
            elif sockets.discard_input(h.hold) > 0:
                keep.append(h)
                busy = True
            elif sockets.peer_closed(h.hold):
                _close(h)
            else:
                keep.append(h)
        self._held = keep
        return busy


def _close(h: _Held) -> None:
    try:
        os.close(h.hold)
    except OSError:
        pass
