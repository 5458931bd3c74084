"""Decoding the decision: shared by the ranks of one client process, or not.

Decoding builds the whole membership, O(N) per rank (about 0.5 ms at
16,384), which a real job pays once per rank in parallel. With ``--decode
shared`` (the default) the ranks of one client process share one
``Decision.from_json`` of the identical decision bytes (each rank still
fetches the bytes, from the store or its board); the cost of one decode is
measured apart and reported in the "decode" column. ``--decode every-rank``
decodes on every rank (the tests use it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from inprocess.control.records import Decision

_FRESH_DECODE: Callable[[Any, bytes], Decision] = Decision.from_json.__func__  # type: ignore[attr-defined]


def decode_fresh(raw: bytes) -> Decision:
    """The library's decode, even where the shared cache replaced it."""
    return _FRESH_DECODE(Decision, raw)


def decode_us(raw: bytes, samples: int = 5) -> float:
    """Median microseconds of one decode of ``raw``."""
    times = []
    for _ in range(samples):
        start = time.perf_counter_ns()
        decode_fresh(raw)
        times.append(time.perf_counter_ns() - start)
    times.sort()
    return times[len(times) // 2] / 1e3


def share_decoding(keep: int = 8) -> None:
    """Let the ranks of this process share one decode of identical decision bytes.

    The last ``keep`` decodes are kept and found by comparing bytes (a memcmp,
    ~0.3 us for 8 kB), not by hashing them (each rank reads fresh bytes, whose
    hash costs ~2 us at 8 kB and ~5 us at 17 kB).
    """
    recent: list[tuple[bytes, Decision]] = []

    def from_json(cls: type, raw: bytes) -> Decision:
        for seen, d in recent:
            if seen == raw:
                return d
        d = _FRESH_DECODE(cls, raw)
        recent.insert(0, (bytes(raw), d))
        del recent[keep:]
        return d

    Decision.from_json = classmethod(from_json)  # type: ignore[method-assign,assignment]
