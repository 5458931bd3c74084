"""Training state from a peer: a rank that takes over starts at the last committed step.

After an in-process restart the ranks that were active keep their training
state in memory, but a rank that takes over (a spare, a joiner, a respawned
process) has none: without help it loads the user's last checkpoint, and the
whole job goes back to that step. :class:`ReplicatedState` is for data
parallel training, where every replica holds the same model and optimizer:

- the user registers what makes up the state, once, outside the wrapped
  function (anything with ``state_dict()``/``load_state_dict()``);
- :meth:`ReplicatedState.commit` at the end of a step takes a snapshot into
  host memory (every ``every`` steps), into the one of two buffers that does
  not hold the last complete snapshot, so that a fault during a snapshot
  never spoils the previous one;
- :meth:`ReplicatedState.restore`, called by every rank of the new iteration
  once its process group exists and before its first step, agrees on the
  newest committed step any rank holds, sends that snapshot from a holder
  to every rank that lacks it, and loads it on every rank, holders included:
  the ranks that kept running roll back to the same step, so that no two
  ranks resume at different steps. It returns that step, or None when no
  rank holds one (the function then loads its own checkpoint from storage).

:class:`ShardedState` is for state that no two ranks hold alike (ZeRO, FSDP):
each rank keeps a copy of one partner's shard, on another node.

What travels is tensors and plain data (numbers, strings, lists, dicts), as a
JSON skeleton and raw tensor bytes: never a pickle (design principle 5). The
RNG states (torch's, Python's, NumPy's when loaded, CUDA's when initialized)
are the source's: right when every replica seeds the same way.

The package, one concept a module: :mod:`.encoding` (the JSON skeleton),
:mod:`.rng` (the generators' states), :mod:`.snapshot` (taking and loading a
snapshot), :mod:`.wire` (a snapshot as bytes), :mod:`.transport` (the
interface that moves snapshots) and :mod:`.process_group` (it, over
torch.distributed; :mod:`.staged`, through a device for NCCL), :mod:`.planning`
(partners and who sends what), :mod:`.replicated` and :mod:`.sharded` (the user's objects).
"""

from __future__ import annotations

from .planning import node_key, partners
from .process_group import ProcessGroupTransport
from .record import RestoreRecord
from .replicated import ReplicatedState
from .sharded import ShardedState
from .snapshot import Snapshot
from .transport import Transport

__all__ = [
    "ProcessGroupTransport",
    "ReplicatedState",
    "RestoreRecord",
    "ShardedState",
    "Snapshot",
    "Transport",
    "node_key",
    "partners",
]
