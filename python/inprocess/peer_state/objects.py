"""What makes up a peer state: the user's named objects, read into a snapshot and written back.

Each object has ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer, an LR
scheduler, a stateful data loader). A module with DTensor parameters (FSDP2, tensor
parallel) and the optimizers over its parameters go through
``torch.distributed.checkpoint.state_dict`` instead (:mod:`inprocess.peer_state.distributed`).
Objects given to ``restore(**objects)`` replace those registered before: a module that an
iteration builds anew (an FSDP2 module is bound to the process group it was sharded over).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch

from . import distributed
from .arguments import check_objects
from .encoding import decode


class Objects:
    """The named objects of one peer state."""

    def __init__(self, kind: str, objects: Mapping[str, Any]) -> None:
        self.kind = kind
        self._objects: Dict[str, Any] = {}
        if objects:
            self.replace(objects)

    def replace(self, objects: Mapping[str, Any]) -> None:
        """These objects instead of those registered (the same names: a snapshot holds them)."""
        check_objects(self.kind, objects)
        if self._objects and set(objects) != set(self._objects):
            raise ValueError(f"{self.kind}.restore({', '.join(sorted(objects))}=...): expected the names registered "
                             f"before ({', '.join(sorted(self._objects))}): a snapshot holds those")
        self._objects = dict(objects)
        distributed.split(self._objects)  # at most one DTensor module: refused here, not at the first commit

    def read(self) -> Dict[str, Any]:
        """Every object's state, by name (live: its tensors are the objects' own)."""
        if not self._objects:
            raise RuntimeError(f"{self.kind}: no object registered: name them in {self.kind}(model=..., ...) or in "
                               "restore(model=..., ...)")
        module, optimizers = distributed.split(self._objects)
        states = {}
        for name, obj in self._objects.items():
            if name == module:
                states[name] = distributed.read(obj, None)
            elif name in optimizers:
                assert module is not None
                states[name] = distributed.read(self._objects[module], obj)
            else:
                states[name] = obj.state_dict()
        return states

    def write(self, held: Mapping[str, Any], tensors: List[torch.Tensor]) -> None:
        """The snapshot's nodes (`held`, by name, still encoded) into the objects, each checked
        first: a name the snapshot lacks, a DTensor state under another sharding."""
        missing = sorted(set(self._objects) - set(held))
        if missing:
            raise RuntimeError(f"peer state: the snapshot holds no {', '.join(map(repr, missing))} (it holds "
                               f"{sorted(held)}): every rank must register the same objects")
        module, optimizers = distributed.split(self._objects)
        for name in self._objects:
            if name != module and name not in optimizers and distributed.holds_dtensors(held[name]):
                raise RuntimeError(f"peer state: the snapshot of {name!r} holds DTensors and this iteration's "
                                   f"{name} has none: register the module that fully_shard (or parallelize_module) "
                                   "wrapped, as on the rank that committed it")
        if module is not None:
            distributed.write(self._objects[module], {name: self._objects[name] for name in optimizers}, held,
                              tensors, module)
        for name, obj in self._objects.items():
            if name == module or name in optimizers:
                continue
            # A module copies what it loads into its own tensors; anything else (an optimizer)
            # may keep the tensors it is given: it gets copies, never the snapshot's buffers.
            clone = not isinstance(obj, torch.nn.Module)
            obj.load_state_dict(decode(held[name], tensors, clone))
