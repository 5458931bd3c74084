"""One rank of the stranded-send scenario (tests/test_gloo_release.py); 2 ranks, gloo.

Rank 0 (the sender) posts an isend of SEND_MB to rank 1 before rank 1 posts
the matching recv, tells the test, and waits on the send. The test stops it
(SIGSTOP). Rank 1 (the receiver) then posts its irecv, so that the "ready to
receive" notice reaches the stopped sender's socket unread, and releases its
own connections the way RELEASE says:

* ``hold``: inprocess's abort path (pg_tracker.release_connections);
* ``shutdown``: shutdown(SHUT_RDWR) of every socket the group opened (what
  inprocess did before), the control that reproduces the stranded send.

The test then resumes the sender: its gloo loop reads the notice and starts
the send on a connection whose peer has released it. Rank 0 writes
OUT/sender.json with how long its wait on the send took and how it ended.
Rank 1 writes OUT/receiver.json once its pair failed, then stays alive
until the test ends it (its held connections must outlive the send).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import time

import torch
import torch.distributed as dist

from inprocess.control.host_names import numeric_host_names
from inprocess.engine import pg_tracker, sockets

OUT = pathlib.Path(os.environ["OUT"])
RELEASE = os.environ["RELEASE"]
SEND_MB = int(os.environ.get("SEND_MB", "64"))
GLOO_TIMEOUT_S = float(os.environ.get("GLOO_TIMEOUT_S", "30"))
RANK = int(os.environ["RANK"])


def wait_for(name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (OUT / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} within {timeout}s")
        time.sleep(0.01)


def write(name: str, value: object) -> None:
    tmp = OUT / f".{name}"
    tmp.write_text(json.dumps(value))
    tmp.rename(OUT / name)


def main() -> None:
    if RELEASE not in ("hold", "shutdown"):
        raise ValueError(f"RELEASE={RELEASE!r}: expected 'hold' or 'shutdown'")
    pg_tracker.install()
    numeric_host_names()  # the env:// store of rank 0 names its peers without asking the resolver, as ranks do
    before = sockets.socket_fds()
    dist.init_process_group("gloo", rank=RANK, world_size=2, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    group_sockets = sockets.new_since(before)
    tensor = torch.ones(SEND_MB * (1 << 20) // 4)
    dist.barrier()
    if RANK == 0:
        work = dist.isend(tensor, dst=1)
        write("sender_posted", True)
        t0 = time.monotonic()
        try:
            completed = work.wait()
            outcome = "completed" if completed else "aborted"
        except RuntimeError as e:
            outcome = f"error: {e}"[:300]
        write("sender.json", {"wait_s": time.monotonic() - t0, "outcome": outcome})
        return
    wait_for("sender_stopped")
    work = dist.irecv(tensor, src=0)
    if RELEASE == "hold":
        released = pg_tracker.release_connections()
    else:
        released = sockets.shutdown_connected(group_sockets)[0]
    try:
        work.wait()
        outcome = "completed"
    except RuntimeError as e:
        outcome = f"error: {e}"[:300]
    write("receiver.json", {"released": released, "outcome": outcome})
    wait_for("done", timeout=300)


if __name__ == "__main__":
    main()
