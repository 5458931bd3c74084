"""The random number generators' states, captured with a snapshot and restored with it.

torch's (CPU), Python's ``random``, NumPy's global generator when NumPy is loaded, and
CUDA's (every device) when CUDA is initialized; as tensors and plain data only (the
encoding of :mod:`inprocess.peer_state.encoding`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any

import torch


def capture() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = [name, torch.from_numpy(keys.copy()), int(pos), int(has_gauss), float(cached)]
    return states


def restore(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        name, keys, pos, has_gauss, cached = states["numpy"]
        numpy.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
