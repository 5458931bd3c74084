"""Builds the fake GPU libraries (fake_cuda.c, fake_nccl.c, fake_nvml.c) once
per test session, with the system's C compiler, into a temporary folder.

Each fake is built under the file name the real library has (libcuda.so.1,
libnccl.so.2, libnvidia-ml.so.1) in a folder of its own, so the loader's
by-name logic sees what it would see on a GPU machine. Variants (a missing
symbol, an NCCL without revoke) get folders of their own.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

HERE = pathlib.Path(__file__).resolve().parent
BUILD_TIMEOUT_S = 60

# name: (source, file name, extra compiler flags)
VARIANTS = {
    "cuda": ("fake_cuda.c", "libcuda.so.1", []),
    "cuda_no_stream_query": ("fake_cuda.c", "libcuda.so.1", ["-DFAKE_CUDA_OMIT_STREAM_QUERY"]),
    "nccl": ("fake_nccl.c", "libnccl.so.2", []),
    "nccl_no_revoke": ("fake_nccl.c", "libnccl.so.2", ["-DFAKE_NCCL_NO_REVOKE"]),
    "nccl_no_abort": ("fake_nccl.c", "libnccl.so.2", ["-DFAKE_NCCL_OMIT_ABORT"]),
    "nvml": ("fake_nvml.c", "libnvidia-ml.so.1", []),
    "torch_watchdog": ("fake_torch_watchdog.c", "libfake_torch_watchdog.so", []),
    # A driver that keeps primary contexts and each thread's current one (the NCCL abort's device).
    "cuda_contexts": ("fake_cuda_contexts.c", "libcuda.so.1", []),
    # torch built with NCCL linked in statically: the NCCL functions are in libtorch_cuda.so itself.
    # The locking of torch's ProcessGroupNCCL (tests/fakes/fake_torch_nccl.py).
    "c10d": ("fake_c10d.c", "libfake_c10d.so", []),
    "torch_cuda_static_nccl": ("fake_nccl.c", "libtorch_cuda.so", ["-DFAKE_NCCL_DEFAULT_VERSION=22903"]),
}


@dataclass(frozen=True)
class Fakes:
    paths: dict[str, str]

    def __getitem__(self, name: str) -> str:
        return self.paths[name]


_built: Fakes | None = None


def skip_where_torch_loaded_nccl() -> None:
    """Skips the calling test in a process where torch's own import loaded a
    libnccl (a CUDA build of torch links it: libtorch_cuda.so needs
    libnccl.so.2). The fake libnccl cannot stand in beside it: inprocess
    refuses to load a second NCCL (issue 18, item 9), which is right on a GPU
    machine. These tests need a CPU build of torch, as CI has; on a GPU machine
    the acceptance command's GPU part (tools/gpu_acceptance.py) tests the real library instead."""
    from inprocess import _native

    found = _native.NcclLibrary.find_loaded()
    if found is not None:
        pytest.skip(f"torch loaded its own NCCL ({found.path}): the fake libnccl cannot be loaded beside it "
                    "(inprocess refuses a second NCCL); run with a CPU build of torch, as CI does; the GPU part "
                    "of `python tools/gpu_acceptance.py` tests the real one")


def skip_where_torch_is_a_cuda_build() -> None:
    """For a case run in a child process that imports torch beside the fake libnccl: skipped where
    torch is a CUDA build, whose import loads its own NCCL (see :func:`skip_where_torch_loaded_nccl`).
    The check is on the build, not on this process, which may hold a fake libnccl of another test."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} is a CUDA build: its import loads its own NCCL, beside which the "
                    "fake libnccl cannot be loaded; run with a CPU build of torch, as CI does")


def skip_where_torchs_import_loads_nccl() -> None:
    """For a case that runs in a fresh interpreter and imports torch there (``run_case``): skips it
    where that import loads a libnccl (a CUDA build of torch), as :func:`skip_where_torch_loaded_nccl`.

    Asked of a fresh interpreter, not of the test process: an earlier test may have loaded the fake
    libnccl here (``tests/test_nccl_abort.py`` loads it in-process), which says nothing about what
    torch's import loads, and the skip then blamed torch in every full run of the suite."""
    result = run_python("import json, torch\nfrom inprocess import _native\n"
                        "found = _native.NcclLibrary.find_loaded()\nprint(json.dumps(found and found.path))")
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    if loaded is not None:
        pytest.skip(f"importing torch loads its own NCCL ({loaded}): the fake libnccl cannot be loaded beside it "
                    "(inprocess refuses a second NCCL); run with a CPU build of torch, as CI does; the GPU part "
                    "of `python -m inprocess.gpu.acceptance` tests the real one")


def build_fakes() -> Fakes:
    """Compiles every variant once per process; skips the calling test when no
    C compiler is available (the reason names what is missing)."""
    global _built
    if _built is not None:
        return _built
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) to build the fake GPU libraries")
    root = pathlib.Path(tempfile.mkdtemp(prefix="inprocess-gpu-fakes-"))
    atexit.register(shutil.rmtree, root, True)
    paths = {}
    for name, (source, file_name, flags) in VARIANTS.items():
        folder = root / name
        folder.mkdir()
        out = folder / file_name
        cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", *flags,
               "-o", str(out), str(HERE / source), "-lpthread"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"building {name} failed:\n{' '.join(cmd)}\n{result.stderr}")
        paths[name] = str(out)
    _built = Fakes(paths)
    return _built


def counter(path: str, symbol: str) -> int:
    """A counter the fake exports for tests (the library is already loaded by
    the code under test; ctypes takes a reference to the same copy)."""
    lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_long
    return int(fn())


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a process without any libnccl
    loaded yet); the child is reaped by subprocess.run even on timeout."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)
