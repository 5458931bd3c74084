"""NVML and the NVML-based health checks against the fake libnvidia-ml
(tests/fakes/fake_nvml.c); the NIC check against a sysfs tree in tmp."""

from __future__ import annotations

import datetime
import pathlib
import time
from collections.abc import Iterator

import pytest

from fakes.gpu_fakes import Fakes, build_fakes, counter
from inprocess import _native, health_check
from inprocess.exception import HealthCheckError, TimeoutError
from inprocess.gpu import CudaContextLost, GpuUnavailable, GpuUnhealthy, device, libraries

S = 1_000_000_000
SLACK_S = 0.25
STATE = None  # the checks read nothing from the state


@pytest.fixture(scope="module")
def fakes() -> Fakes:
    return build_fakes()


@pytest.fixture
def nvml(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> Iterator[_native.NvmlLibrary]:
    monkeypatch.setenv("FAKE_NVML_MODE", "ok")
    monkeypatch.setenv("FAKE_CUDA_MODE", "ok")
    monkeypatch.setenv("INPROCESS_LIBNVML", fakes["nvml"])
    monkeypatch.setenv("INPROCESS_LIBCUDA", fakes["cuda"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    libraries.forget()
    library, reason = libraries.nvml()
    assert library is not None, reason
    yield library
    libraries.forget()


@pytest.mark.timeout(30)
def test_query_of_a_healthy_device(nvml: _native.NvmlLibrary, fakes: Fakes) -> None:
    for ident in ("index:1", "uuid:GPU-fake-1", "pci:00000000:11:00.0"):
        r = nvml.query(ident, S)
        assert r.status == _native.GpuStatus.DONE, (ident, r.step, r.error_string)
        assert (r.ecc_volatile_uncorrected, r.remapped_rows_pending, r.remapped_rows_failure) == (0, 0, 0)
        assert (r.retired_pages_pending, r.recovery_action, r.nvlinks) == (0, 0, [1, 1, 1, 1])
    missing = nvml.query("uuid:GPU-other", S)
    assert (missing.status, missing.error, missing.step) == (_native.GpuStatus.ERROR, 6, "nvmlDeviceGetHandleByUUID")
    assert counter(fakes["nvml"], "fake_nvml_init_depth") == 0  # every init has its shutdown
    with pytest.raises(ValueError, match="device gpu0: expected index:N"):
        nvml.query("gpu0", S)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "mode, error, match",
    [
        ("ecc", GpuUnhealthy, "2 new volatile uncorrectable ECC errors"),
        ("remap_pending", GpuUnhealthy, "row remap is pending"),
        ("remap_failure", GpuUnhealthy, "row remap failed"),
        ("retired_pending", GpuUnhealthy, "pending retirement"),
        ("lost", CudaContextLost, "fell off the bus"),
        ("lost_mid", CudaContextLost, "fell off the bus.*nvmlDeviceGetTotalEccErrors"),
        ("driver_missing", GpuUnhealthy, "nvmlInit_v2 failed: Driver Not Loaded"),
    ],
)
def test_nvml_check_fails_on(nvml: _native.NvmlLibrary, monkeypatch: pytest.MonkeyPatch, mode: str,
                             error: type, match: str) -> None:
    check = health_check.NvmlHealthCheck()
    assert check(STATE) is STATE  # type: ignore[arg-type]
    monkeypatch.setenv("FAKE_NVML_MODE", mode)
    with pytest.raises(error, match=match):
        check(STATE)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_hung_nvml_call_is_a_failed_check(nvml: _native.NvmlLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_MODE", "hang")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="NVML did not answer within 0.3s"):
        health_check.NvmlHealthCheck(timeout=datetime.timedelta(seconds=0.3))(STATE)  # type: ignore[arg-type]
    assert time.monotonic() - started < 0.3 + SLACK_S


@pytest.mark.timeout(30)
def test_chained_gpu_check_reads_the_recovery_action(
    nvml: _native.NvmlLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = health_check.ChainedGPUHealthCheck()
    check(STATE)  # type: ignore[arg-type]
    monkeypatch.setenv("FAKE_NVML_MODE", "recovery_reset")
    with pytest.raises(GpuUnhealthy, match="recovery action 1"):
        check(STATE)  # type: ignore[arg-type]
    monkeypatch.setenv("FAKE_NVML_MODE", "old_driver")
    assert check(STATE) is STATE  # type: ignore[arg-type]
    with pytest.raises(GpuUnavailable, match="driver 570"):
        health_check.ChainedGPUHealthCheck(on_unavailable="fail")(STATE)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_chained_nvl_check_compares_with_its_baseline(
    nvml: _native.NvmlLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    check = health_check.ChainedNVLHealthCheck(device_index=1)
    check(STATE)  # type: ignore[arg-type]
    assert check.baseline == [1, 1, 1, 1]
    monkeypatch.setenv("FAKE_NVML_MODE", "nvlink_down")
    with pytest.raises(GpuUnhealthy, match=r"GPU 1: NVLinks \[1\] went down"):
        check(STATE)  # type: ignore[arg-type]
    monkeypatch.setenv("FAKE_NVML_MODE", "old_driver")  # no NVLink at all
    with pytest.raises(GpuUnavailable, match="no active NVLink"):
        health_check.ChainedNVLHealthCheck(on_unavailable="fail")(STATE)  # type: ignore[arg-type]


def test_nvml_checks_without_nvml_skip_or_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INPROCESS_LIBNVML", "/nonexistent/libnvidia-ml.so.1")
    libraries.forget()
    try:
        assert health_check.NvmlHealthCheck()(STATE) is STATE  # type: ignore[arg-type]
        with pytest.raises(GpuUnavailable, match="cannot load /nonexistent/libnvidia-ml.so.1"):
            health_check.NvmlHealthCheck(on_unavailable="fail")(STATE)  # type: ignore[arg-type]
    finally:
        libraries.forget()


def test_nvml_device_follows_local_rank_and_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device.nvml_identifier(1) == "index:1"
    assert device.nvml_identifier(0, "00000000:10:00.0") == "pci:00000000:10:00.0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    assert device.nvml_identifier(1) == "index:2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")
    assert device.nvml_identifier(0) == "uuid:GPU-aa"
    with pytest.raises(ValueError, match="CUDA device 2 is not among"):
        device.nvml_identifier(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1")
    with pytest.raises(ValueError, match="MIG"):
        device.nvml_identifier(0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device.cuda_ordinal() == 3 and device.cuda_ordinal(1) == 1
    with pytest.raises(ValueError, match="device=-1"):
        device.cuda_ordinal(-1)


def test_nic_check_sees_a_link_go_down(tmp_path: pathlib.Path) -> None:
    def write(nic: str, port: str, value: int) -> None:
        folder = tmp_path / nic / "ports" / port / "counters"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "link_downed").write_text(f"{value}\n")

    write("mlx5_0", "1", 4)
    write("mlx5_1", "1", 0)
    check = health_check.ChainedNicHealthCheck(sysfs_root=str(tmp_path))
    assert check.baseline == {"mlx5_0/1": 4, "mlx5_1/1": 0}
    check(STATE)  # type: ignore[arg-type]
    write("mlx5_1", "1", 1)
    with pytest.raises(HealthCheckError, match="mlx5_1/1': 1"):
        check(STATE)  # type: ignore[arg-type]
    only_0 = health_check.ChainedNicHealthCheck(nics=["mlx5_0"], sysfs_root=str(tmp_path))
    only_0(STATE)  # type: ignore[arg-type]
    empty = health_check.ChainedNicHealthCheck(sysfs_root=str(tmp_path / "none"), on_unavailable="fail")
    with pytest.raises(GpuUnavailable, match="no InfiniBand port counters"):
        empty(STATE)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_volatile_ecc_count_is_compared_with_its_first_reading(
    nvml: _native.NvmlLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The volatile count keeps every uncorrectable error since the driver
    # loaded (nvml.h: "Volatile counts are reset each time the driver
    # loads"), those already handled by a row remap included: a GPU that had
    # one before the job is not unhealthy now. Only growth fails.
    monkeypatch.setenv("FAKE_NVML_MODE", "ecc")
    check = health_check.NvmlHealthCheck()
    assert check(STATE) is STATE  # type: ignore[arg-type]
    assert check.ecc_baseline == 2
    assert check(STATE) is STATE  # type: ignore[arg-type]
    monkeypatch.setenv("FAKE_NVML_MODE", "ecc_more")
    with pytest.raises(GpuUnhealthy, match=r"GPU 0: 1 new volatile uncorrectable ECC errors \(3 since the driver"):
        check(STATE)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_nvml_checks_follow_the_cuda_device_of_the_rank(
    nvml: _native.NvmlLibrary, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    check = health_check.NvmlHealthCheck()
    assert check(STATE) is STATE  # type: ignore[arg-type]
    assert check.ordinal == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(GpuUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        health_check.NvmlHealthCheck(on_unavailable="fail")(STATE)  # type: ignore[arg-type]
