"""What makes up a peer state: the user's named objects, read into a snapshot and written back.

Each object has ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer, an LR
scheduler, a stateful data loader). A module with DTensor parameters (FSDP2, tensor
parallel) and the optimizers over its parameters go through
``torch.distributed.checkpoint.state_dict`` instead (:mod:`inprocess.peer_state.distributed`).
Objects given to ``restore(**objects)`` replace those registered before: a module that an
iteration builds anew (an FSDP2 module is bound to the process group it was sharded over).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import distributed
from .arguments import check_objects
from .encoding import decode, encode, in_place, index_of, leaves, storage_key


class Objects:
    """The named objects of one peer state."""

    def __init__(self, kind: str, objects: Mapping[str, Any]) -> None:
        self.kind = kind
        self._objects: dict[str, Any] = {}
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

    def read(self) -> dict[str, Any]:
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

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [obj for obj in self._objects.values() if isinstance(obj, torch.optim.Optimizer)]

    def optimized(self) -> set[tuple[int, int, torch.dtype]]:
        """The :func:`storage_key` of every parameter of the registered optimizers and of every
        tensor of their state: what their ``step()`` changes."""
        keys: set[tuple[int, int, torch.dtype]] = set()
        for optimizer in self.optimizers():
            tensors = [p for group in optimizer.param_groups for p in group["params"]]
            tensors += [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
            keys.update(storage_key(t) for t in tensors)
        return keys

    def live(self, held: Mapping[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
        """This iteration's state of every object, by name, checked against the snapshot's
        nodes (`held`, still encoded, with its `tensors`, or tensors of their shapes) before
        anything is written: a name the snapshot lacks, DTensors where the object has none, a
        DTensor state of other FQNs, placements or shapes."""
        missing = sorted(set(self._objects) - set(held))
        if missing:
            raise RuntimeError(f"peer state: the snapshot holds no {', '.join(map(repr, missing))} (it holds "
                               f"{sorted(held)}): every rank must register the same objects")
        module, optimizers = distributed.split(self._objects)
        states = {}
        for name, obj in self._objects.items():
            if name == module or name in optimizers:
                continue
            if distributed.holds_dtensors(held[name]):
                raise RuntimeError(f"peer state: the snapshot of {name!r} holds DTensors and this iteration's "
                                   f"{name} has none: register the module that fully_shard (or parallelize_module) "
                                   "wrapped, as on the rank that committed it")
            states[name] = obj.state_dict()
        if module is not None:
            states.update(distributed.live(self._objects[module], {n: self._objects[n] for n in optimizers}, held,
                                           tensors, module))
        return states

    def destinations(self, held: Mapping[str, Any], tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The snapshot's tensors that can be received in place, into the objects' own tensors of
        the same path, shape and dtype (contiguous, in host memory): by their index in the snapshot."""
        live = self.live(held, tensors)
        into: dict[int, torch.Tensor] = {}
        for name, state in live.items():
            own: list[torch.Tensor] = []
            theirs = leaves(encode(state, own))
            for path, leaf in leaves(held[name]).items():
                mine = theirs.get(path)
                if mine is None or path == "":
                    continue
                t, wanted = own[index_of(mine)], tensors[index_of(leaf)]
                if (t.shape, t.dtype) == (wanted.shape, wanted.dtype) and t.is_contiguous() and t.device.type == "cpu":
                    into[index_of(leaf)] = t
        return into

    def write(self, held: Mapping[str, Any], tensors: list[torch.Tensor], transient: bool = False) -> None:
        """The snapshot's nodes (`held`, by name, still encoded) into the objects, checked first
        (:meth:`live`). An object whose every tensor is its own already (received in place, or a
        "live" snapshot) and whose plain values are the same is not loaded again. `transient`:
        the snapshot's tensors are not kept (received for this load): an object may keep them."""
        live = self.live(held, tensors)
        module, optimizers = distributed.split(self._objects)
        if module is not None:
            distributed.write(self._objects[module], {name: self._objects[name] for name in optimizers}, held,
                              tensors, live, module, transient)
        for name, obj in self._objects.items():
            if name == module or name in optimizers or in_place(held[name], tensors, live[name]):
                continue  # (in place: received into it, or a "live" snapshot of it)
            # a module copies what it loads; anything else may keep the tensors it is given:
            # copies of the snapshot's buffers, unless they are not kept (transient)
            keeps = not isinstance(obj, torch.nn.Module)
            obj.load_state_dict(decode(held[name], tensors, clone=keeps and not transient))
