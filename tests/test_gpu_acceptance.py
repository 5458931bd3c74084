"""``python -m inprocess.gpu.acceptance`` in its no-GPU mode (what CI runs):
the fakes' tests run, every GPU check is listed as skipped with the reason,
and both reports are written."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from inprocess.gpu import acceptance

ROOT = pathlib.Path(__file__).resolve().parents[1]
# One quick test of the fakes, so that this test stays short; the default
# runs every test file of acceptance.FAKE_TESTS.
QUICK_FAKE = "tests/test_gpu_settings.py::test_the_readme_settings_contradict_nothing"


def _run(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inprocess.gpu.acceptance", "--out", str(tmp_path / "report"),
                           "--no-gpu", *args], cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_no_gpu_mode_runs_the_fakes_and_says_what_needs_a_gpu(tmp_path: pathlib.Path) -> None:
    done = _run(tmp_path, "--fakes", QUICK_FAKE)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    fake = [r for name, r in results.items() if name.startswith("fakes: ")]
    assert [(r["name"], r["status"]) for r in fake] == [
        ("fakes: test_gpu_settings.py::test_the_readme_settings_contradict_nothing", "pass")]
    skipped = [r for r in report["results"] if r["status"] == "skip"]
    assert len(skipped) == 7, skipped
    assert all(r["detail"].startswith("needs an NVIDIA GPU: --no-gpu") for r in skipped), skipped
    for name in ("sticky CUDA error ends the rank with 76",
                 "abort benchmark, real NCCL row: a hung all_reduce released",
                 "a collective stuck in one group while every group is aborted"):
        assert results[name]["status"] == "skip"
    assert set(report["environment"]) >= {"torch", "torch_cuda", "nccl", "cuda_driver", "gpus", "devices"}
    text = (tmp_path / "report" / "report.md").read_text()
    assert "**1 passed, 0 failed, 7 skipped**" in text
    assert "The GPU part was not run (--no-gpu): it needs an NVIDIA GPU." in text
    assert text in done.stdout


@pytest.mark.timeout(300)
def test_a_failing_fake_test_fails_the_command(tmp_path: pathlib.Path) -> None:
    # A test that does not exist is a collection error: reported, exit 1.
    done = _run(tmp_path, "--fakes", "tests/test_gpu_settings.py::no_such_test")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert any(r["status"] == "fail" for r in report["results"]), report["results"]


def test_without_the_tests_it_says_so(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    assert acceptance.main(["--out", str(tmp_path / "r"), "--no-gpu", "--tests", str(tmp_path / "none")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["results"][0] == {"name": "tests of the GPU layer on its fakes", "status": "skip",
                                    "detail": "tests not found", "seconds": 0.0}
    assert "pass --tests path/to/checkout/tests" in capsys.readouterr().out
