"""The NCCL layer against the fake libnccl (tests/fakes/fake_nccl.c): grouped
abort releasing blocked collectives, revoke, hung aborts at their deadline,
never a second libnccl, and the Python release path with its torch fallback."""

from __future__ import annotations

import ctypes
import datetime
import os
import threading
import time
from collections.abc import Iterator

import pytest

from fakes.gpu_fakes import Fakes, build_fakes, counter, run_python, skip_where_torch_loaded_nccl
from inprocess import _native
from inprocess.abort import AbortTorchDistributed
from inprocess.gpu import NcclAbortTimeout, libraries, nccl_abort

MS = 1_000_000
S = 1_000_000_000
SLACK_S = 0.25


@pytest.fixture(scope="module")
def fakes() -> Fakes:
    skip_where_torch_loaded_nccl()
    return build_fakes()


@pytest.fixture
def nccl(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> Iterator[_native.NcclLibrary]:
    monkeypatch.setenv("FAKE_NCCL_MODE", "ok")
    monkeypatch.setenv("INPROCESS_LIBNCCL", fakes["nccl"])
    libraries.forget()
    library, reason = libraries.nccl()
    assert library is not None, reason
    yield library
    libraries.forget()


class FakeComms:
    """Communicators of the fake, and collectives blocked on them."""

    def __init__(self, path: str, count: int):
        self.lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        self.lib.fake_nccl_comm_create.restype = ctypes.c_void_p
        self.lib.fake_nccl_comm_state.argtypes = [ctypes.c_void_p]
        self.lib.fake_nccl_collective_wait.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.lib.fake_nccl_comm_free.argtypes = [ctypes.c_void_p]
        self.pointers: list[int] = [int(self.lib.fake_nccl_comm_create()) for _ in range(count)]
        self.released: list[float] = []
        self.threads: list[threading.Thread] = []

    def block_collectives(self, timeout_ms: int = 10_000) -> None:
        lock = threading.Lock()

        def wait(ptr: int) -> None:
            if self.lib.fake_nccl_collective_wait(ptr, timeout_ms):  # ctypes releases the GIL
                with lock:
                    self.released.append(time.monotonic())

        self.threads = [threading.Thread(target=wait, args=(p,)) for p in self.pointers]
        for t in self.threads:
            t.start()
        time.sleep(0.05)  # every thread inside its wait

    def join(self) -> None:
        for t in self.threads:
            t.join(15)

    def state(self, i: int) -> int:
        return int(self.lib.fake_nccl_comm_state(self.pointers[i]))

    def free(self) -> None:
        for p in self.pointers:
            self.lib.fake_nccl_comm_free(p)


@pytest.mark.timeout(30)
def test_loader_reports_the_library(nccl: _native.NcclLibrary, fakes: Fakes) -> None:
    assert os.path.samefile(nccl.path, fakes["nccl"])
    assert nccl.version == 22807 and nccl.has_revoke
    assert dict(nccl.symbols()) == {
        "ncclGetVersion": True, "ncclGetErrorString": True, "ncclCommAbort": True,
        "ncclCommGetAsyncError": True, "ncclGroupStart": True, "ncclGroupEnd": True, "ncclCommRevoke": True,
    }
    assert nccl.error_string(6).startswith("remote process exited")
    found = _native.NcclLibrary.find_loaded()
    assert found is not None and os.path.samefile(found.path, fakes["nccl"]) and found.was_loaded_before


@pytest.mark.timeout(30)
def test_grouped_abort_releases_every_blocked_collective(nccl: _native.NcclLibrary, fakes: Fakes) -> None:
    comms = FakeComms(fakes["nccl"], 3)
    try:
        comms.block_collectives()
        groups = counter(fakes["nccl"], "fake_nccl_group_ends")
        started = time.monotonic()
        out = nccl.abort(comms.pointers, True, S)
        comms.join()
        assert out.status == _native.GpuStatus.DONE, out.message
        assert out.results == [0, 0, 0]
        assert len(comms.released) == 3 and max(comms.released) - started < 0.5
        assert [comms.state(i) & 1 for i in range(3)] == [1, 1, 1]
        assert counter(fakes["nccl"], "fake_nccl_group_ends") == groups + 1  # one group for all three
    finally:
        comms.free()


@pytest.mark.timeout(30)
def test_abort_is_grouped_only_where_nccl_takes_it(
    nccl: _native.NcclLibrary, fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The version is read when the library object is made: a second object
    # over the same loaded copy sees the fake's answer for 2.21.5.
    monkeypatch.setenv("FAKE_NCCL_VERSION", "22105")
    old = _native.NcclLibrary.open(fakes["nccl"])
    assert old.version == 22105
    comms = FakeComms(fakes["nccl"], 2)
    try:
        groups = counter(fakes["nccl"], "fake_nccl_group_ends")
        out = old.abort(comms.pointers, True, S)
        assert out.status == _native.GpuStatus.DONE and [comms.state(i) & 1 for i in range(2)] == [1, 1]
        assert counter(fakes["nccl"], "fake_nccl_group_ends") == groups  # one by one, no group
    finally:
        comms.free()


@pytest.mark.timeout(30)
def test_hung_abort_returns_at_its_deadline(
    nccl: _native.NcclLibrary, fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    comms = FakeComms(fakes["nccl"], 2)
    try:
        monkeypatch.setenv("FAKE_NCCL_MODE", "abort_hangs")
        abandoned = _native.abandoned_gpu_calls()
        out = nccl.abort(comms.pointers, True, 200 * MS)
        assert out.status == _native.GpuStatus.TIMED_OUT and "ncclCommAbort" in out.message
        assert 0.2 <= out.elapsed_ns / S <= 0.2 + SLACK_S
        assert _native.abandoned_gpu_calls() == abandoned + 1
        monkeypatch.setenv("FAKE_NCCL_MODE", "ok")
        # A fresh worker serves the next call while the abandoned one hangs on.
        assert nccl.async_errors(comms.pointers, S).status == _native.GpuStatus.DONE
    finally:
        comms.free()


@pytest.mark.timeout(30)
def test_revoke_releases_collectives_and_waits_for_quiescence(
    nccl: _native.NcclLibrary, fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    comms = FakeComms(fakes["nccl"], 2)
    try:
        comms.block_collectives()
        out = nccl.revoke(comms.pointers, [True, True], S)
        comms.join()
        assert out.status == _native.GpuStatus.DONE and out.results == [0, 0]
        assert len(comms.released) == 2
        assert [comms.state(i) for i in range(2)] == [2, 2]  # revoked, not freed (aborted)
        # Revoked communicators that never quiesce: the deadline, not a hang.
        monkeypatch.setenv("FAKE_NCCL_MODE", "revoke_stuck")
        out = nccl.revoke(comms.pointers, [True, True], 200 * MS)
        assert out.status == _native.GpuStatus.TIMED_OUT and "in progress" in out.message
    finally:
        comms.free()


@pytest.mark.timeout(30)
def test_async_errors(nccl: _native.NcclLibrary, fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    comms = FakeComms(fakes["nccl"], 2)
    try:
        monkeypatch.setenv("FAKE_NCCL_ASYNC_ERROR", "6")
        out = nccl.async_errors(comms.pointers, S)
        assert out.status == _native.GpuStatus.DONE and out.results == [6, 6]
    finally:
        comms.free()


@pytest.mark.timeout(30)
def test_a_second_libnccl_is_never_loaded(nccl: _native.NcclLibrary, fakes: Fakes) -> None:
    with pytest.raises(ValueError, match="refusing to load a second copy"):
        _native.NcclLibrary.open(fakes["nccl_no_revoke"])
    same = _native.NcclLibrary.open(fakes["nccl"])  # the loaded file itself: the same copy
    assert same.was_loaded_before


@pytest.mark.timeout(60)
def test_variants_in_a_fresh_process(fakes: Fakes) -> None:
    code = (
        "import sys, torch\n"
        "from inprocess import _native\n"
        "assert _native.NcclLibrary.find_loaded() is None, 'CPU torch loads no libnccl'\n"
        "lib = _native.NcclLibrary.open(sys.argv[1] if len(sys.argv) > 1 else {!r})\n"
        "assert not lib.has_revoke\n"
        "out = lib.revoke([], [], 10**9)\n"
        "assert out.status == _native.GpuStatus.ERROR and '2.28.7' in out.message, out.message\n"
        "print('ok')\n"
    ).format(fakes["nccl_no_revoke"])
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    code = (
        "from inprocess import _native\n"
        "try:\n"
        "    _native.NcclLibrary.open({!r})\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    ).format(fakes["nccl_no_abort"])
    result = run_python(code)
    assert result.returncode == 0 and "lacks ncclCommAbort" in result.stdout, result.stderr


# ---------------------------------------------------------------------------
# The Python release path (inprocess.gpu.nccl_abort) with stand-ins for
# torch's ProcessGroupNCCL backends.


class FakeBackend:
    def __init__(self, pointer: int = 0, hang_s: float = 0.0):
        self.pointer = pointer
        self.hang_s = hang_s
        self.aborted = threading.Event()

    def _comm_ptr(self) -> int:
        if not self.pointer:
            raise RuntimeError("no communicator yet")
        return self.pointer

    def abort(self) -> None:
        time.sleep(self.hang_s)
        self.aborted.set()


@pytest.mark.timeout(30)
def test_release_revokes_then_lets_torch_abort(nccl: _native.NcclLibrary, fakes: Fakes) -> None:
    comms = FakeComms(fakes["nccl"], 2)
    try:
        comms.block_collectives()
        backends = [FakeBackend(p) for p in comms.pointers] + [FakeBackend()]
        report = nccl_abort.release(backends, 5.0, revoke=True)
        comms.join()
        assert report.revoked and report.pointers == 2 and report.torch_aborted == 3
        assert len(comms.released) == 2 and all(b.aborted.is_set() for b in backends)
        assert [comms.state(i) for i in range(2)] == [2, 2]  # torch, not us, frees them
    finally:
        comms.free()


@pytest.mark.timeout(30)
def test_release_raises_at_the_deadline_when_torch_abort_hangs(nccl: _native.NcclLibrary) -> None:
    started = time.monotonic()
    with pytest.raises(NcclAbortTimeout, match="did not return by its deadline"):
        nccl_abort.release([FakeBackend(hang_s=10)], 0.3)
    assert time.monotonic() - started < 0.3 + SLACK_S


@pytest.mark.timeout(30)
def test_release_without_a_libnccl_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INPROCESS_LIBNCCL", raising=False)
    libraries.forget()
    monkeypatch.setattr(_native.NcclLibrary, "find_loaded", staticmethod(lambda: None))
    backend = FakeBackend(pointer=1234)  # a pointer, but no shared libnccl to revoke it with
    report = nccl_abort.release([backend], 1.0, revoke=True)
    assert not report.revoked and report.torch_aborted == 1 and backend.aborted.is_set()
    libraries.forget()


@pytest.mark.timeout(30)
def test_abort_by_pointer_for_a_leaving_rank(nccl: _native.NcclLibrary, fakes: Fakes) -> None:
    comms = FakeComms(fakes["nccl"], 2)
    try:
        out = nccl_abort.abort_by_pointer(comms.pointers, 1.0)
        assert out.status == _native.GpuStatus.DONE and [comms.state(i) & 1 for i in range(2)] == [1, 1]
    finally:
        comms.free()


# ---------------------------------------------------------------------------
# The flight recorder's dump: tests/test_flight_recorder.py


def test_abort_hook_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="torch_fr_trace_path='x_{host}'"):
        AbortTorchDistributed(torch_fr_trace_path="x_{host}")
    with pytest.raises(ValueError, match="nccl_timeout=datetime.timedelta\\(0\\)"):
        AbortTorchDistributed(nccl_timeout=datetime.timedelta(0))
    with pytest.raises(ValueError, match="overlap_next_iteration=True needs overlap_teardown=True"):
        AbortTorchDistributed(overlap_teardown=False, overlap_next_iteration=True)
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(ValueError, match=f"overlap_memory_bytes={bad!r}: expected an int >= 0 or None"):
            AbortTorchDistributed(overlap_next_iteration=True, overlap_memory_bytes=bad)  # type: ignore[arg-type]
    hook = AbortTorchDistributed(torch_fr_trace_path="/tmp/fr_{rank}")
    assert hook.torch_fr_trace_path == "/tmp/fr_{rank}"
