"""The ranks' topology keys in the store, published at barrier 0 and for each joiner admitted.

They are what each initial rank's rank assignment groups it by (its node, its rack, ...:
:meth:`RankAssignment.local_keys`); the leader reads them when it decides (once per call, and
after every admission). One key of JSON lines, ``[initial rank, key lists]`` each (a later line
for a rank replaces an earlier one). This module imports no torch."""

from __future__ import annotations

import json

from ..exception import InternalError
from .keys import CallKeys
from .store_ops import CountingStore

KeyLists = list[list[str]]


class TopologyKeys:
    """The topology key of one wrapped call."""

    def __init__(self, counted: CountingStore, keys: CallKeys):
        self.counted = counted
        self.key = keys.topology()

    def publish(self, entries: list[tuple[int, KeyLists]]) -> None:
        """Each (initial rank, key lists) of ``entries`` in one append: a leader admitting K joiners
        publishes their keys in one round trip, not K."""
        if entries:
            lines = "".join(json.dumps([rank, keys], separators=(",", ":")) + "\n" for rank, keys in entries)
            self.counted.append(self.key, lines)

    def read(self, initial_world_size: int) -> list[KeyLists]:
        """Per initial rank, the key lists it published (leader only, once per restart)."""
        raw = (self.counted.peek(self.key) or b"").decode()
        table: list[KeyLists | None] = [None] * initial_world_size
        for line in raw.splitlines():
            if line:
                rank, keys = json.loads(line)
                table[int(rank)] = keys
        missing = [r for r, k in enumerate(table) if k is None]
        if missing:
            raise InternalError(f"topology keys missing for initial ranks {missing[:16]}")
        return [k for k in table if k is not None]
