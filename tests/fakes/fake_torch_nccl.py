"""A fake of torch's NCCL backend object (``ProcessGroupNCCL``) over the fake
libnccl, for what the NCCL release calls: ``_comm_ptr()``, ``_is_initialized()``,
``get_error()``, ``abort()``, ``options.config.blocking``, ``bound_device_id``,
and the watchdog that aborts the communicators after an error.

It follows torch 2.13-era sources (github.com/cyyever/pytorch, a fork of
pytorch/pytorch; ProcessGroupNCCL.cpp and NCCLUtils.cpp at commits
0b10febc2dd0 and 18ddaae40b48, init.cpp at 03a5d6dea676), whose declarations
match the ProcessGroupNCCL.hpp and NCCLUtils.hpp shipped in the torch 2.13.0
wheel (getCommPtr line 920, isInitialized line 992, getError line 994,
abortComms line 1118):

- ``_comm_ptr()`` (getCommPtr) answers for the calling thread's current device
  and holds the GIL while it waits for the group's mutex (fake_c10d.c).
- ``_is_initialized()`` and ``get_error()`` release the GIL (bound with
  ``gil_scoped_release``); get_error() reads ``error_`` under ``errorMutex_``.
- ``abort()`` runs ``abortComms()`` on a ``std::async`` thread and waits for it
  up to the group's timeout; abortComms() takes the group's mutex and aborts
  its communicators inside one ncclGroupStart/End (NCCL 2.22 and later), each
  under its device's guard (``NCCLComm::abort``: OptionalCUDAGuard; a
  communicator already aborted is skipped).
- Point-to-point communicators: a ``send``/``recv`` between two ranks makes a
  communicator of its own, kept in ``devNCCLCommMap_`` under the pair's key
  (``getKeySendRecv``) beside the collective one (``getKeyFromDevice``).
  ``getCommPtr()`` returns the collective one only; ``abortComms()`` aborts
  every communicator of the map.
- The watchdog (``Watchdog::runLoop``) reads ``ncclCommGetAsyncError`` under the
  communicator's mutex; on an error it sets ``error_``, sleeps
  ``getDumpTimeout() * 4`` (``dump_wait_s`` here) and, when
  ``SHOULD_CLEAN_UP(asyncErrorHandling_)`` (modes 1 and 2), aborts the
  communicators: ncclCommAbort frees them.
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
import time
from types import SimpleNamespace

from .gpu_fakes import Fakes


class ErrorType(enum.Enum):
    SUCCESS = 0
    TIMEOUT = 1
    COMM_ERROR = 2
    REMOTE_ERROR = 3


class FakeDevice:
    """What ``bound_device_id`` holds (a torch.device of type cuda)."""

    def __init__(self, index: int):
        self.type = "cuda"
        self.index = index


class FakeProcessGroupNCCL:
    def __init__(
        self,
        fakes: Fakes,
        device: int,
        blocking: bool = True,
        stream: int = -1,
        bound: bool = False,
        async_error_handling: int = 3,
        dump_wait_s: float = 0.0,
        ready: bool = True,
        timeout_s: float = 600.0,
        nccl: str | None = None,
    ):
        self.device = device
        self.timeout_s = timeout_s
        self.async_error_handling = async_error_handling
        self.dump_wait_s = dump_wait_s
        self.bound_device_id: FakeDevice | None = FakeDevice(device) if bound else None
        self.options = SimpleNamespace(config=SimpleNamespace(blocking=1 if blocking else 0))
        self._c10d = ctypes.CDLL(fakes["c10d"])  # calls release the GIL
        self._c10d_gil = ctypes.PyDLL(fakes["c10d"])  # calls hold it, as the _comm_ptr binding
        self._nccl = ctypes.CDLL(nccl or fakes["nccl"], mode=os.RTLD_NOLOAD)
        self._nccl_gil = ctypes.PyDLL(nccl or fakes["nccl"], mode=os.RTLD_NOLOAD)
        for lib in (self._c10d, self._c10d_gil):
            lib.fake_pg_new.restype = ctypes.c_void_p
            for name in ("fake_pg_lock", "fake_pg_unlock", "fake_pg_is_initialized"):
                getattr(lib, name).argtypes = [ctypes.c_void_p]
            lib.fake_pg_set_comm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int]
            lib.fake_pg_comm_ptr.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.fake_pg_comm_ptr.restype = ctypes.c_long
            lib.fake_pg_mark_aborted.argtypes = [ctypes.c_void_p, ctypes.c_int]
            lib.fake_pg_aborted.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self._nccl.fake_nccl_comm_create_on.restype = ctypes.c_void_p
        self._nccl.fake_nccl_comm_create_on.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        for name in ("fake_nccl_kernel_launch", "ncclCommAbort", "fake_nccl_comm_state"):
            getattr(self._nccl, name).argtypes = [ctypes.c_void_p]
        self._nccl.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._nccl.fake_nccl_set_async_error.argtypes = [ctypes.c_void_p, ctypes.c_int]
        comm = self._nccl.fake_nccl_comm_create_on(device, 1 if blocking else 0, stream)
        if not comm:  # ncclCommInitRankConfig's cudaMalloc failed (FAKE_CUDA_MEMORY_BYTES)
            raise RuntimeError(f"NCCL error on device {device}: unhandled cuda error, Last error: out of memory")
        self.comm = int(comm)
        self._pg = self._c10d.fake_pg_new()
        # A blocking communicator is initialized when created; a non-blocking one
        # only once getNcclComm() saw it ready (NCCLUtils.cpp, NCCLComm::create).
        self._c10d.fake_pg_set_comm(self._pg, device, self.comm, 1 if blocking else 0, 0 if ready else 1)
        self._error = ErrorType.SUCCESS
        self._error_mutex = threading.Lock()
        self._comm_mutex = threading.Lock()  # NCCLComm::mutex_
        self._terminate = threading.Event()
        self.aborts_started = 0
        self.watchdog_freed = threading.Event()
        self._comm_ptr_read = threading.Event()
        self._free_right_after_comm_ptr = False
        self._watchdog: threading.Thread | None = None
        self.p2p: list[int] = []  # point-to-point communicators (devNCCLCommMap_'s send/recv keys)
        self._mutex_taken_after_check = False

    def __repr__(self) -> str:
        return f"FakeProcessGroupNCCL(device={self.device})"

    # -- what the release calls -------------------------------------------------

    def _comm_ptr(self) -> int:
        device = int(self._nccl_gil.fake_cudart_get_device())
        ptr = int(self._c10d_gil.fake_pg_comm_ptr(self._pg, device))
        if ptr == -1:
            raise RuntimeError(f"NCCL communicator was aborted on rank 0 (device {device}).")
        if self._free_right_after_comm_ptr:
            # The interleaving torch allows: the watchdog takes the communicator's
            # mutex the moment getCommPtr() let it go, and frees it.
            self._comm_ptr_read.set()
            self.watchdog_freed.wait(5)
        return ptr

    def _is_initialized(self) -> bool:
        ready = bool(self._c10d.fake_pg_is_initialized(self._pg))
        if self._mutex_taken_after_check:
            # The interleaving torch allows: another thread (the watchdog aborting the group on an
            # error it has just seen, a creation) takes the group's mutex the moment this returned.
            taken = threading.Event()
            threading.Thread(target=lambda: (self._c10d.fake_pg_lock(self._pg), taken.set()), daemon=True).start()
            taken.wait(5)
        return ready

    def get_error(self) -> ErrorType:
        with self._error_mutex:
            return self._error

    def abort(self) -> None:
        self.aborts_started += 1
        self._terminate.set()
        box: list = []
        worker = threading.Thread(target=lambda: box.append(self._abort_comms()), daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            raise RuntimeError(f"ProcessGroup abort timed out after {self.timeout_s}s")

    # -- the test's side --------------------------------------------------------

    def launch_kernel(self) -> None:
        """A collective whose kernel runs until the communicator's abort flag is set. Like
        torch's collective(), it gets the communicator through getNcclComm() first, which
        marks a non-blocking one initialized once it is ready."""
        self._c10d.fake_pg_comm_ptr(self._pg, self.device)
        self._nccl.fake_nccl_kernel_launch(self.comm)

    def add_p2p(self, stream: int) -> int:
        """A point-to-point communicator of this group (a ``send``/``recv``'s), on `stream`."""
        comm = int(self._nccl.fake_nccl_comm_create_on(self.device, 1, stream))
        self.p2p.append(comm)
        return comm

    def launch_p2p_kernel(self, i: int = 0) -> None:
        """A ``send`` whose peer never posts its ``recv``: it runs until its communicator is aborted."""
        self._nccl.fake_nccl_kernel_launch(self.p2p[i])

    def take_mutex_after_check(self) -> None:
        """From now on the group's mutex is taken (and kept) right after ``_is_initialized()`` returns."""
        self._mutex_taken_after_check = True

    def hold_mutex(self) -> None:
        """What a hung abortComms() (or a creation) does: the group's mutex stays taken."""
        self._c10d.fake_pg_lock(self._pg)

    def state(self) -> int:
        return int(self._nccl.fake_nccl_comm_state(self.comm))

    def fail(self, error: int = 6, free_right_after_comm_ptr: bool = False) -> None:
        """NCCL reports `error` (6: ncclRemoteError) on the communicator; the watchdog sees it."""
        self._free_right_after_comm_ptr = free_right_after_comm_ptr
        self._nccl.fake_nccl_set_async_error(self.comm, error)
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    def wait_error_seen(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.get_error() != ErrorType.SUCCESS:
                return True
            time.sleep(0.005)
        return False

    # -- torch's side -----------------------------------------------------------

    def _abort_comms(self) -> None:
        self._c10d.fake_pg_lock(self._pg)
        try:
            self._nccl.ncclGroupStart()
            with self._comm_mutex:
                if not self._c10d.fake_pg_aborted(self._pg, self.device):
                    # NCCLComm::abort's OptionalCUDAGuard: this thread on the communicator's device.
                    self._nccl.fake_cudart_set_device(self.device)
                    self._nccl.ncclCommAbort(self.comm)
                    for comm in self.p2p:
                        self._nccl.ncclCommAbort(comm)
                    self._c10d.fake_pg_mark_aborted(self._pg, self.device)
            self._nccl.ncclGroupEnd()
        finally:
            self._c10d.fake_pg_unlock(self._pg)

    def _watch(self) -> None:
        while not self._terminate.is_set():
            error = ctypes.c_int(0)
            with self._comm_mutex:  # checkForNcclError: under the communicator's mutex
                if self._c10d.fake_pg_aborted(self._pg, self.device):
                    return
                self._nccl.ncclCommGetAsyncError(self.comm, ctypes.byref(error))
            if error.value not in (0, 7):
                with self._error_mutex:
                    self._error = ErrorType.COMM_ERROR
                if self._free_right_after_comm_ptr:
                    self._comm_ptr_read.wait(5)
                else:
                    time.sleep(self.dump_wait_s)
                if self.async_error_handling in (1, 2):  # SHOULD_CLEAN_UP
                    self._abort_comms()
                    self.watchdog_freed.set()
                return
            time.sleep(0.005)


def mem_get_info(fakes: Fakes, device: int) -> tuple[int, int]:
    """What ``torch.cuda.mem_get_info(device)`` answers (cudaMemGetInfo): (free, total) bytes of the
    fake device, whose communicators hold FAKE_NCCL_COMM_BYTES each until their abort returned."""
    nccl = ctypes.CDLL(fakes["nccl"], mode=os.RTLD_NOLOAD)
    free, total = ctypes.c_long(0), ctypes.c_long(0)
    if nccl.fake_cuda_mem_get_info(device, ctypes.byref(free), ctypes.byref(total)) != 0:
        raise RuntimeError(f"CUDA error: invalid device ordinal {device}")
    return free.value, total.value
