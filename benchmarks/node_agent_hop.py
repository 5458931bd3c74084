"""What the node agent's hop costs a restart's wake-up: board vs. store, side by side.

A real node agent process (``python -m inprocess.processes.node_agent``) relays the
event of each iteration from a TCPStore on 127.0.0.1 to its board. For each
sample, one thread waits on the board (as a rank's trigger does with an agent)
and one on the store (as it does without), both in this process; the restart
is then requested and each waiter stamps when it woke::

    python benchmarks/node_agent_hop.py --samples 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

import reaping  # benchmarks/reaping.py: this script's folder is first on the path
from inprocess.compose import Compose
from inprocess.control.membership import Membership
from inprocess.control.node_link import OUTCOME_DECIDED, NodeLink, socket_name
from inprocess.control.protocol import RestartProtocol
from inprocess.processes.contract import NodeAgentConfig
from inprocess.processes.helper_process import HelperProcess
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide


def _stamp(woke: dict[str, int], where: str, wait: Callable[[int, float], object], iteration: int) -> None:
    """Wait for the iteration's event, then note when this waiter woke."""
    wait(iteration, 5.0)
    woke[where] = time.monotonic_ns()


def main() -> None:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="3 samples, to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.samples = 3
    if args.samples < 1:
        raise SystemExit(f"--samples={args.samples}: expected >= 1")
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout, wait_for_workers=False)

    def protocol() -> RestartProtocol:
        return RestartProtocol(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout))

    agent = HelperProcess.start(NodeAgentConfig(store_host="127.0.0.1", store_port=server.port, call=0, node="bench",
                                                slots=1, store_timeout_s=10, connect_timeout_s=10))
    link = None
    try:
        link = NodeLink.connect(socket_name("127.0.0.1", server.port, 0, "bench"), 0, 10)
        leader, direct = protocol(), protocol()
        assignment = Compose(ActivateAllRanks(), ShiftRanks())
        board_ms: list[float] = []
        store_ms: list[float] = []
        for i in range(args.samples):
            # Barrier i's decision first: the agent relays it, then waits for iteration i's event.
            leader.publish_decision(decide(assignment, Membership.all_active(1), set(), [], i, 0))
            if link.wait_outcome(i, 5) != OUTCOME_DECIDED:
                raise SystemExit(f"the agent did not relay decision {i}")
            woke: dict[str, int] = {}
            waiters = [threading.Thread(target=_stamp, args=(woke, "board", link.wait_event, i)),
                       threading.Thread(target=_stamp, args=(woke, "store", direct.wait_event, i))]
            for w in waiters:
                w.start()
            time.sleep(0.02)  # both parked
            start = time.monotonic_ns()
            leader.request_restart(i)
            for w in waiters:
                w.join(10)
            board_ms.append((woke["board"] - start) / 1e6)
            store_ms.append((woke["store"] - start) / 1e6)
    finally:
        if link is not None:
            link.close()  # the agent exits once its last rank closed its link
        if not agent.wait_exit(5):
            agent.stop()
    med_b, med_s = statistics.median(board_ms), statistics.median(store_ms)
    print(f"request_restart -> waiter awake, {args.samples} samples (median, max):")
    print(f"  through the node agent's board  {med_b:6.2f} ms  {max(board_ms):6.2f} ms")
    print(f"  directly from the store         {med_s:6.2f} ms  {max(store_ms):6.2f} ms")
    print(f"  hop: {med_b - med_s:+.2f} ms median (ratio {med_b / med_s:.2f})")
    print(json.dumps({"benchmark": "node_agent_hop", "samples": args.samples, "board_ms": board_ms,
                      "store_ms": store_ms}))


if __name__ == "__main__":
    main()
