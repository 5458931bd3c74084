"""The levels of a :class:`~inprocess.rank_assignment.Tree`: :class:`Layer` and its :class:`LayerFlag`."""

from __future__ import annotations

import enum

from .base import check_int
from .keys import KeyOrFn, check_key_or_fn


class LayerFlag(enum.Flag):
    """Per-layer policy of :class:`Tree`.

    ``RESERVE``: a lost active rank may be replaced by a spare from anywhere
    in its domain at this layer. ``BACKFILL``: when no spare is found, the
    highest active rank of its domain at this layer takes the lost number,
    moving the gap to the end of that domain.
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


class Layer:
    """One level of the topology tree of :class:`Tree`.

    Args:
        min_ranks: a domain of this layer with fewer healthy (active or
            spare) ranks is terminated whole.
        max_ranks: at most this many active ranks per domain of this layer;
            the rest are spares. ``None``: no bound.
        key_or_fn: this rank's grouping key (any hashable value, e.g.
            ``socket.gethostname()``), or a callable (state) -> key
            (:mod:`inprocess.rank_assignment.keys`).
        flag: ``LayerFlag.RESERVE``, ``LayerFlag.BACKFILL``, both (``|``) or None.
    """

    def __init__(
        self,
        min_ranks: int = 1,
        max_ranks: int | None = None,
        key_or_fn: KeyOrFn = "",
        flag: LayerFlag | None = None,
    ):
        self.min_ranks = check_int(min_ranks, "min_ranks")
        if max_ranks is not None:
            check_int(max_ranks, "max_ranks")
        self.max_ranks = max_ranks
        check_key_or_fn(key_or_fn, "key_or_fn")
        self.key_or_fn = key_or_fn
        if flag is not None and not isinstance(flag, LayerFlag):
            raise ValueError(f"flag={flag!r} ({type(flag).__name__}): expected a LayerFlag or None")
        self.flag = flag

    def has(self, flag: LayerFlag) -> bool:
        return self.flag is not None and bool(self.flag & flag)

    def __repr__(self) -> str:
        return (
            f"Layer(min_ranks={self.min_ranks}, max_ranks={self.max_ranks}, "
            f"key_or_fn={self.key_or_fn!r}, flag={self.flag})"
        )
