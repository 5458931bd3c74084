"""How long the lead takes to pass on when a barrier's leader is lost before its decision.

Over a TCPStore on 127.0.0.1, per sample a fresh call: N ranks (threads, one
connection each) arrive at barrier 1; rank 0 arrives first, so it leads, and
never decides (as if killed right then). Its monitor, over the torch-free
client that monitor processes use, counts it out with ``count_out``, which
ends rank 0's term with a lost mark (``inprocess.control.leadership``). A
sample is the time from that call to the moment the last of the other ranks
holds the decision, which one of them took over::

    python benchmarks/takeover_latency.py --ranks 8 --samples 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import threading
import time

import torch.distributed as dist

from inprocess.compose import Compose
from inprocess.control import seat_table
from inprocess.control.counting_out import count_out
from inprocess.control.membership import Membership
from inprocess.control.protocol import TERMINATED_UNIT, Decision, FaultRecord, RestartProtocol
from inprocess.control.tcpstore_client import TCPStoreClient
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide

TIMEOUT_S = 10.0


def one_takeover(server: dist.TCPStore, call: int, n: int) -> float:
    """Milliseconds from the monitor's count_out to the last rank holding barrier 1's decision."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)

    def protocol() -> RestartProtocol:
        return RestartProtocol(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout), call)

    setup = RestartProtocol(server, call)
    setup.publish_decision(Decision(0, Membership.all_active(n), [], [], 0, leader=0))  # as barrier 0 left it
    seeded = seat_table.seeded(setup.prefix, 1, {r: "0" for r in range(n)})
    server.multi_set(list(seeded), list(seeded.values()))
    assignment = Compose(ActivateAllRanks(), ShiftRanks())

    def decide_fn(dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
        return decide(assignment, Membership.all_active(n), dead, faults, 1, leader)

    protocol().arrive(1, 0, n)  # rank 0 first: the leader, lost before it decides
    got: dict[int, tuple[int, Decision]] = {}

    def rank(r: int, p: RestartProtocol) -> None:
        decision = p.barrier(1, r, n, decide=decide_fn, timeout=TIMEOUT_S)
        got[r] = (time.monotonic_ns(), decision)

    threads = [threading.Thread(target=rank, args=(r, protocol())) for r in range(1, n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + TIMEOUT_S
    while server.add(setup.key(1, "arrivals"), 0) & (TERMINATED_UNIT - 1) < n:  # every rank waits
        if time.monotonic() > deadline:
            raise SystemExit("the ranks did not arrive")
        time.sleep(0.005)
    monitor = RestartProtocol(TCPStoreClient("127.0.0.1", server.port, timeout=TIMEOUT_S), call)

    def fault(iteration: int) -> FaultRecord:
        return FaultRecord(0, iteration, "killed", "SIGKILL", "the leader, lost before its decision")

    start = time.monotonic_ns()
    if count_out(monitor, 0, fault, lambda barrier: n, timeout=TIMEOUT_S, who="m0") != 1:
        raise SystemExit("the leader was not counted out at barrier 1")
    for t in threads:
        t.join(TIMEOUT_S)
    monitor.store.close()
    if len(got) != n - 1:
        raise SystemExit(f"{n - 1 - len(got)} ranks got no decision")
    decisions = {d.to_json() for _, d in got.values()}
    first = next(iter(got.values()))[1]
    if len(decisions) != 1 or first.term != 1 or first.terminated != [0]:
        raise SystemExit(f"expected one decision of term 1 without rank 0, got {sorted(decisions)}")
    return (max(t for t, _ in got.values()) - start) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="3 samples of 4 ranks, to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.samples = 4, 3
    if args.ranks < 2 or args.samples < 1:
        raise SystemExit(f"--ranks={args.ranks}, --samples={args.samples}: expected >= 2 and >= 1")
    logging.getLogger("inprocess").setLevel(logging.ERROR)  # each waiting rank warns of the lost leader
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                           wait_for_workers=False)
    ms = sorted(one_takeover(server, call, args.ranks) for call in range(args.samples))
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    print(f"{args.ranks} ranks, {args.samples} takeovers: median {statistics.median(ms):.2f} ms, "
          f"p90 {p90:.2f} ms, max {ms[-1]:.2f} ms (the monitor's count_out to the last rank's decision)")
    print(json.dumps({"ranks": args.ranks, "samples": args.samples, "median_ms": statistics.median(ms),
                      "p90_ms": p90, "max_ms": ms[-1]}))


if __name__ == "__main__":
    main()
