"""``python tools/gpu_acceptance.py`` in its no-GPU mode (what CI runs):
the fakes' tests run, every GPU check is listed as skipped with the reason,
and both reports are written."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_acceptance.py"
_spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
assert _spec is not None and _spec.loader is not None
acceptance = importlib.util.module_from_spec(_spec)
sys.modules["gpu_acceptance"] = acceptance  # its dataclasses look their module up while it loads
_spec.loader.exec_module(acceptance)
# One quick test of the fakes, so that this test stays short; the default
# runs every test file of acceptance.FAKE_TESTS.
QUICK_FAKE = "tests/test_gpu_settings.py::test_the_readme_settings_contradict_nothing"


def _run(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "report"),
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
                 "abort benchmark, real NCCL row: a hung all_reduce released, the teardown timed",
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


def test_the_gpu_checks_judge_what_the_workers_report() -> None:
    # The GPU checks cannot run here; what decides pass or fail from the
    # workers' reports can.
    done = subprocess.CompletedProcess([], 0, "", "")
    line = 'x ACCEPTANCE {"rank": 0, "pointers": 2, "revoked": true, "devices_with_context": ["0:3b:00.0"], ' \
           '"own_device": "0:3b:00.0", "abort_s": 0.01}'
    reports = acceptance._reports(line + "\nnoise\n")
    ok, detail = acceptance._judge_own_device(reports, done)
    assert ok and "rank 0: 2 communicator pointers, revoked=True, contexts on 1 device(s)" in detail
    stray = [dict(reports[0], devices_with_context=["0:18:00.0", "0:3b:00.0"])]  # a context on GPU 0 too
    assert not acceptance._judge_own_device(stray, done)[0]
    assert not acceptance._judge_own_device([dict(reports[0], pointers=0)], done)[0]  # torch's abort alone
    hidden = [dict(reports[0], devices_with_context=[])]
    assert "in a container" in acceptance._judge_own_device(hidden, done)[1]
    assert acceptance._bus_id("00000000:3B:00.0") == acceptance._bus_id("0000:3b:00.0") == "0:3b:00.0"
    judge = acceptance._judge_released(27.0)
    assert judge([{"released_s": 2.4}, {"released_s": 3.1}], done)[0]
    assert not judge([{"released_s": 2.4}, {"released_s": 28.0}], done)[0]
    assert not judge([], done)[0]
    timed = {"release_ms": [12.0, 30.0, 9.0, 11.0, 10.0], "teardown_ms": [510.0, 980.0, 505.0, 520.0, 515.0]}
    ok, detail = acceptance._judge_latency([timed], done)
    assert ok and detail.startswith("hung all_reduce released by the abort: p50 11.0 ms, max 30.0 ms"), detail
    assert "the abort returned (NCCL's teardown): p50 515.0 ms, max 980.0 ms" in detail, detail
    assert not acceptance._judge_latency([dict(timed, release_ms=[60.0] * 5)], done)[0]  # the kernel not stopped
    assert not acceptance._judge_latency([dict(timed, teardown_ms=[510.0] * 4 + [1500.0])], done)[0]  # a third poll
    assert not acceptance._judge_latency([dict(timed, teardown_ms=[])], done)[0]  # an abort that never returned
