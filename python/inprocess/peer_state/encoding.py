"""Tensors and plain data as a JSON skeleton and a list of tensors: what a snapshot holds.

A value is encoded as a tree of one-key objects: ``{"T": i}`` the i-th tensor,
``{"V": x}`` a plain value (bool, int, float, str, None), ``{"D": [[key, node], ...]}``
a dict (keys plain), ``{"L": [...]}`` a list, ``{"U": [...]}`` a tuple, and
``{"DT": [i, placements, shape, mesh shape]}`` a DTensor whose local shard is the i-th
tensor (decoded as that local tensor: :mod:`inprocess.peer_state.distributed` makes it a
DTensor again). Nothing else is accepted: no pickle on the wire or in memory (design
principle 5).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

PLAIN = (bool, int, float, str, type(None))


def encode(value: Any, tensors: list[torch.Tensor], path: str = "") -> Any:
    """`value`'s skeleton; its tensors appended to `tensors` in the order they are met."""
    if isinstance(value, torch.Tensor):
        distributed = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
        if distributed is not None and isinstance(value, distributed.DTensor):
            tensors.append(value.to_local())
            return {"DT": [len(tensors) - 1, str(value.placements), list(value.shape), list(value.device_mesh.shape)]}
        tensors.append(value)
        return {"T": len(tensors) - 1}
    if isinstance(value, PLAIN):
        return {"V": value}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, PLAIN):
                raise TypeError(f"peer state: key {key!r} at {path or 'the top'} is a {type(key).__name__}: "
                                "expected a str, int, float, bool or None")
            items.append([key, encode(item, tensors, f"{path}[{key!r}]")])
        return {"D": items}
    if isinstance(value, (list, tuple)):
        tag = "L" if isinstance(value, list) else "U"
        return {tag: [encode(item, tensors, f"{path}[{i}]") for i, item in enumerate(value)]}
    raise TypeError(f"peer state: {path or 'the value'} is a {type(value).__module__}.{type(value).__qualname__}: "
                    "expected tensors and plain data (numbers, strings, None, lists, tuples, dicts) only")


def decode(node: Any, tensors: list[torch.Tensor], clone: bool) -> Any:
    """The value `node` encodes, its tensors taken from `tensors` (copies when `clone`)."""
    (tag, body), = node.items()
    if tag in ("T", "DT"):
        t = tensors[body if tag == "T" else body[0]]
        return t.clone() if clone else t
    if tag == "V":
        return body
    if tag == "D":
        return {key: decode(item, tensors, clone) for key, item in body}
    items = [decode(item, tensors, clone) for item in body]
    return items if tag == "L" else tuple(items)


def leaves(node: Any, path: str = "") -> dict[str, Any]:
    """Every tensor node ("T" or "DT") under `node`, by its path (``a.b[2].c``)."""
    (tag, body), = node.items()
    if tag in ("T", "DT"):
        return {path: node}
    found: dict[str, Any] = {}
    if tag == "D":
        for key, item in body:
            found.update(leaves(item, f"{path}.{key}" if path else str(key)))
    elif tag in ("L", "U"):
        for i, item in enumerate(body):
            found.update(leaves(item, f"{path}[{i}]"))
    return found


def index_of(leaf: Any) -> int:
    """The index of a tensor node's tensor."""
    (tag, body), = leaf.items()
    return int(body if tag == "T" else body[0])


def without_tensors(node: Any) -> Any:
    """`node` with every tensor node replaced by ``"T"``: its plain values and structure."""
    (tag, body), = node.items()
    if tag in ("T", "DT"):
        return "T"
    if tag == "D":
        return {"D": [[key, without_tensors(item)] for key, item in body]}
    if tag in ("L", "U"):
        return {tag: [without_tensors(item) for item in body]}
    return node


def in_place(held: Any, tensors: list[torch.Tensor], live: Any) -> bool:
    """Whether the snapshot's node `held` is the `live` state as it is: the same plain values,
    and every tensor the live state's own tensor at its path."""
    own: list[torch.Tensor] = []
    encoded = encode(live, own)
    if without_tensors(held) != without_tensors(encoded):
        return False
    theirs = leaves(encoded)
    return all(tensors[index_of(leaf)].data_ptr() == own[index_of(theirs[path])].data_ptr()
               and tensors[index_of(leaf)].shape == own[index_of(theirs[path])].shape
               for path, leaf in leaves(held).items())


def storage_key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    """What identifies a tensor's memory across views of it (a parameter and its ``detach()``;
    a DTensor: its local shard)."""
    distributed = sys.modules.get("torch.distributed.tensor")
    if distributed is not None and isinstance(t, distributed.DTensor):
        t = t.to_local()
    return t.data_ptr(), t.numel(), t.dtype


def parts(skeleton: Any) -> dict[str, Any]:
    """The top-level dict of an encoded snapshot, by key (its nodes still encoded)."""
    (tag, body), = skeleton.items()
    if tag != "D":
        raise ValueError(f"peer state: a snapshot's skeleton is a {tag!r} node: expected a dict ('D')")
    return {key: node for key, node in body}
