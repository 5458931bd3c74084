"""CPU a node agent spends per node and restart, step by step, against a real TCPStore.

The 16,384-rank simulation (``control_plane_sim.py``) runs 2,048 node agents'
relays one after another in two processes; what each relay step costs in CPU
is what limits it on a small machine. This measures the library's own
:class:`~inprocess.processes.node_agent.NodeRelay` over the torch-free
:class:`~inprocess.control.tcpstore_client.TCPStoreClient` (as a real agent
runs it), for ``--nodes`` boards of 8 ranks, against a torch TCPStore server
in a process of its own (its CPU is not counted):

* ``forward``: 8 arrivals posted on the board, then the relay's forward (the
  the node's 8 seats in one ``compare_set``, one ``add``);
* ``relay_decision``: the decision of the barrier, already published (one
  blocking ``get``), posted on the board;
* ``relay_event``: the next iteration's event, already set (one blocking ``get``);
* ``floor``: the same number of round trips as the three steps (6) made with
  raw socket calls on the same connection (a ``check`` each): the kernel's
  share, which no client code can go below.

The same steps are then measured with
:class:`~inprocess.processes.native_relay.NativeNodeRelay` over a
:class:`inprocess._native.StoreConnection` (``native ...`` lines: the C++
relay, each step one call without the GIL), in the same run, against the same
server, on fresh keys (another call number).

Thread CPU time (``time.thread_time_ns``) per node, median over ``--rounds``::

    python benchmarks/node_relay_cpu.py --nodes 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import reaping  # benchmarks/reaping.py: this script's folder is first on the path
from inprocess import _native
from inprocess.control import seat_table
from inprocess.control.membership import Membership
from inprocess.control.protocol import FaultRecord, RestartProtocol
from inprocess.control.tcpstore_client import TCPStoreClient
from inprocess.control.tcpstore_wire import CHECK, encode_key_list
from inprocess.launch import free_port
from inprocess.processes.native_relay import NativeNodeRelay
from inprocess.processes.node_relay import DECISION_CAPACITY, NodeRelay
from inprocess.rank_assignment import ActivateAllRanks, Compose, ShiftRanks, decide

SLOTS = 8
SERVER = ("import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, "
          "wait_for_workers=False); print('up', flush=True); sys.stdin.read()")


def per_node_us(nodes: int, step: Callable[[], object]) -> float:
    start = time.thread_time_ns()
    step()
    return (time.thread_time_ns() - start) / nodes / 1e3


def one_round(client: TCPStoreClient, relay_store: object, call: int, nodes: int) -> dict[str, float]:
    """One restart's relay steps for every node: barrier 1 of call ``call`` (a fresh key space).

    ``relay_store``: the relay's connection, ``client`` itself (the Python relay) or a
    :class:`_native.StoreConnection` (the native relay); ``client`` sets the scene."""
    native = isinstance(relay_store, _native.StoreConnection)
    setup = RestartProtocol(client, call)
    p = RestartProtocol(relay_store, call)
    n = SLOTS * nodes
    boards = [_native.NodeBoard.create(SLOTS, DECISION_CAPACITY) for _ in range(nodes)]
    relays = [NativeNodeRelay(board) if native else NodeRelay(board) for board in boards]
    try:
        seeded = seat_table.seeded(p.prefix, SLOTS, {r: "0" for r in range(n)})  # every rank counted at barrier 0
        client.multi_set(list(seeded), list(seeded.values()))
        dead = n // 2
        fault = FaultRecord(dead, 0, "killed", "SIGKILL", "simulated", host="h", t_ns=1)
        decision = decide(Compose(ActivateAllRanks(), ShiftRanks()), Membership.all_active(n), {dead}, [fault], 1,
                          leader=0)

        def forward() -> None:
            for k, board in enumerate(boards):
                for slot in range(SLOTS):
                    board.arrive(slot, 1, n, SLOTS * k + slot, 0)
                relays[k].forward(p)

        out = {"forward": per_node_us(nodes, forward)}
        setup.publish_decision(decision)
        out["relay_decision"] = per_node_us(nodes, lambda: [r.relay_decision(p, 1, lambda: True) for r in relays])
        setup.request_restart(1)
        out["relay_event"] = per_node_us(nodes, lambda: [r.relay_event(p, 1, lambda: True) for r in relays])
        if native:
            return {f"native {step}": us for step, us in out.items()}
        sock = client._sock  # the same connection, bypassing the client: the kernel's share
        assert sock is not None
        check = bytes((CHECK,)) + encode_key_list([p.seat_key(0)], "check")[1]

        def raw_round_trips() -> None:
            for _ in range(nodes * 6):
                sock.sendall(check)
                sock.recv(16)

        out["floor"] = per_node_us(nodes, raw_round_trips)
        return out
    finally:
        for board in boards:
            board.unmap()


def main() -> None:
    reaping.exit_on_sigterm()  # kill PID stops what this started, as Ctrl-C does
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=256, help="node boards of 8 ranks each (default 256)")
    ap.add_argument("--rounds", type=int, default=5, help="restarts measured, medians over them (default 5)")
    ap.add_argument("--smoke", action="store_true", help="16 nodes, 1 round: to check that it runs (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.nodes, args.rounds = 16, 1
    if args.nodes < 1 or args.rounds < 1:
        raise SystemExit(f"--nodes={args.nodes}, --rounds={args.rounds}: expected >= 1 each")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        client = TCPStoreClient("127.0.0.1", port, timeout=30, connect_timeout=30)
        connection = _native.StoreConnection("127.0.0.1", port, timeout=30, connect_timeout=30)
        # The native relay's rounds on their own calls (fresh keys), after the Python relay's.
        rounds = [{**one_round(client, client, call, args.nodes),
                   **one_round(client, connection, args.rounds + call, args.nodes)} for call in range(args.rounds)]
        connection.close()
        client.close()
    finally:
        server.stdin.close()  # type: ignore[union-attr]  # the server leaves at the end of its input
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    steps = list(rounds[0])
    medians = {step: statistics.median(r[step] for r in rounds) for step in steps}
    relay = medians["forward"] + medians["relay_decision"] + medians["relay_event"]
    native = medians["native forward"] + medians["native relay_decision"] + medians["native relay_event"]
    for step in steps:
        print(f"{step:>21}: {medians[step]:7.1f} us CPU per node (min {min(r[step] for r in rounds):.1f}, "
              f"max {max(r[step] for r in rounds):.1f})")
    print(f"{'relay, in all':>21}: {relay:7.1f} us CPU per node and restart; the kernel's round trips alone "
          f"{medians['floor']:.1f} us ({100 * medians['floor'] / relay:.0f} %); "
          f"x 2,048 nodes: {relay * 2048 / 1e3:.0f} ms")
    print(f"{'native relay':>21}: {native:7.1f} us CPU per node and restart ({relay / native:.1f}x less); "
          f"the kernel's round trips alone {medians['floor']:.1f} us ({100 * medians['floor'] / native:.0f} %); "
          f"x 2,048 nodes: {native * 2048 / 1e3:.0f} ms")
    print(json.dumps({"benchmark": "node_relay_cpu", "nodes": args.nodes, "rounds": args.rounds,
                      "us_per_node": medians}))


if __name__ == "__main__":
    main()
