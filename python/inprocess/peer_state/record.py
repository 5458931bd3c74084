"""What the last restore of a peer state did, as the user reads it (``state.last_restore``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RestoreRecord:
    """What the last :meth:`ReplicatedState.restore` (or :meth:`ShardedState.restore`) did."""

    step: int | None  # the step every rank resumed at; None: no rank held a committed state
    source: int | None  # the group rank that sent it; None when nobody needed it (or several sent)
    receivers: tuple[int, ...]  # the group ranks that lacked it
    nbytes: int  # the bytes this rank received (0: it received nothing)
    seconds: float  # the whole restore on this rank
    sent: int = 0  # the bytes this rank sent, to every receiver together


def size_text(nbytes: float) -> str:
    """`nbytes` for a log line: 812 B, 5.4 kB, 0.2 MB, 1.0 GB (powers of 1024)."""
    if nbytes >= 2**30 / 10:
        return f"{nbytes / 2**30:.1f} GB"
    if nbytes >= 2**20 / 10:
        return f"{nbytes / 2**20:.1f} MB"
    if nbytes >= 2**10:
        return f"{nbytes / 2**10:.1f} kB"
    return f"{int(nbytes)} B"
