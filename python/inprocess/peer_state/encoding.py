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
from typing import Any, List

import torch

PLAIN = (bool, int, float, str, type(None))


def encode(value: Any, tensors: List[torch.Tensor], path: str = "") -> Any:
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


def decode(node: Any, tensors: List[torch.Tensor], clone: bool) -> Any:
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


def parts(skeleton: Any) -> dict[str, Any]:
    """The top-level dict of an encoded snapshot, by key (its nodes still encoded)."""
    (tag, body), = skeleton.items()
    if tag != "D":
        raise ValueError(f"peer state: a snapshot's skeleton is a {tag!r} node: expected a dict ('D')")
    return {key: node for key, node in body}
