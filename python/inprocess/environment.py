"""Integers the launcher sets in the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...),
read one way everywhere: a value that is not an integer is an error that names the variable."""

from __future__ import annotations

import os
from typing import Optional


def env_int(name: str, default: Optional[int] = None) -> int:
    """``int(os.environ[name])``; ``default`` when it is not set (None: it must be set)."""
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set: launch with torchrun, srun or set it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from None
