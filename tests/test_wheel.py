"""The wheel users install: a manylinux tag after auditwheel, and exactly the package in it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(the wheel pip builds, the wheel auditwheel repaired from it)."""
    if shutil.which("auditwheel") is None and not _has_module("auditwheel"):
        pytest.skip("auditwheel is not installed (pip install '.[test]' installs it)")
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(out / "raw")],
        capture_output=True, text=True, timeout=540,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (raw,) = (out / "raw").glob("inprocess-*.whl")
    repaired = subprocess.run(
        [sys.executable, "-m", "auditwheel", "repair", str(raw), "-w", str(out / "repaired")],
        capture_output=True, text=True, timeout=120,
    )
    assert repaired.returncode == 0, repaired.stdout[-3000:] + repaired.stderr[-3000:]
    (fixed,) = (out / "repaired").glob("inprocess-*.whl")
    return raw, fixed


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_auditwheel_gives_a_manylinux_tag(wheels: tuple[pathlib.Path, pathlib.Path]) -> None:
    raw, fixed = wheels
    assert raw.name.endswith("-linux_x86_64.whl") or "linux" in raw.name
    tag = fixed.name.rsplit("-", 1)[1]
    assert tag.startswith("manylinux_") and tag.endswith(".whl"), fixed.name
    # Nothing needed grafting: the extension links only to the system's C and C++ runtimes.
    assert not any(n.startswith("inprocess.libs/") for n in zipfile.ZipFile(fixed).namelist())


def test_the_wheel_holds_the_package_its_stub_and_license_and_nothing_else(
    wheels: tuple[pathlib.Path, pathlib.Path],
) -> None:
    _, fixed = wheels
    names = zipfile.ZipFile(fixed).namelist()
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"inprocess"}, sorted(top)
    (info,) = dist_info
    for required in ("inprocess/_native.pyi", "inprocess/py.typed", "inprocess/__init__.py",
                     f"{info}/licenses/LICENSE", f"{info}/entry_points.txt"):
        assert required in names, required
    assert any(n.startswith("inprocess/_native.") and n.endswith(".so") for n in names)
    assert not [n for n in names if "__pycache__" in n or n.startswith(("tests/", "build/", "benchmarks/"))]


def test_no_build_path_is_baked_into_the_extension(wheels: tuple[pathlib.Path, pathlib.Path]) -> None:
    _, fixed = wheels
    with zipfile.ZipFile(fixed) as z:
        (so,) = [n for n in z.namelist() if n.startswith("inprocess/_native.") and n.endswith(".so")]
        binary = z.read(so)
    # Neither the source tree nor its build directory (RPATH, debug strings, __FILE__).
    assert str(ROOT).encode() not in binary
