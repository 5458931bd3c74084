"""What the last restore of a peer state did, as the user reads it (``state.last_restore``)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class RestoreRecord:
    """What the last :meth:`ReplicatedState.restore` (or :meth:`ShardedState.restore`) did."""

    step: Optional[int]  # the step every rank resumed at; None: no rank held a committed state
    source: Optional[int]  # the group rank that sent it; None when nobody needed it (or several sent)
    receivers: Tuple[int, ...]  # the group ranks that lacked it
    nbytes: int  # bytes sent to each receiver (0 on a rank that neither sent nor received)
    seconds: float  # the whole restore on this rank
