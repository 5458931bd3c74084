"""A module with DTensor parameters (FSDP2's ``fully_shard``, tensor parallel) and its optimizers,
read and written through ``torch.distributed.checkpoint.state_dict``.

Such a module's ``state_dict()`` holds DTensors whose local shards are this rank's, and an
optimizer's own ``state_dict()`` names parameters by position; torch's
``get_model_state_dict``/``get_optimizer_state_dict`` give both by fully qualified name (FQN),
and ``set_model_state_dict``/``set_optimizer_state_dict`` load them back. A snapshot keeps
each DTensor's local shard with its placements, global shape and mesh shape
(:mod:`inprocess.peer_state.encoding`); before anything is loaded, the snapshot's FQNs,
placements and shapes are checked equal to those of this iteration's module, so that a
state taken under another sharding is refused with the first difference named.

An optimizer that has not stepped yet has no state: its snapshot is ``None`` (reading it
through torch would initialise it with a step of zero gradients, which a job without peer
state never takes), and loading ``None`` clears its state.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from .encoding import decode, encode, in_place, index_of, leaves


def has_dtensors(obj: Any) -> bool:
    """Whether `obj` is a module with DTensor parameters."""
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None or not isinstance(obj, torch.nn.Module):
        return False
    return any(isinstance(p, tensor.DTensor) for p in obj.parameters())


def split(objects: Mapping[str, Any]) -> tuple[str | None, list[str]]:
    """The name of the registered DTensor module (None: none) and of the optimizers over
    its parameters; more than one DTensor module is refused."""
    modules = [name for name, obj in objects.items() if has_dtensors(obj)]
    if len(modules) > 1:
        raise ValueError(f"peer state: {', '.join(modules)} are modules with DTensor parameters: register one "
                         "(the root module that fully_shard or parallelize_module wrapped), with its optimizer")
    if not modules:
        return None, []
    ids = {id(p) for p in objects[modules[0]].parameters()}
    optimizers = [name for name, obj in objects.items() if isinstance(obj, torch.optim.Optimizer)
                  and all(id(p) in ids for group in obj.param_groups for p in group["params"])]
    return modules[0], optimizers


def read(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """The module's state dict (optimizer None), or the optimizer's by FQN (None before its first step)."""
    from torch.distributed.checkpoint import state_dict as dcp

    if optimizer is None:
        return dcp.get_model_state_dict(module)
    if not optimizer.state:
        return None
    return dcp.get_optimizer_state_dict(module, optimizer)


def described(node: Any, tensors: list[torch.Tensor]) -> dict[str, str]:
    """Every tensor of an encoded state dict by its path: its dtype and local shape, and for a
    DTensor its placements, global shape and mesh shape."""
    found = {}
    for path, leaf in leaves(node).items():
        t = tensors[index_of(leaf)]
        local = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
        if "DT" in leaf:
            _, placements, shape, mesh = leaf["DT"]
            found[path] = f"a DTensor {placements} of {shape} on a mesh {mesh} (local shard {local})"
        else:
            found[path] = f"a tensor {local}"
    return found


def holds_dtensors(node: Any) -> bool:
    """Whether an encoded state holds a DTensor."""
    return any("DT" in leaf for leaf in leaves(node).values())


def check(name: str, held: Any, held_tensors: list[torch.Tensor], live: Any) -> None:
    """Raises, naming the first difference, unless the snapshot's node `held` has the same
    FQNs, placements and shapes as `live` (this iteration's state dict)."""
    live_tensors: list[torch.Tensor] = []
    expected = described(encode(live, live_tensors), live_tensors)
    found = described(held, held_tensors)
    if found == expected:
        return
    for path in sorted(set(found) | set(expected)):
        if found.get(path) != expected.get(path):
            raise RuntimeError(f"peer state: {name}'s snapshot does not fit this iteration's {name} at {path!r}: "
                               f"the snapshot holds {found.get(path, 'nothing')}; here: "
                               f"{expected.get(path, 'nothing')} (a snapshot loads only into the same model, sharded "
                               "the same way over as many ranks)")


def rewrap(value: Any, live: Any) -> Any:
    """`value` (a decoded state dict: local tensors where DTensors were) with each tensor that
    is a DTensor in `live` made one again, on live's mesh, with its placements and shape."""
    tensor = sys.modules["torch.distributed.tensor"]
    if isinstance(live, tensor.DTensor):
        return tensor.DTensor.from_local(value, live.device_mesh, live.placements, run_check=False,
                                         shape=live.shape, stride=live.stride())
    if isinstance(value, dict) and isinstance(live, dict):
        return {key: rewrap(item, live[key]) if key in live else item for key, item in value.items()}
    if isinstance(value, (list, tuple)) and isinstance(live, (list, tuple)) and len(value) == len(live):
        items = [rewrap(item, other) for item, other in zip(value, live, strict=True)]
        return items if isinstance(value, list) else tuple(items)
    return value


def live(module: torch.nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], held: Mapping[str, Any],
         tensors: list[torch.Tensor], module_name: str) -> dict[str, Any]:
    """This iteration's state dicts of the module and of each optimizer whose snapshot is not
    None (reading initialises a fresh optimizer's state), each checked against the snapshot."""
    from torch.distributed.checkpoint import state_dict as dcp

    states = {module_name: read(module, None)}
    for name, optimizer in optimizers.items():
        if held[name] != {"V": None}:
            states[name] = dcp.get_optimizer_state_dict(module, optimizer)
    for name, state in states.items():
        check(name, held[name], tensors, state)
    return states


def write(module: torch.nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], held: Mapping[str, Any],
          tensors: list[torch.Tensor], states: Mapping[str, Any], module_name: str, transient: bool) -> None:
    """Loads the module's part, then each optimizer's (cleared where its snapshot is None);
    `states`: :func:`live`'s. `transient`: as in :meth:`Objects.write`."""
    from torch.distributed.checkpoint import state_dict as dcp

    if not in_place(held[module_name], tensors, states[module_name]):
        dcp.set_model_state_dict(module, rewrap(decode(held[module_name], tensors, clone=False), states[module_name]))
    for name, optimizer in optimizers.items():
        if name in states and in_place(held[name], tensors, states[name]):
            continue
        if name in states:  # the optimizer keeps what it is given: copies, unless transient
            state = rewrap(decode(held[name], tensors, clone=not transient), states[name])
            dcp.set_optimizer_state_dict(module, optimizer, state)
        else:
            optimizer.state.clear()
