"""The declared GPU function types against the real headers, and the real
libnccl.so.2 of the nvidia-nccl-cu12 wheel (it loads without a GPU).

Needs the wheels of the ``test-gpu-abi`` extra (nvidia-nccl-cu12 for nccl.h
and libnccl.so.2, nvidia-cuda-runtime-cu12 for cuda.h, nvidia-nvml-dev-cu12
for nvml.h); each test skips, naming the wheel, where it is absent.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from fakes.gpu_fakes import run_python

REPO = pathlib.Path(__file__).resolve().parent.parent


def wheel_dir(package: str, wheel: str) -> pathlib.Path:
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # not even the `nvidia` namespace package is there
        spec = None
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{wheel} is not installed (pip install '.[test-gpu-abi]')")
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def include_dir(package: str, wheel: str, header: str) -> pathlib.Path:
    """The folder holding `header`: the wheel's include/, else a CUDA toolkit's
    (``CUDA_HOME``, ``/usr/local/cuda``: a GPU machine's CUDA 13 has cuda.h and
    nvml.h there, and its pip wheels lay their headers out differently)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (pathlib.Path(home) / "include" / header).is_file():
            toolkit: pathlib.Path | None = pathlib.Path(home) / "include"
            break
    else:
        toolkit = None
    try:
        return wheel_dir(package, wheel) / "include"
    except pytest.skip.Exception:
        if toolkit is None:
            raise
        return toolkit


def compile_check(extra: list[str] | None = None) -> subprocess.CompletedProcess:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    includes = [
        REPO / "tests" / "abi_shim",
        wheel_dir("nvidia.nccl", "nvidia-nccl-cu12") / "include",
        include_dir("nvidia.cuda_runtime", "nvidia-cuda-runtime-cu12", "cuda.h"),
        include_dir("nvidia.nvml_dev", "nvidia-nvml-dev-cu12", "nvml.h"),
        REPO / "csrc",
    ]
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", *[f"-I{p}" for p in includes],
           *(extra or []), str(REPO / "tests" / "abi_check.cpp")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(180)
def test_declared_types_agree_with_the_headers() -> None:
    result = compile_check()
    assert result.returncode == 0, result.stderr[-4000:]
    # And the check can fail: a wrong declaration does not compile.
    wrong = compile_check(["-DINPROCESS_ABI_SELFTEST"])
    assert wrong.returncode != 0 and "selftest: must fail" in wrong.stderr


@pytest.mark.timeout(120)
def test_the_real_libnccl_loads_and_answers() -> None:
    root = wheel_dir("nvidia.nccl", "nvidia-nccl-cu12")
    library = root / "lib" / "libnccl.so.2"
    header = (root / "include" / "nccl.h").read_text()
    code = int(re.search(r"#define NCCL_VERSION_CODE (\d+)", header).group(1))  # type: ignore[union-attr]
    # A fresh process: the test process may hold a fake libnccl already.
    program = (
        "import sys\n"
        "from inprocess import _native\n"
        "lib = _native.NcclLibrary.open(sys.argv[1])\n"
        "print(lib.version)\n"
        "print(all(found for _, found in lib.symbols()), lib.has_revoke)\n"
        "print(lib.error_string(6))\n"
        "found = _native.NcclLibrary.find_loaded()\n"
        "print(found is not None and found.path == lib.path)\n"
        "print(lib.abort([], True, 10**9).status.name)\n"
    )
    result = run_python(program.replace("sys.argv[1]", repr(str(library))), timeout=100)
    assert result.returncode == 0, result.stderr[-4000:]
    version, symbols, message, found, empty_abort = result.stdout.splitlines()
    assert int(version) == code  # ncclGetVersion says what nccl.h says
    assert symbols == "True True"  # every symbol, revoke too (2.28.7+)
    assert "remote process" in message
    assert found == "True" and empty_abort == "DONE"
