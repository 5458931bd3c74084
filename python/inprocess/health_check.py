"""``health_check`` hooks: run on every rank during a restart, after finalize."""

from __future__ import annotations

import abc
import datetime
import logging
import os
import pathlib
import time

from . import _native
from .exception import HealthCheckError, RestartError, TimeoutError
from .gpu import device, libraries
from .gpu.bounded import call_within
from .gpu.errors import CudaContextLost, GpuUnavailable, GpuUnhealthy
from .state import FrozenState

log = logging.getLogger("inprocess")


class HealthCheck(abc.ABC):
    """Decides whether this rank may take part in the next iteration.

    Any exception raised here (typically
    :class:`~inprocess.exception.HealthCheckError`) terminates this rank; the
    others continue without it.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState | None:
        raise NotImplementedError


class FaultCounterExceeded(RestartError):
    """Raised by :class:`FaultCounter` on a rank whose function raised more than
    ``max_rank_faults`` times (as in NVRx). The rank is terminated; its caller
    gets :class:`~inprocess.exception.HealthCheckError` chained to it, as for
    any exception of a health check during a restart."""


class FaultCounter(HealthCheck):
    """Terminates a rank whose own function raised more than ``max_rank_faults`` times,
    with :class:`FaultCounterExceeded`.

    What counts is an exception this rank's function raised
    (``state.fn_exception``), as in NVRx; a restart that interrupted this rank
    for another rank's fault does not. A communication error that another
    rank's death caused counts when it came out of the function before the
    restart reached this rank (the restart summary marks it as a consequence,
    but the health check runs before the faults are gathered); and an
    exception of its own that came out only after the restart had reached it
    (the summary may name it the cause) does not count. ``faults_count`` is
    the number counted so far (NVRx's attribute).
    """

    def __init__(self, max_rank_faults: int | None = None):
        given: object = max_rank_faults
        if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 0):
            raise ValueError(f"max_rank_faults={max_rank_faults!r}: expected an int >= 0 or None")
        self.max_rank_faults = max_rank_faults
        self.faults_count = 0

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.fn_exception is None:
            return state
        self.faults_count += 1
        if self.max_rank_faults is not None and self.faults_count > self.max_rank_faults:
            raise FaultCounterExceeded(
                f"initial rank {state.initial_rank} raised {self.faults_count} faults, "
                f"more than max_rank_faults={self.max_rank_faults}"
            )
        return state


# ---------------------------------------------------------------------------
# GPU checks. Each is bounded by a deadline (design principle 7): a hung
# driver or NVML call fails the check instead of hanging the restart. Where
# the GPU, the driver or NVML is missing, each says so and, by its
# ``on_unavailable``, skips (logs at INFO and passes) or fails (raises
# GpuUnavailable). The device is ``device_index``, else LOCAL_RANK modulo the
# devices this process sees (inprocess.gpu.device).

_ON_UNAVAILABLE = ("skip", "fail")
_said_unavailable: set[str] = set()  # "unavailable" messages already logged at INFO in this process


def _check_on_unavailable(value: str) -> str:
    if value not in _ON_UNAVAILABLE:
        raise ValueError(f"on_unavailable={value!r}: expected one of {_ON_UNAVAILABLE}")
    return value


def _positive_seconds(name: str, value: object) -> float:
    if not isinstance(value, datetime.timedelta) or value.total_seconds() <= 0:
        raise ValueError(f"{name}={value!r}: expected a positive datetime.timedelta")
    return value.total_seconds()


class _GpuCheck(HealthCheck):
    """What the GPU checks share: the device, the deadline, unavailability."""

    def __init__(self, timeout: datetime.timedelta, device_index: int | None, on_unavailable: str):
        self.timeout = timeout
        self._timeout_s = _positive_seconds("timeout", timeout)
        if device_index is not None:
            device.cuda_ordinal(device_index)  # validates
        self.device_index = device_index
        self.on_unavailable = _check_on_unavailable(on_unavailable)
        self.ordinal: int | None = None  # the CUDA device the last run checked

    def _unavailable(self, state: FrozenState, reason: str) -> FrozenState:
        message = f"{type(self).__name__} unavailable: {reason}"
        if self.on_unavailable == "fail":
            raise GpuUnavailable(message)
        # Once per process at INFO (the same reason holds for every later check), then at DEBUG.
        first = message not in _said_unavailable
        _said_unavailable.add(message)
        log.log(logging.INFO if first else logging.DEBUG, "%s; skipped%s", message,
                " (said once: later checks skip at DEBUG level)" if first else "")
        return state

    def _cuda_device(self, driver: _native.CudaDriver) -> tuple[int | None, str]:
        """This rank's CUDA device, by the devices the driver lets this
        process see; None and the reason where it sees none."""
        count = driver.device_count(int(self._timeout_s * 1e9))
        if count.status == _native.GpuStatus.TIMED_OUT:
            raise TimeoutError(f"{type(self).__name__}: {count.step} not done within {self._timeout_s:g}s")
        if count.status != _native.GpuStatus.DONE:
            if count.code in device.NO_DEVICE_ERRORS:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                return None, f"no CUDA device ({count.step}: {count.error_name}; CUDA_VISIBLE_DEVICES={visible!r})"
            raise HealthCheckError(f"{type(self).__name__}: {count.step}: {count.error_name} ({count.code})")
        if count.value == 0:
            return None, "the CUDA driver reports no device"
        return device.cuda_ordinal(self.device_index, int(count.value)), ""

    def _nvml_report(self) -> tuple[_native.NvmlReport | None, str]:
        library, reason = libraries.nvml()
        if library is None:
            return None, reason
        bus_id = ""
        driver, _ = libraries.cuda_driver()
        if driver is not None:
            ordinal, reason = self._cuda_device(driver)
            if ordinal is None:
                return None, reason
            found = driver.pci_bus_id(ordinal, int(self._timeout_s * 1e9))
            if found.status == _native.GpuStatus.DONE:
                bus_id = found.text
        else:
            visible = device.visible_in_environment()
            if visible == 0:
                return None, f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} leaves no device"
            ordinal = device.cuda_ordinal(self.device_index, visible)
        self.ordinal = ordinal
        report = library.query(device.nvml_identifier(ordinal, bus_id), int(self._timeout_s * 1e9))
        if report.status == _native.GpuStatus.TIMED_OUT:
            raise TimeoutError(f"{type(self).__name__}: NVML did not answer within {self._timeout_s:g}s")
        if report.gpu_lost:
            raise CudaContextLost(f"GPU {ordinal} fell off the bus or is inaccessible ({report.step})")
        if report.status != _native.GpuStatus.DONE:
            raise GpuUnhealthy(f"GPU {ordinal}: {report.step} failed: {report.error_string} ({report.error})")
        return report, ""


class CudaHealthCheck(_GpuCheck):
    """Checks that this process's CUDA context still works (NVRx's name).

    Synchronises the device's primary context (every kernel issued must
    finish) within ``timeout``, then runs a probe: allocate, write, copy back,
    compare, free. A sync or probe still running at the deadline raises
    :class:`~inprocess.exception.TimeoutError`; a sticky CUDA error (illegal
    address, launch failure, uncorrectable ECC, ...) or data read back wrong
    raises :class:`~inprocess.gpu.CudaContextLost` (the rank must leave with
    exit status 76); another CUDA error raises ``HealthCheckError``.

    A device whose primary context was never made (CUDA not used yet) has
    nothing to check: the check passes without creating a context.
    """

    def __init__(
        self,
        timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        device_index: int | None = None,
        probe_bytes: int = 1 << 20,
        on_unavailable: str = "skip",
    ):
        super().__init__(timeout, device_index, on_unavailable)
        size: object = probe_bytes
        if isinstance(size, bool) or not isinstance(size, int) or not 4 <= size <= 1 << 30:
            raise ValueError(f"probe_bytes={probe_bytes!r}: expected an int in [4, 2**30]")
        self.probe_bytes = probe_bytes

    def __call__(self, state: FrozenState) -> FrozenState:
        driver, reason = libraries.cuda_driver()
        if driver is None:
            return self._unavailable(state, reason)
        ordinal, reason = self._cuda_device(driver)
        if ordinal is None:
            return self._unavailable(state, reason)
        self.ordinal = ordinal
        deadline = time.monotonic() + self._timeout_s
        synced = driver.synchronize_context(ordinal, int(self._timeout_s * 1e9))
        if synced.status == _native.GpuStatus.NO_CONTEXT:
            log.debug("CudaHealthCheck: device %d has no active context; nothing to check", ordinal)
            return state
        self._raise_for(synced, ordinal)
        left = max(deadline - time.monotonic(), 0.0)
        probed = driver.probe(ordinal, self.probe_bytes, int(left * 1e9))
        if probed.status == _native.GpuStatus.ERROR and probed.code == _CUDA_ERROR_OUT_OF_MEMORY:
            # The context answered the synchronisation: it works. A device
            # whose memory torch's caching allocator keeps (it frees nothing
            # back to the driver by itself) has none left for the probe;
            # that is no reason to end a healthy rank.
            log.warning("CudaHealthCheck: CUDA device %d has no %d bytes free for the probe (%s); "
                        "the synchronisation passed, the rank goes on", ordinal, self.probe_bytes, probed.error_name)
            return state
        self._raise_for(probed, ordinal)
        return state

    def _raise_for(self, outcome: _native.CudaOutcome, ordinal: int) -> None:
        status = outcome.status
        if status in (_native.GpuStatus.DONE, _native.GpuStatus.NO_CONTEXT):
            return
        what = f"CUDA device {ordinal}, {outcome.step}"
        if status == _native.GpuStatus.TIMED_OUT:
            raise TimeoutError(f"{what}: not done within {self._timeout_s:g}s")
        if outcome.context_lost:
            detail = outcome.error_name or "data read back differs from what was written"
            raise CudaContextLost(f"{what}: {detail}", outcome.code, outcome.error_name)
        hint = _CUDA_ERROR_HINTS.get((outcome.code, outcome.step), "")
        raise HealthCheckError(f"{what}: {outcome.error_name} ({outcome.code}){hint}")


_CUDA_ERROR_OUT_OF_MEMORY = 2
# Errors that end the check but say nothing about this process's context, so
# the rank is terminated without exit status 76 (a new process on the same
# device would meet them again).
_CUDA_ERROR_HINTS = {
    # cuda.h 12.9 line 2527: "requested CUDA device is unavailable at the
    # current time ... EXCLUSIVE_PROCESS or PROHIBITED".
    (46, "cuDevicePrimaryCtxRetain"): ": the device is held by another process (compute mode EXCLUSIVE_PROCESS)",
    # cuda.h 12.9 line 5940: a first retain fails with CUDA_ERROR_UNKNOWN
    # "if the compute mode of the device is CU_COMPUTEMODE_PROHIBITED".
    (999, "cuDevicePrimaryCtxRetain"): ": the device's compute mode is PROHIBITED",
}


class NvmlHealthCheck(_GpuCheck):
    """Asks NVML whether this rank's GPU can be trusted. Fails on volatile
    uncorrectable ECC errors counted since the check's first run (its
    baseline: the volatile count keeps errors since the driver was loaded,
    errors the driver has already handled by a row remap or a page
    retirement included, and would otherwise fail every later job on that
    GPU until a reboot), a row remap pending or failed, pages pending
    retirement (``GpuUnhealthy``), and a GPU that fell off the bus
    (``CudaContextLost``). A counter the device does not report is not
    checked. Retired pages as such are not a failure (a GPU collects a few in
    its life); pages still waiting for retirement need a reset."""

    def __init__(
        self,
        timeout: datetime.timedelta = datetime.timedelta(seconds=10),
        device_index: int | None = None,
        on_unavailable: str = "skip",
    ):
        super().__init__(timeout, device_index, on_unavailable)
        self.ecc_baseline: int | None = None

    def __call__(self, state: FrozenState) -> FrozenState:
        report, reason = self._nvml_report()
        if report is None:
            return self._unavailable(state, reason)
        problems = []
        ecc = report.ecc_volatile_uncorrected
        if ecc >= 0 and self.ecc_baseline is None:
            self.ecc_baseline = ecc
            if ecc > 0:
                log.info("NvmlHealthCheck: GPU %s had %d volatile uncorrectable ECC errors at the first check "
                         "(the baseline); only new ones fail the check", self.ordinal, ecc)
        if self.ecc_baseline is not None and ecc > self.ecc_baseline:
            problems.append(f"{ecc - self.ecc_baseline} new volatile uncorrectable ECC errors "
                            f"({ecc} since the driver was loaded, {self.ecc_baseline} at the first check)")
        if report.remapped_rows_pending > 0:
            problems.append("a row remap is pending (needs a GPU reset)")
        if report.remapped_rows_failure > 0:
            problems.append("a row remap failed")
        if report.retired_pages_pending > 0:
            problems.append("pages are pending retirement (needs a GPU reset)")
        if problems:
            raise GpuUnhealthy(f"GPU {self.ordinal}: " + "; ".join(problems))
        return state


class _ChainedCheck(_GpuCheck):
    """NVRx's chained checks' keywords: the device first, then the deadline (10 s by default)."""

    def __init__(
        self,
        device_index: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=10),
        on_unavailable: str = "skip",
    ):
        super().__init__(timeout, device_index, on_unavailable)


class ChainedGPUHealthCheck(_ChainedCheck):
    """NVRx's GPU check: fails when the driver reports a recovery action for
    this GPU (reset, node reboot, drain; NVML's GPU recovery action field,
    driver 570 or later), or the GPU fell off the bus. Unavailable on older
    drivers."""

    def __call__(self, state: FrozenState) -> FrozenState:
        report, reason = self._nvml_report()
        if report is None:
            return self._unavailable(state, reason)
        if report.recovery_action < 0:
            return self._unavailable(state, "the driver reports no GPU recovery action (driver 570 or later)")
        if report.recovery_action != 0:
            raise GpuUnhealthy(
                f"GPU {self.ordinal}: the driver asks for recovery action "
                f"{report.recovery_action} (1 reset, 2 node reboot, 3 drain P2P, 4 drain and reset)"
            )
        return state


class ChainedNVLHealthCheck(_ChainedCheck):
    """NVRx's NVLink check: the NVLinks of this GPU that were active when the
    check was first run (its baseline) must still be active. Where NVRx only
    logs a failure, this one raises ``GpuUnhealthy``; wrap it to ignore it.
    Unavailable on a GPU without NVLink."""

    baseline: list[int] | None = None  # the links active at the first run

    def __call__(self, state: FrozenState) -> FrozenState:
        report, reason = self._nvml_report()
        if report is None:
            return self._unavailable(state, reason)
        links = list(report.nvlinks)
        if not any(state_ == 1 for state_ in links):
            if self.baseline is None:
                return self._unavailable(state, "no active NVLink on this GPU")
        if self.baseline is None:
            self.baseline = links
            return state
        down = [i for i, was in enumerate(self.baseline) if was == 1 and (i >= len(links) or links[i] != 1)]
        if down:
            raise GpuUnhealthy(f"GPU {self.ordinal}: NVLinks {down} went down")
        return state


class ChainedNicHealthCheck(_GpuCheck):
    """NVRx's NIC check: no InfiniBand port's ``link_downed`` counter
    (``/sys/class/infiniband/<nic>/ports/<port>/counters/link_downed``) has
    grown since the check was made. ``nics`` limits it to some devices (all
    by default). Unavailable without InfiniBand devices."""

    def __init__(
        self,
        device_index: int | None = None,
        nics: list[str] | None = None,
        sysfs_root: str = "/sys/class/infiniband",
        timeout: datetime.timedelta = datetime.timedelta(seconds=10),
        on_unavailable: str = "skip",
    ):
        super().__init__(timeout, device_index, on_unavailable)
        self.nics = list(nics) if nics is not None else None
        self.sysfs_root = sysfs_root
        self.baseline = self._read()

    def _read(self) -> dict[str, int]:
        counters: dict[str, int] = {}
        root = pathlib.Path(self.sysfs_root)
        if not root.is_dir():
            return counters
        for nic in sorted(p.name for p in root.iterdir()):
            if self.nics is not None and nic not in self.nics:
                continue
            for port in sorted((root / nic / "ports").glob("*")):
                counter = port / "counters" / "link_downed"
                try:
                    counters[f"{nic}/{port.name}"] = int(counter.read_text().strip())
                except (OSError, ValueError):
                    continue
        return counters

    def __call__(self, state: FrozenState) -> FrozenState:
        result = call_within(self._read, self._timeout_s, "inprocess-nic-check")
        if not result.finished:
            raise TimeoutError(f"ChainedNicHealthCheck: sysfs not read within {self._timeout_s:g}s")
        if result.error is not None:
            raise result.error
        now = result.value or {}
        if not now and not self.baseline:
            return self._unavailable(state, f"no InfiniBand port counters under {self.sysfs_root}")
        grown = {port: now[port] - was for port, was in self.baseline.items() if now.get(port, was) > was}
        if grown:
            raise HealthCheckError(f"NIC link went down since the baseline: {grown}")
        return state
