"""Runs a scenario inside a network and mount namespace whose resolver drops queries.

    unshare -rnm python tests/workers/netns_resolver.py SCENARIO WORKDIR [DROP_EVERY]

Inside the namespace (made by the caller, ``unshare -rnm``): loopback up,
/etc/resolv.conf bind-mounted to one naming 127.0.0.1 as the only nameserver
(``timeout:2 attempts:1``: a dropped query costs 2 s), /etc/hosts to the
machine's without its ``::ffff:...`` lines (so that torch's reverse lookup of its peers goes
to that nameserver). The nameserver is a UDP socket of this script: it counts
every query, drops one in DROP_EVERY (1: all) and answers the others at once
with NXDOMAIN, as a resolver does that loses a packet now and then.

Scenarios (the last line printed is a JSON object):

* ``torch_store``: torch's TCPStore as it is, a server and 12 client connections;
* ``inprocess_store``: :class:`inprocess.store.TCPStore` (a store host forked
  from this process) and 12 connections cloned from it;
* ``soak``: the 4-rank DDP job of ``tests/workers/ddp_worker.py`` with 20
  exception faults in a row (one restart each); what every rank saw.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from typing import Any

CONNECTIONS = 12


class DroppingNameserver:
    """127.0.0.1:53 over UDP: counts queries, drops one in ``drop_every``, refuses the rest."""

    def __init__(self, drop_every: int):
        self.drop_every = drop_every
        self.queries = 0
        self.dropped = 0
        self.names: dict[str, int] = {}  # queried name -> count
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 53))
        threading.Thread(target=self._serve, name="nameserver", daemon=True).start()

    def _serve(self) -> None:
        while True:
            query, peer = self.sock.recvfrom(4096)
            self.queries += 1
            name = question_name(query)
            self.names[name] = self.names.get(name, 0) + 1
            if self.queries % self.drop_every == 0:
                self.dropped += 1
                continue
            if len(query) >= 12:
                # Same id; QR=1, RD, RA, RCODE=3 (NXDOMAIN); the question echoed, no answer.
                self.sock.sendto(query[:2] + b"\x81\x83" + query[4:6] + b"\0\0\0\0\0\0" + query[12:], peer)


def question_name(query: bytes) -> str:
    """The name a DNS query asks about (its first question), or "?" if it cannot be read."""
    labels, at = [], 12
    while at < len(query) and query[at] != 0:
        length = query[at]
        labels.append(query[at + 1:at + 1 + length].decode("ascii", "replace"))
        at += 1 + length
    return ".".join(labels) or "?"


def isolate_name_service(workdir: pathlib.Path) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    resolv = workdir / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\noptions timeout:2 attempts:1\n")
    # The machine's own entries (its host name: gloo looks it up forward), without any for the
    # IPv4-mapped loopback: torch's reverse lookup of ::ffff:127.0.0.1 must reach the nameserver.
    kept = [line for line in pathlib.Path("/etc/hosts").read_text().splitlines()
            if not line.split("#")[0].split()[:1] or not line.split()[0].lower().startswith("::ffff:")]
    hosts = workdir / "hosts"
    hosts.write_text("\n".join(kept) + "\n")
    subprocess.run(["mount", "--bind", str(resolv), "/etc/resolv.conf"], check=True)
    subprocess.run(["mount", "--bind", str(hosts), "/etc/hosts"], check=True)
    if os.path.isdir("/var/run/nscd"):
        # A name service cache daemon outside the namespace would answer instead of our nameserver.
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/var/run/nscd"], check=True)


def timed_connections(connect: Any) -> list[float]:
    times = []
    for _ in range(CONNECTIONS):
        t0 = time.monotonic()
        client = connect()
        client.check(["nothing"])  # a round trip: the server has taken the connection
        times.append(time.monotonic() - t0)
    return times


def torch_store() -> dict[str, Any]:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=30)
    t0 = time.monotonic()
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    first = time.monotonic() - t0
    times = timed_connections(lambda: dist.TCPStore("127.0.0.1", server.port, None, False, timeout))
    return {"connect_s": [first, *times]}


def inprocess_store() -> dict[str, Any]:
    import inprocess.store  # imports torch: not part of what is timed

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    t0 = time.monotonic()
    store = inprocess.store.TCPStore(timeout=datetime.timedelta(seconds=30))
    first = time.monotonic() - t0
    try:
        times = timed_connections(lambda: inprocess.store.clone(store, None, {}))
    finally:
        assert store.host_process is not None
        store.host_process.stop()
    return {"connect_s": [first, *times]}


def soak(workdir: pathlib.Path) -> dict[str, Any]:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from conftest import run_job  # tests/conftest.py: the job harness every multi-process test uses

    faults = [{"iteration": i, "rank": i % 4, "step": 1 + i % 3, "kind": "exception"} for i in range(20)]
    # Twenty faults of one shape on purpose: the name lookups of twenty restarts, not the storm brake's back-off.
    res = run_job(workdir, {"steps": 4, "faults": faults, "time_clones": True}, world_size=4, timeout=150.0,
                  env={"INPROCESS_RESTART_STORM": "off"})
    return {"returncodes": res.returncodes, "ranks": res.logs, "output": res.describe()[-4000:]}


def main() -> int:
    scenario, workdir = sys.argv[1], pathlib.Path(sys.argv[2])
    drop_every = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    isolate_name_service(workdir)
    nameserver = DroppingNameserver(drop_every)
    if scenario == "torch_store":
        result = torch_store()
    elif scenario == "inprocess_store":
        result = inprocess_store()
    elif scenario == "soak":
        result = soak(workdir)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}: expected torch_store, inprocess_store or soak")
    result.update(queries=nameserver.queries, dropped=nameserver.dropped, names=nameserver.names)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
