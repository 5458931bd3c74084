"""Dumps torch's NCCL flight recorder (the last collectives of every NCCL
group of this process) to a file before the abort erases it, bounded by a
deadline: a dump that hangs is abandoned, and the abort goes on.

The file holds what torch's ``_dump_nccl_trace()`` returns, byte for byte
(torch's own pickle format, read by torch's flight-recorder analyser
``torchfrtrace``); inprocess never unpickles it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from .bounded import call_within

log = logging.getLogger("inprocess")


def trace_path(template: str, rank: int, iteration: int) -> str:
    """`template` with ``{rank}`` and ``{iteration}`` filled in."""
    try:
        return template.format(rank=rank, iteration=iteration)
    except (KeyError, IndexError) as e:
        raise ValueError(
            f"torch_fr_trace_path={template!r}: only {{rank}} and {{iteration}} may be filled in ({e})"
        ) from None


def dump(path: str, timeout: float, c10d: Optional[Any] = None) -> bool:
    """Writes the flight recorder to `path`; False (logged) when torch has no
    flight recorder, the dump failed or it did not finish within `timeout`."""
    if c10d is None:
        try:
            import torch._C._distributed_c10d as c10d
        except ImportError:
            log.warning("flight recorder not dumped: torch.distributed is not available")
            return False
    dump_trace = getattr(c10d, "_dump_nccl_trace", None)
    if dump_trace is None:
        log.warning("flight recorder not dumped: this torch has no NCCL flight recorder (_dump_nccl_trace)")
        return False
    result = call_within(dump_trace, timeout, "inprocess-fr-dump")
    if not result.finished:
        log.error("flight recorder dump did not finish within %gs; the abort goes on without it", timeout)
        return False
    if result.error is not None or not isinstance(result.value, (bytes, bytearray)):
        log.error("flight recorder dump failed: %s", result.error or f"got {type(result.value).__name__}")
        return False
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(bytes(result.value))
    os.replace(tmp, path)
    log.info("flight recorder dumped to %s (%d bytes)", path, len(result.value))
    return True
