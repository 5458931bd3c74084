"""The leader's ``joining.admit`` alone: K pending joiners of a 16,384-seat job, against a real TCPStore.

Where the time of a restart that admits joiners goes at the leader: the
library's own ``admit`` (``inprocess/control/joining.py``) runs on one client
connection against a TCPStore server (libuv, in this process's own server
thread: the same round trips a leader makes, without 16,384 other ranks),
for K joiners announced for K counted-out seats; then the next barrier's
``admit`` (nothing new to admit) and the one after. Per call: store calls
(``RestartProtocol.ops``: a pipelined compare_set counts as one, though K
of them share a round trip), milliseconds, and milliseconds per call.

``python benchmarks/join_admit.py --joiners 16 64 256 1024`` prints a table
and one JSON line; ``--smoke`` measures 16 joiners only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

N = 16384
CONFIG = {"function": "benchmark.train"}


def measure(k: int, call: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from inprocess.control import joining, seats
    from inprocess.control.membership import TERMINATED, Membership
    from inprocess.control.protocol import RestartProtocol
    from inprocess.control.records import HOST

    client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=True,
                           timeout=datetime.timedelta(seconds=60))
    p = RestartProtocol(client, call)
    keys = joining.JoinKeys(p.counted, call, p.incarnation)
    keys.name_running_incarnation()
    previous = Membership.all_active(N)
    lost = [r * (N // k) + 1 for r in range(k)]
    for r in lost:
        previous.mode[r] = TERMINATED
    p.seat_table.write({r: seats.counted_out(1, f"m{r}") for r in lost})
    for r in lost:
        keys.announce(joining.Announcement(f"{HOST}-bench-{call}-{r}", r, HOST, r, CONFIG, None))
    out: dict[str, Any] = {"joiners": k}
    membership = previous
    for barrier, name in [(2, "admitting"), (3, "next"), (4, "after")]:
        ops = p.ops
        t = time.perf_counter()
        joined = joining.admit(keys, barrier, membership, CONFIG, seat_table=p.seat_table,
                               publish_keys=p.topology.publish)
        elapsed = time.perf_counter() - t
        if barrier == 2 and len(joined) != k:
            raise RuntimeError(f"{len(joined)} of {k} joiners admitted")
        if barrier > 2 and joined:
            raise RuntimeError(f"barrier {barrier} admitted {joined[:3]}... again")
        if joined:
            membership = membership.with_joined(joined)
        out[f"{name}_ms"] = 1e3 * elapsed
        out[f"{name}_calls"] = p.ops - ops
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/join_admit.py", description=__doc__.split("\n")[0])
    ap.add_argument("--joiners", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--smoke", action="store_true", help="16 joiners only: checks that it works, in seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.joiners = [16]
    for k in args.joiners:
        if not 1 <= k <= N // 2:
            ap.error(f"--joiners {k}: expected 1..{N // 2}")
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    rows = [measure(k, call, server.port) for call, k in enumerate(args.joiners)]
    head = ("joiners", "admit ms", "admit calls", "us/call", "next barrier ms", "next calls", "after calls")
    lines = [head] + [(str(r["joiners"]), f"{r['admitting_ms']:.1f}", str(r["admitting_calls"]),
                       f"{1e3 * r['admitting_ms'] / r['admitting_calls']:.0f}", f"{r['next_ms']:.1f}",
                       str(r["next_calls"]), str(r["after_calls"])) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
    print(json.dumps({"benchmark": "join_admit", "n": N, "load_average": os.getloadavg()[0], "results": rows},
                     separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
