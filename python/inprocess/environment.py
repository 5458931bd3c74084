"""The process environment as the library reads it: the launcher's integers (:func:`env_int`), the
``INPROCESS_*`` variables it knows, and a warning for one it does not know.

A misspelt variable is silently ignored by whatever reads the right one: a rehearsal with
``INPROCESS_FAULT=...`` (for ``INPROCESS_FAULTS``) runs clean and looks like a success. A wrapped
call therefore looks once per process at every ``INPROCESS_*`` variable set and logs one WARNING per
name it does not know, with the nearest known name. Names under ``INPROCESS_TEST_`` and
``INPROCESS_BENCH_`` belong to this project's tests and benchmarks, and the few others those use are
listed here too, so that the suite's own runs warn about nothing. ``tests/test_environment.py``
checks that every ``INPROCESS_*`` name in the library's source is listed.

This module imports no torch.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
from collections.abc import Mapping

log = logging.getLogger("inprocess")

PREFIX = "INPROCESS_"

# What each variable the library reads does, and where.
LIBRARY = {
    "INPROCESS_FAULTS": "faults to inject, for a rehearsal (inprocess.faults)",
    "INPROCESS_RESTART_STORM": "the restart storm brake's limits, or off (inprocess.engine.storm)",
    "INPROCESS_EVENTS_DIR": "where every rank writes its structured events (inprocess.events)",
    "INPROCESS_JOIN": "1: this process joins a running job (inprocess.control.joining)",
    "INPROCESS_RESPAWN_COUNT": "set by inprocess.launch on a respawned process",
    "INPROCESS_FILE_STORE": "the file of a FileStore (inprocess.store)",
    "INPROCESS_LIBCUDA": "the CUDA driver library to load (inprocess.gpu.libraries)",
    "INPROCESS_LIBNVML": "the NVML library to load (inprocess.gpu.libraries)",
    "INPROCESS_LIBNCCL": "an NCCL library to load when none is loaded (inprocess.gpu.libraries)",
    "INPROCESS_MONITOR_REPORT_MODULES": "a monitor process reports the modules it imported (tests)",
}
# The test suite's and the benchmarks' own, besides the reserved prefixes.
SUITE = frozenset({
    "INPROCESS_NVRX_EXAMPLES", "INPROCESS_NVRX_PYTHON", "INPROCESS_TORCHRUN_TEST", "INPROCESS_README_TEST",
    "INPROCESS_SLURM_TEST", "INPROCESS_EXAMPLE_TEST", "INPROCESS_ABI_SELFTEST", "INPROCESS_BUILD_BENCH",
    "INPROCESS_CHAOS_SEED", "INPROCESS_SLURM_REQUIRED", "INPROCESS_RESPAWN_TEST", "INPROCESS_DOCS_TEST",
})
SUITE_PREFIXES = ("INPROCESS_TEST_", "INPROCESS_BENCH_")

_warned: set[str] = set()
_lock = threading.Lock()


def env_int(name: str, default: int | None = None) -> int:
    """``int(os.environ[name])`` (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...); ``default`` when it is
    not set (None: it must be set). A value that is not an integer is an error that names the variable."""
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set: launch with torchrun, srun or set it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from None


def known(name: str) -> bool:
    return name in LIBRARY or name in SUITE or name.startswith(SUITE_PREFIXES)


def nearest(name: str) -> str | None:
    """The known variable ``name`` most likely misspells, if one is close enough."""
    close = difflib.get_close_matches(name, list(LIBRARY), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """Each ``INPROCESS_*`` variable set in ``environ`` (default: this process's) that nothing reads,
    with the nearest known name (None when none is close), sorted."""
    env = os.environ if environ is None else environ
    return [(name, nearest(name)) for name in sorted(env) if name.startswith(PREFIX) and not known(name)]


def warn_unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """One WARNING per unknown ``INPROCESS_*`` variable, once per process and name; returns the lines."""
    lines = []
    for name, guess in unknown(environ):
        with _lock:
            if name in _warned:
                continue
            _warned.add(name)
        hint = f"did you mean {guess} ({LIBRARY[guess]})?" if guess else \
            f"the library reads {', '.join(sorted(LIBRARY))}"
        lines.append(f"environment variable {name} is set but inprocess does not read it, so it has no effect: "
                     f"{hint}")
        log.warning("%s", lines[-1])
    return lines
