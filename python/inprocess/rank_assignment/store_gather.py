"""Exchanging one value per rank through a store, for the per-rank calls of ``Tree`` and
``FilterCountGroupedByKey`` made outside the Wrapper.

Called per rank, as there, those two need every rank's key (and ``Tree``
every rank's state). Each rank sets its value under a key of its own and
waits for the others'; the namespace names the assignment instance and the
call, so instances built in the same order on every rank meet (the same
convention as there), and the launcher's incarnation, so that workers restarted
by torchrun or requeued by SLURM never read their predecessors' values from a
store that outlived them (torchrun's agent store does). Inside the Wrapper
nothing goes through the store: the leader has every rank's keys already.
"""

from __future__ import annotations

import datetime
import itertools
import json
from collections.abc import Iterable
from typing import Any

from ..control import keys
from ..control.incarnation import job_incarnation
from ..exception import BarrierTimeout


class StoreNamespace:
    """Where one assignment instance's exchanges live:
    ``<prefix>[/<incarnation>]/<class>_<instance>/<call>``."""

    _counters: dict[str, itertools.count[int]] = {}

    def __init__(self, owner: object):
        name = type(owner).__name__
        counter = StoreNamespace._counters.setdefault(name, itertools.count())
        instance = f"{name}_{next(counter)}"
        incarnation = job_incarnation()
        self.name = f"{incarnation}/{instance}" if incarnation else instance
        self.calls = 0

    def next_call(self) -> str:
        call = self.calls
        self.calls += 1
        return keys.rank_assignment_exchange(self.name, call)


def exchange(
    store: Any,
    namespace: str,
    me: int,
    value: Any,
    members: Iterable[int],
    timeout: datetime.timedelta | None = None,
) -> dict[int, Any]:
    """Publish ``value`` (JSON) as member ``me``; return every member's value once all have published."""
    if store is None or not hasattr(store, "set"):
        raise TypeError(
            f"ctx.store={store!r}: this per-rank call exchanges keys with the other ranks through the store; "
            f"expected a torch.distributed Store"
        )
    store.set(f"{namespace}/{me}", json.dumps(value, separators=(",", ":")))
    order = sorted(set(members))
    keys = [f"{namespace}/{r}" for r in order]
    try:
        if timeout is None:
            store.wait(keys)
        else:
            store.wait(keys, timeout)
    except Exception as e:
        # NVRx's per-rank assignments meet at a store barrier, which raises BarrierTimeout: so does this.
        if type(e).__name__ != "DistStoreError":
            raise
        missing = [r for r, k in zip(order, keys, strict=True) if not store.check([k])]
        raise BarrierTimeout(f"{namespace}: ranks {missing} of {order} did not publish their value "
                             f"within {timeout or 'the store timeout'} ({e})") from e
    raw = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    return {r: json.loads(bytes(v).decode()) for r, v in zip(order, raw, strict=True)}
