"""Dumps torch's NCCL flight recorder (the last collectives of every NCCL
group of this process) to a file before the abort erases it, bounded by a
deadline: a dump that hangs is abandoned, and the abort goes on.

The file holds what torch's ``_dump_nccl_trace()`` returns, byte for byte
(torch's own pickle format); inprocess never unpickles it. Its name is the
one torch's analyser (``python -m torch.distributed.flight_recorder.fr_trace
DIR``) reads: its loader takes the rank from the end of the file name
(``torch/distributed/flight_recorder/components/loader.py``, ``read_dump``:
``rank = int(basename[len(prefix):])``) and wants one common prefix for every
file of a folder (``_determine_prefix``, the pattern ``([\\w\\-\\_]*?)(\\d+)$``).
So the file name ends with the rank, nothing after it, and the iteration, if
wanted, names a folder: ``fr/iter_{iteration}/rank_{rank}``.

What is dumped is what NVRx's collector and torch's own watchdog fall back
to: collectives, without stack traces, only the entries still active. The
binding (``torch/csrc/distributed/c10d/init.cpp``, ``_dump_nccl_trace``, as
read at pytorch/pytorch@00814e6e: unlike the bindings around it, no
``py::call_guard<py::gil_scoped_release>``) keeps the GIL for the whole dump
and defaults to ``includeStackTraces=True`` and ``onlyActive=False``,
whose symbolisation of Python frames can wait for what waits for the GIL;
NVRx (``attribution/trace_analyzer/trace_collector.py``) passes
``includeStackTraces=False, onlyActive=True`` to avoid that deadlock, and
torch's heartbeat monitor (``ProcessGroupNCCL::HeartbeatMonitor::runLoop``)
retries its own dump without stack traces when the first one does not
finish. A call that holds the GIL cannot be abandoned from Python (the
waiting thread needs the GIL to wake), so leaving the stack traces out is
what keeps the dump bounded; the deadline covers a dump that waits without
the GIL (the flight recorder's lock), and the rank's hard timeout covers the
rest.
"""

from __future__ import annotations

import logging
import os
import re
import string
from collections.abc import Callable
from typing import Any

from .bounded import call_within

log = logging.getLogger("inprocess")

# The arguments of every dump (see the module's docstring).
DUMP_ARGUMENTS = {"includeCollectives": True, "includeStackTraces": False, "onlyActive": True}

_FIELDS = ("rank", "iteration")


def check_template(template: str) -> None:
    """Raises ValueError unless `template` fills in only ``{rank}`` and
    ``{iteration}`` and gives a file name torch's analyser can read: ending
    with ``{rank}``, without ``{iteration}`` (put it in a folder)."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"torch_fr_trace_path={template!r}: {e}") from None
    unknown = [f for f in fields if f not in _FIELDS]
    if unknown:
        raise ValueError(
            f"torch_fr_trace_path={template!r}: only {{rank}} and {{iteration}} may be filled in ({unknown[0]!r})"
        )
    name = os.path.basename(template)
    if not name.endswith("{rank}") or "{iteration}" in name or re.search(r"\d$", name[: -len("{rank}")]):
        raise ValueError(
            f"torch_fr_trace_path={template!r}: the file name must end with {{rank}} (torch's flight-recorder "
            "analyser reads the rank from the end of the name, e.g. 'fr/iter_{iteration}/rank_{rank}'), "
            "with the iteration, if any, in a folder"
        )


def trace_path(template: str, rank: int, iteration: int) -> str:
    """`template` with ``{rank}`` and ``{iteration}`` filled in."""
    check_template(template)
    return template.format(rank=rank, iteration=iteration)


def dump(path: str, timeout: float, c10d: Any | None = None, bind: Callable[[], str] | None = None) -> bool:
    """Writes the flight recorder to `path`; False (logged) when torch has no
    flight recorder, the dump failed or it did not finish within `timeout`.

    `bind`, called first on the dump's own thread, makes the rank's device
    current there ("" when done, else why not): the dump reads the state of
    the collectives' CUDA events, and a thread with no device would get a
    context on GPU 0 from the CUDA runtime
    (:func:`inprocess.gpu.nccl_abort.bind_rank_device`)."""
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
    def on_the_ranks_device() -> Any:
        why = bind() if bind is not None else ""
        if why:
            log.debug("flight recorder dump: the rank's device not made current: %s", why)
        return dump_trace(**DUMP_ARGUMENTS)

    result = call_within(on_the_ranks_device, timeout, "inprocess-fr-dump")
    if not result.finished:
        log.error("flight recorder dump did not finish within %gs; the abort goes on without it", timeout)
        return False
    if result.error is not None or not isinstance(result.value, (bytes, bytearray)):
        log.error("flight recorder dump failed: %s", result.error or f"got {type(result.value).__name__}")
        return False
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(bytes(result.value))
    os.replace(tmp, path)
    log.info("flight recorder dumped to %s (%d bytes)", path, len(result.value))
    return True
