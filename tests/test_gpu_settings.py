"""The GPU settings (inprocess.gpu.settings): what contradicts them, the one
warning at start-up, and why TORCH_NCCL_RETHROW_CUDA_ERRORS=0 is one of
them: with torch's default a sticky CUDA error ends the rank by SIGABRT from
torch's watchdog (tests/fakes/fake_torch_watchdog.c) instead of exit 76."""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import sys

import pytest

from fakes.gpu_fakes import Fakes, build_fakes
from inprocess.gpu import EXIT_CODE_CONTEXT_LOST, settings
from inprocess.launch import LocalJob

WORKER = pathlib.Path(__file__).resolve().parent / "workers" / "gpu_settings_worker.py"

README_SETTINGS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
                   "NCCL_NVLS_ENABLE": "0"}


def test_the_readme_settings_contradict_nothing() -> None:
    assert settings.contradictions(README_SETTINGS, (2, 28, 9)) == []
    assert settings.contradictions(README_SETTINGS, (2, 29, 7)) == []  # torch 2.13's NCCL
    assert settings.contradictions({**README_SETTINGS, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, (2, 27, 3)) == []
    nonblocking = {**README_SETTINGS, "TORCH_NCCL_USE_COMM_NONBLOCKING": "1", "TORCH_NCCL_NONBLOCKING_TIMEOUT": "20"}
    assert settings.contradictions(nonblocking, None) == []


def test_torchs_defaults_contradict_the_async_mode_and_the_rethrow() -> None:
    found = settings.contradictions({}, (2, 28, 9))
    assert len(found) == 3, found
    assert found[0].startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING unset (3): torch's watchdog tears the process down")
    assert found[1].startswith("TORCH_NCCL_RETHROW_CUDA_ERRORS unset (true): after a sticky CUDA error")
    assert found[2].startswith("NCCL_NVLS_ENABLE unset: NVLink SHARP (NVLS, on NVSwitch systems) is on")


@pytest.mark.parametrize("env, expected", [
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING='1'"),
    ({"NCCL_ASYNC_ERROR_HANDLING": "3"}, "NCCL_ASYNC_ERROR_HANDLING='3'"),  # torch's older name
    ({"TORCH_NCCL_RETHROW_CUDA_ERRORS": "TRUE"}, "TORCH_NCCL_RETHROW_CUDA_ERRORS='TRUE'"),
    ({"TORCH_NCCL_RETHROW_CUDA_ERRORS": "maybe"}, "TORCH_NCCL_RETHROW_CUDA_ERRORS='maybe'"),
    ({"TORCH_NCCL_USE_COMM_NONBLOCKING": "yes"}, "TORCH_NCCL_NONBLOCKING_TIMEOUT unset"),
    ({"NCCL_NVLS_ENABLE": "1"}, "NCCL_NVLS_ENABLE='1': NVLink SHARP"),
])
def test_each_contradiction_is_named(env: dict, expected: str) -> None:
    base = dict(README_SETTINGS)
    if "NCCL_ASYNC_ERROR_HANDLING" in env:
        del base["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    found = settings.contradictions({**base, **env}, (2, 28, 9))
    assert len(found) == 1 and expected in found[0], found
    # torch's getCvar gives the first name priority (Utils.hpp, getCvarBool's loop): TORCH_... wins.
    assert settings.contradictions({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": "3",
                                    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "NCCL_NVLS_ENABLE": "0"}, None) == []


def test_nccl_releases_with_known_abort_hangs() -> None:
    for version, hint in [((2, 17, 1), "119215"), ((2, 18, 3), "nccl#992"), ((2, 25, 1), "149153")]:
        found = settings.contradictions(README_SETTINGS, version)
        assert len(found) == 1 and hint in found[0], found
    for version in [(2, 17, 2), (2, 19, 3), (2, 25, 2), (2, 28, 2), (2, 28, 9), (2, 29, 7), (2, 30, 7)]:
        assert settings.contradictions(README_SETTINGS, version) == []


def test_nccl_2_28_3_to_2_28_8_are_warned_against() -> None:
    """nvidia_resiliency_ext warns against these releases for in-process restart (issue 30, item 5)."""
    for version in [(2, 28, 3), (2, 28, 7), (2, 28, 8)]:
        found = settings.contradictions(README_SETTINGS, version)
        assert len(found) == 1 and "2.28.3 to 2.28.8" in found[0] and "2.28.9 or later" in found[0], found


def test_warns_once_per_process_and_only_where_nccl_is_in_use(caplog: pytest.LogCaptureFixture) -> None:
    settings._forget()
    try:
        with caplog.at_level(logging.WARNING, logger="inprocess"):
            assert settings.warn_once({}, in_use=False) == []
            assert caplog.text == ""
            settings._forget()
            assert len(settings.warn_once({}, in_use=True, nccl_version=(2, 28, 9))) == 3
            assert settings.warn_once({}, in_use=True, nccl_version=(2, 28, 9)) == []
        assert caplog.text.count("works against an in-process restart on GPUs") == 1
    finally:
        settings._forget()


def test_a_cpu_build_of_torch_is_not_in_use() -> None:
    import torch

    if torch.version.cuda is not None and torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU: the CPU-only case cannot be shown here")
    assert settings.nccl_in_use() == (False, None)


def _job(tmp_path: pathlib.Path, plan: dict, env: dict, timeout: float = 90) -> LocalJob:
    job_env = {"INPROCESS_TEST_PLAN": json.dumps(plan), "PYTHONUNBUFFERED": "1", **env}
    with LocalJob([str(WORKER)], 1, env=job_env) as job:
        job.wait(timeout)
    return job


@pytest.mark.timeout(120)
def test_a_cpu_only_gloo_job_prints_nothing_about_gpu_settings(tmp_path: pathlib.Path) -> None:
    # Three calls, each restarting once, under torch's defaults (which
    # contradict the settings): this CPU-only process is not warned.
    import torch

    if torch.version.cuda is not None and torch.cuda.device_count() > 0:
        pytest.skip("this machine has a GPU: the CPU-only case cannot be shown here")
    job = _job(tmp_path, {"case": "settings", "calls": 3, "real_in_use": True}, {})
    out = job.outputs()
    assert [rp.returncode for rp in job.ranks] == [0], out
    assert out.count("returned iteration 1") == 3, out
    assert "GPU settings" not in out and "in-process restart on GPUs" not in out, out


@pytest.mark.timeout(120)
def test_the_warning_comes_once_at_start_up_where_nccl_is_in_use(tmp_path: pathlib.Path) -> None:
    # torchrun's value (inprocess.launch sets 2 where none is given).
    job = _job(tmp_path, {"case": "settings", "calls": 3},
               {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    out = job.outputs()
    assert [rp.returncode for rp in job.ranks] == [0], out
    assert out.count("returned iteration 1") == 3, out
    assert out.count("works against an in-process restart on GPUs") == 1, out
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING='1'" in out and "NCCL 2.18.3" in out, out
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS" not in out, out


@pytest.fixture(scope="module")
def fakes() -> Fakes:
    return build_fakes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rethrow", ["0", None], ids=["readme_settings", "torch_default"])
def test_a_sticky_error_ends_the_rank_with_76_only_without_torchs_rethrow(
    tmp_path: pathlib.Path, fakes: Fakes, monkeypatch: pytest.MonkeyPatch, rethrow: str | None
) -> None:
    monkeypatch.delenv("TORCH_NCCL_RETHROW_CUDA_ERRORS", raising=False)  # the ranks inherit this environment
    env = {"INPROCESS_LIBCUDA": fakes["cuda"], "FAKE_TORCH_WATCHDOG": fakes["torch_watchdog"], "FAKE_CUDA_MODE": "ok",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    if rethrow is not None:
        env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] = rethrow
    job = _job(tmp_path, {"case": "sticky"}, env)
    out = job.outputs()
    returncode = job.ranks[0].returncode
    assert "Process group watchdog thread terminated with exception" in out, out
    assert "iteration 1 ran" not in out, out
    if rethrow == "0":
        assert returncode == EXIT_CODE_CONTEXT_LOST, out
        assert "CUDA context lost" in out, out
    else:
        assert returncode == -signal.SIGABRT, out
        assert "CUDA context lost" not in out, out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
