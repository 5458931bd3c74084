"""The CUDA driver layer against the fake libcuda (tests/fakes/fake_cuda.c):
deadlines, classification of errors, the probe, and CudaHealthCheck on top."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from fakes.gpu_fakes import Fakes, build_fakes, counter, run_python
from inprocess import _native, health_check
from inprocess.exception import HealthCheckError, TimeoutError
from inprocess.gpu import EXIT_CODE_CONTEXT_LOST, CudaContextLost, GpuUnavailable, libraries

MS = 1_000_000
S = 1_000_000_000
SLACK_S = 0.25  # scheduling on a loaded 2-core machine


@pytest.fixture(scope="module")
def fakes() -> Fakes:
    return build_fakes()


@pytest.fixture
def driver(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> Iterator[_native.CudaDriver]:
    monkeypatch.setenv("FAKE_CUDA_MODE", "ok")
    monkeypatch.setenv("INPROCESS_LIBCUDA", fakes["cuda"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the fake's two devices, whatever CI sets
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    libraries.forget()
    d, reason = libraries.cuda_driver()
    assert d is not None, reason
    yield d
    libraries.forget()


def allocations(fakes: Fakes) -> int:
    return counter(fakes["cuda"], "fake_cuda_allocations")


@pytest.mark.timeout(30)
def test_loads_the_fake_and_answers(driver: _native.CudaDriver, fakes: Fakes) -> None:
    assert os.path.samefile(driver.path, fakes["cuda"])
    assert driver.init(S).value == 12090
    assert driver.device_count(S).value == 2
    assert driver.pci_bus_id(1, S).text == "00000000:11:00.0"
    bad = driver.pci_bus_id(7, S)
    assert (bad.status, bad.code, bad.error_name) == (_native.GpuStatus.ERROR, 101, "CUDA_ERROR_INVALID_DEVICE")


@pytest.mark.timeout(30)
def test_probe_writes_reads_back_and_frees(driver: _native.CudaDriver, fakes: Fakes) -> None:
    out = driver.probe(0, 1 << 16, S)
    assert out.status == _native.GpuStatus.DONE and not out.context_lost
    assert allocations(fakes) == 0


@pytest.mark.timeout(30)
def test_stream_that_never_completes_times_out_without_burning_a_core(
    driver: _native.CudaDriver, fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODE", "stream_never_completes")
    queries = counter(fakes["cuda"], "fake_cuda_stream_queries")
    cpu = time.process_time()
    out = driver.synchronize_stream(0, 0, 500 * MS)
    cpu = time.process_time() - cpu
    assert out.status == _native.GpuStatus.TIMED_OUT and out.step == "cuStreamQuery"
    assert 0.5 <= out.elapsed_ns / S <= 0.5 + SLACK_S
    polls = counter(fakes["cuda"], "fake_cuda_stream_queries") - queries
    # Backoff 20 us doubling to 2 ms: a few hundred polls in 0.5 s, not millions.
    assert 5 <= polls <= 600, polls
    assert cpu < 0.2, f"the wait used {cpu:.2f}s of CPU"
    monkeypatch.setenv("FAKE_CUDA_MODE", "ok")
    assert driver.synchronize_stream(0, 0, S).status == _native.GpuStatus.DONE


@pytest.mark.timeout(30)
def test_hung_synchronize_is_abandoned_at_the_deadline(
    driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODE", "sync_hangs")
    abandoned = _native.abandoned_gpu_calls()
    out = driver.synchronize_context(0, 200 * MS)
    assert out.status == _native.GpuStatus.TIMED_OUT and out.step == "cuCtxSynchronize"
    grace = _native_grace_s()
    assert 0.2 <= out.elapsed_ns / S <= 0.2 + grace + SLACK_S
    assert _native.abandoned_gpu_calls() == abandoned + 1
    # The next call gets a fresh worker thread.
    monkeypatch.setenv("FAKE_CUDA_MODE", "ok")
    assert driver.synchronize_context(0, S).status == _native.GpuStatus.DONE


def _native_grace_s() -> float:
    return 0.05  # CudaDriver::kReportGraceNs


@pytest.mark.timeout(30)
def test_blocking_calls_release_the_gil(driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODE", "stream_never_completes")
    ticks = 0
    stop = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    try:
        driver.synchronize_stream(0, 0, 300 * MS)
    finally:
        stop.set()
        t.join()
    assert ticks >= 50, f"a Python thread ran only {ticks} times while the native call waited"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sticky", "oom", "vanish"])
def test_probe_classifies_errors(driver: _native.CudaDriver, fakes: Fakes, monkeypatch: pytest.MonkeyPatch,
                                 mode: str) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODE", mode)
    out = driver.probe(0, 4096, S)
    if mode == "sticky":
        assert (out.status, out.code, out.error_name) == (_native.GpuStatus.ERROR, 700, "CUDA_ERROR_ILLEGAL_ADDRESS")
        assert out.context_lost and out.step == "cuMemAlloc_v2"
    elif mode == "oom":
        assert (out.status, out.code) == (_native.GpuStatus.ERROR, 2)
        assert not out.context_lost
    else:  # the device dropped off the bus mid-probe: all ones read back
        assert out.status == _native.GpuStatus.CORRUPTED and out.context_lost and out.step == "compare"
    assert allocations(fakes) == 0


def test_sticky_classification_follows_cuda_h() -> None:
    # cuda.h: "the process must be terminated and relaunched" for these, plus
    # the uncorrectable ECC/NVLink errors and a device-side assert.
    for code in (214, 220, 226, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 721, 810, 911):
        assert _native.is_sticky_cuda_error(code), code
    for code in (0, 1, 2, 100, 101, 600, 701, 999):
        assert not _native.is_sticky_cuda_error(code), code


@pytest.mark.timeout(30)
def test_inactive_primary_context_is_not_created(
    driver: _native.CudaDriver, fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODE", "no_context")
    # Relative: a call abandoned by an earlier test still holds its retain.
    retained = counter(fakes["cuda"], "fake_cuda_retained_contexts")
    assert driver.probe(0, 4096, S).status == _native.GpuStatus.NO_CONTEXT
    assert counter(fakes["cuda"], "fake_cuda_retained_contexts") == retained
    assert allocations(fakes) == 0


def test_missing_symbol_and_missing_library_are_named(fakes: Fakes) -> None:
    with pytest.raises(RuntimeError, match="lacks cuStreamQuery"):
        _native.CudaDriver.open(fakes["cuda_no_stream_query"])
    with pytest.raises(RuntimeError, match="cannot load /nonexistent/libcuda.so.1"):
        _native.CudaDriver.open("/nonexistent/libcuda.so.1")


# ---------------------------------------------------------------------------
# CudaHealthCheck

STATE = None  # the checks read nothing from the state


@pytest.mark.timeout(30)
def test_health_check_passes_on_a_healthy_device(driver: _native.CudaDriver) -> None:
    check = health_check.CudaHealthCheck()
    assert check(STATE) is STATE  # type: ignore[arg-type]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sticky", "vanish"])
def test_health_check_context_lost(driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODE", mode)
    with pytest.raises(CudaContextLost) as info:
        health_check.CudaHealthCheck()(STATE)  # type: ignore[arg-type]
    assert info.value.exit_status == EXIT_CODE_CONTEXT_LOST == 76
    assert isinstance(info.value, HealthCheckError)


@pytest.mark.timeout(30)
def test_health_check_times_out_on_a_hung_sync(driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    monkeypatch.setenv("FAKE_CUDA_MODE", "sync_hangs")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="cuCtxSynchronize"):
        health_check.CudaHealthCheck(timeout=datetime.timedelta(seconds=0.3))(STATE)  # type: ignore[arg-type]
    assert time.monotonic() - started <= 0.3 + _native_grace_s() + SLACK_S


@pytest.mark.timeout(30)
def test_health_check_selects_the_device_by_local_rank(
    driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    check = health_check.CudaHealthCheck()
    check(STATE)  # type: ignore[arg-type]
    assert check.ordinal == 1
    # The fake has two devices: LOCAL_RANK 5 is device 1, as torch's
    # guessDeviceForRank (rank % getNumGPUs()) and Megatron-LM would take it.
    monkeypatch.setenv("LOCAL_RANK", "5")
    check(STATE)  # type: ignore[arg-type]
    assert check.ordinal == 1
    with pytest.raises(ValueError, match="device=5: this process sees 2 CUDA device"):
        health_check.CudaHealthCheck(device_index=5)(STATE)  # type: ignore[arg-type]
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        health_check.CudaHealthCheck()(STATE)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_one_visible_device_per_task_is_device_0(driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    # SLURM --gpus-per-task=1: the fourth task of a node sees one GPU (CUDA
    # device 0) and has LOCAL_RANK=3. Taking LOCAL_RANK as the ordinal gave
    # CUDA_ERROR_INVALID_DEVICE (101) and terminated a healthy rank.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert driver.device_count(S).value == 1
    check = health_check.CudaHealthCheck()
    assert check(STATE) is STATE  # type: ignore[arg-type]
    assert check.ordinal == 0


@pytest.mark.timeout(30)
def test_no_visible_device_is_unavailable_not_a_failure(
    driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CUDA_VISIBLE_DEVICES="" hides every device: cuInit answers
    # CUDA_ERROR_NO_DEVICE (100). That is "no GPU here", like a machine
    # without a driver, not a GPU in trouble.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("LOCAL_RANK", "3")
    out = driver.init(S)
    assert (out.status, out.code, out.error_name) == (_native.GpuStatus.ERROR, 100, "CUDA_ERROR_NO_DEVICE")
    assert health_check.CudaHealthCheck()(STATE) is STATE  # type: ignore[arg-type]
    with pytest.raises(GpuUnavailable, match="no CUDA device .*CUDA_ERROR_NO_DEVICE; CUDA_VISIBLE_DEVICES=''"):
        health_check.CudaHealthCheck(on_unavailable="fail")(STATE)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_unknown_error_on_a_working_context_is_a_lost_context(
    driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CUDA_ERROR_UNKNOWN (999) from cuCtxSynchronize on an active context:
    # the driver does not know what state the context is in.
    monkeypatch.setenv("FAKE_CUDA_MODE", "unknown")
    out = driver.synchronize_context(0, S)
    assert (out.code, out.error_name, out.context_lost) == (999, "CUDA_ERROR_UNKNOWN", True)
    assert not _native.is_sticky_cuda_error(999)  # cuda.h does not call it sticky: the context makes it so
    with pytest.raises(CudaContextLost, match="cuCtxSynchronize: CUDA_ERROR_UNKNOWN") as info:
        health_check.CudaHealthCheck()(STATE)  # type: ignore[arg-type]
    assert info.value.exit_status == EXIT_CODE_CONTEXT_LOST


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode, code, hint", [
    ("prohibited", 999, "compute mode is PROHIBITED"),
    ("device_unavailable", 46, "held by another process"),
])
def test_errors_outside_the_context_do_not_end_the_process_with_76(
    driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch, mode: str, code: int, hint: str
) -> None:
    # 999 from a first retain (cuda.h 12.9 line 5940) and 46 (line 2527) say
    # the device cannot be had by this process now, not that a context is
    # lost: a new process would meet them again, so no exit status 76.
    monkeypatch.setenv("FAKE_CUDA_MODE", mode)
    out = driver.probe(0, 4096, S)
    assert (out.code, out.step, out.context_lost) == (code, "cuDevicePrimaryCtxRetain", False)
    with pytest.raises(HealthCheckError, match=hint) as info:
        health_check.CudaHealthCheck()(STATE)  # type: ignore[arg-type]
    assert not isinstance(info.value, CudaContextLost)


@pytest.mark.timeout(30)
def test_out_of_memory_probe_does_not_end_a_healthy_rank(
    driver: _native.CudaDriver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The context answered cuCtxSynchronize; the probe's allocation failed
    # because the memory is taken (torch's caching allocator keeps what it
    # freed). The rank is healthy.
    monkeypatch.setenv("FAKE_CUDA_MODE", "oom")
    with caplog.at_level("WARNING", logger="inprocess"):
        assert health_check.CudaHealthCheck()(STATE) is STATE  # type: ignore[arg-type]
    assert "no 1048576 bytes free for the probe (CUDA_ERROR_OUT_OF_MEMORY)" in caplog.text


@pytest.mark.timeout(30)
def test_health_check_without_a_driver_skips_or_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INPROCESS_LIBCUDA", "/nonexistent/libcuda.so.1")
    libraries.forget()
    try:
        assert health_check.CudaHealthCheck()(STATE) is STATE  # type: ignore[arg-type]
        with pytest.raises(GpuUnavailable, match="CudaHealthCheck unavailable: cannot load /nonexistent"):
            health_check.CudaHealthCheck(on_unavailable="fail")(STATE)  # type: ignore[arg-type]
    finally:
        libraries.forget()
    with pytest.raises(ValueError, match="on_unavailable='ignore'"):
        health_check.CudaHealthCheck(on_unavailable="ignore")


@pytest.mark.timeout(60)
def test_leave_for_lost_context_exits_with_the_documented_status() -> None:
    code = (
        "from inprocess.gpu import CudaContextLost, leave_for_lost_context\n"
        "import atexit; atexit.register(lambda: print('atexit ran'))\n"
        "leave_for_lost_context(CudaContextLost('illegal address', 700), lambda: print('left the job', flush=True))\n"
    )
    result = run_python(code)
    assert result.returncode == EXIT_CODE_CONTEXT_LOST, result.stderr
    assert "left the job" in result.stdout  # the restart loop's leave step ran first
    assert "atexit ran" not in result.stdout  # no exit machinery that could touch the lost context
    assert "CUDA context lost" in result.stderr or result.stderr == ""
