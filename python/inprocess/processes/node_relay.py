"""A node's restart traffic at the store, as its node agent relays it (Python): forward the
node's arrivals, post each decision and event on the node's board.

The agent runs the same steps in C++ (:mod:`inprocess.processes.native_relay`, which falls
back to this class over any store that is not its own connection); the control-plane
simulator runs thousands of either. :mod:`inprocess.processes.node_agent` has the whole picture.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..control.protocol import COMPLETE, RestartProtocol
from ..control.records import Decision

DECISION_CAPACITY = 1 << 20  # a node board's decision slot: a decision holds at most 32 fault records, far below


class NodeRelay:
    """The agent's store traffic for one node (the simulator runs thousands of these).

    ``forward`` and ``broadcast`` each run on their own connection (their own
    :class:`RestartProtocol`), since ``broadcast`` blocks on the store.
    """

    def __init__(self, board: Any):
        self.board = board
        self.forwarded = [-1] * board.slots  # the last barrier forwarded per slot
        self.adds = 0  # batches forwarded (one store add each)

    def forward(self, p: RestartProtocol) -> int:
        """Forward every arrival posted since the last call; returns how many were counted.

        Per barrier: the seats the ranks left to the agent are taken in one
        pipelined batch (:meth:`RestartProtocol.take_seats`); a seat not taken
        is refused on the board (its rank looks itself, and leaves if it was
        counted out); the others are counted with one ``add``.
        """
        board = self.board
        batches: dict[int, tuple[int, list[int]]] = {}
        for slot in range(board.slots):
            arrival = board.slot_arrival(slot)
            if arrival is None:
                continue
            barrier, expected = arrival
            if barrier > self.forwarded[slot]:
                batches.setdefault(barrier, (expected, []))[1].append(slot)
        n = 0
        for barrier in sorted(batches):
            expected, slots = batches[barrier]
            claims = [(slot, board.slot_seat(slot)) for slot in slots]
            wanted = [(slot, seat) for slot, seat in claims if seat is not None]
            taken = p.take_seats(barrier, [seat for _, seat in wanted]) if wanted else []
            refused = {slot for (slot, _), ok in zip(wanted, taken, strict=True) if not ok}
            counted = [slot for slot in slots if slot not in refused]
            for slot in refused:
                self.forwarded[slot] = barrier
                board.refuse_seat(slot, barrier)
            if not counted:
                continue
            healthy, _dead, _complete = p.arrive_batch(barrier, len(counted), expected)
            self.adds += 1
            if healthy == len(counted):  # the barrier's first healthy arrivals: one of them leads
                board.set_leader(counted[0], barrier)
            for slot in counted:
                self.forwarded[slot] = barrier
                board.mark_forwarded(slot, barrier)
            n += len(counted)
        return n

    def relay_decision(self, p: RestartProtocol, barrier: int, cancelled: Callable[[], bool]) -> bool:
        """Post barrier ``barrier``'s decision; False when it ends the job.

        A lost mark (its leader was lost: :mod:`inprocess.control.leadership`)
        is posted as it comes: the node's ranks that read it follow the
        barrier's next terms at the store, where one of them may take the lead.
        """

        def post_mark(mark: bytes) -> None:
            self.board.post_decision(barrier, mark)

        raw = p.wait_decision_raw(barrier, None, cancelled=cancelled, on_lost=post_mark)
        self.board.post_decision(barrier, raw)
        return not Decision.ends_job(raw)

    def relay_event(self, p: RestartProtocol, iteration: int, cancelled: Callable[[], bool]) -> bool:
        """Post iteration ``iteration``'s event; False when it completed the call."""
        event = p.wait_event(iteration, None, cancelled=cancelled)
        self.board.post_event(iteration, event == COMPLETE)
        return event != COMPLETE
