"""An in-memory store whose every call is a step of a seeded scheduler: the simulator's world.

Each simulated process (a rank, or the monitor that counts a dead rank out) is a thread running the
library's real control-plane code over its own :class:`SimClient`, a torch-Store-like connection.
Only one thread runs at a time: a call blocks its thread until the scheduler picks it, runs alone,
and the thread goes on to its next call. The scheduler picks among the calls that can proceed (a wait
only once its keys exist) with its seeded generator, so a seed is one interleaving, replayed exactly.
Time is virtual: it moves only when no call can proceed, to the earliest deadline of a waiting call
(which then times out); the control plane's deadlines read it (``store_ops.time`` is swapped for the
scheduler's clock while a schedule runs). A call that nothing can ever wake is a deadlock.

Faults: before a rank's call the scheduler may crash the rank (its thread ends at once, between two
store calls), or crash it after the call took effect but before the rank saw the answer (a connection
lost in flight). TCP neither reorders nor duplicates one connection's requests, so neither is
simulated; reordering between processes is the scheduler's whole job.

This module imports no torch.
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

Value = Any


class Crashed(BaseException):
    """Raised in a simulated process's thread: the process died here."""


class Deadlock(Exception):
    """Every live process waits for a key that nobody will write, and none has a deadline."""


@dataclasses.dataclass
class _Call:
    actor: str
    what: str  # the call and its key, for the trace
    run: Callable[[], Any]  # the call's effect and answer (under the scheduler's lock)
    ready: Callable[[], bool]  # whether it can proceed now
    deadline: float | None  # virtual time past which a wait times out
    crashable: bool
    go: threading.Event = dataclasses.field(default_factory=threading.Event)
    outcome: Any = None
    error: BaseException | None = None


class Scheduler:
    """Runs the simulated processes one store call at a time, in the order its seed picks."""

    def __init__(self, seed: int, crash_p: float = 0.0, max_crashes: int = 0, lose_answer_p: float = 0.3):
        self.rng = random.Random(seed)
        self.now = 0.0
        self.crash_p = crash_p
        self.max_crashes = max_crashes
        self.lose_answer_p = lose_answer_p
        self.data: dict[str, bytes] = {}
        self.crashed: list[str] = []
        self.steps = 0
        self._lock = threading.Condition()
        self._pending: dict[str, _Call] = {}
        self._running: set[str] = set()
        self._threads: dict[str, threading.Thread] = {}
        self.errors: dict[str, BaseException] = {}
        self.trace: list[str] | None = None  # when a list: one line per call, in the order they ran
        self.on_crash: Callable[[str], None] = lambda name: None
        self.may_crash: Callable[[str], bool] = lambda name: False

    def monotonic(self) -> float:
        return self.now

    # -- processes -------------------------------------------------------------

    def spawn(self, name: str, body: Callable[[], None]) -> None:
        def run() -> None:
            try:
                body()
            except Crashed:
                pass
            except BaseException as e:  # noqa: BLE001 - what the process ended with, for the checks
                self.errors[name] = e
            finally:
                with self._lock:
                    self._running.discard(name)
                    self._lock.notify_all()

        with self._lock:
            self._running.add(name)
        thread = threading.Thread(target=run, name=f"sim-{name}", daemon=True)
        self._threads[name] = thread
        thread.start()

    def call(self, actor: str, what: str, run: Callable[[], Any], ready: Callable[[], bool] = lambda: True,
             deadline: float | None = None) -> Any:
        """From a process's thread: one store call (``what``), when the scheduler picks it."""
        c = _Call(actor, what, run, ready, deadline, crashable=self.may_crash(actor))
        with self._lock:
            self._running.discard(actor)
            self._pending[actor] = c
            self._lock.notify_all()
        c.go.wait()
        if c.error is not None:
            raise c.error
        return c.outcome

    # -- the loop ----------------------------------------------------------------

    def run(self, max_steps: int = 100_000) -> None:
        """Until every process ended. Raises :class:`Deadlock`, or RuntimeError past ``max_steps``."""
        while True:
            with self._lock:
                while self._running:
                    self._lock.wait()
                if not self._pending:
                    return
                self.steps += 1
                if self.steps > max_steps:
                    raise RuntimeError(f"more than {max_steps} store calls: a livelock?")
                c = self._pick()
                del self._pending[c.actor]
                self._running.add(c.actor)
                self._perform(c)
            c.go.set()

    def _pick(self) -> _Call:
        ready = [c for _, c in sorted(self._pending.items()) if c.ready()]
        if not ready:
            deadlines = [c.deadline for c in self._pending.values() if c.deadline is not None]
            if not deadlines:
                raise Deadlock(f"processes {sorted(self._pending)} wait for keys nobody writes")
            self.now = max(self.now, min(deadlines))
            ready = [c for _, c in sorted(self._pending.items()) if c.ready() or
                     (c.deadline is not None and c.deadline <= self.now)]
        return self.rng.choice(ready)

    def _perform(self, c: _Call) -> None:
        crash = c.crashable and len(self.crashed) < self.max_crashes and self.rng.random() < self.crash_p
        if crash and self.rng.random() >= self.lose_answer_p:
            c.error = Crashed()  # between two store calls: this one never reached the store
        else:
            try:
                c.outcome = c.run() if c.ready() else _timed_out(c)
            except BaseException as e:  # noqa: BLE001 - the call's own error, raised in its thread
                c.error = e
            if crash:
                c.error = Crashed()  # it took effect; the process died before it saw the answer
        if self.trace is not None:
            answer = "crashed" if isinstance(c.error, Crashed) else repr(c.error or c.outcome)[:80]
            self.trace.append(f"t={self.now:g} {c.actor} {c.what} -> {answer}")
        if crash:
            self.crashed.append(c.actor)
            self.on_crash(c.actor)


def _timed_out(c: _Call) -> Any:
    raise builtins.TimeoutError(f"{c.actor}: wait timed out at virtual time")


class SimClient:
    """One process's connection to the simulated store: torch's Store methods, each a scheduled call."""

    def __init__(self, sched: Scheduler, actor: str, timeout_s: float = 300.0):
        self.sched = sched
        self.actor = actor
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def _do(self, what: str, run: Callable[[], Any]) -> Any:
        return self.sched.call(self.actor, what, run)

    def set(self, key: str, value: Value) -> None:
        self._do(f"set {key} {value!r:.40}", lambda: self.sched.data.__setitem__(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        return self.wait_get(key, self.timeout.total_seconds())

    def wait_get(self, key: str, seconds: float) -> bytes:
        data = self.sched.data
        return bytes(self.sched.call(self.actor, f"get {key}", lambda: data[key], lambda: key in data,
                                     self.sched.now + seconds))

    def add(self, key: str, amount: int) -> int:
        def run() -> int:
            value = int(self.sched.data.get(key, b"0")) + amount
            self.sched.data[key] = str(value).encode()
            return value

        return int(self._do(f"add {key} {amount}", run))

    def append(self, key: str, value: Value) -> None:
        self._do(f"append {key} {value!r:.40}",
                 lambda: self.sched.data.__setitem__(key, self.sched.data.get(key, b"") + _bytes(value)))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        def run() -> bytes:
            data = self.sched.data
            held = data.get(key)
            if held is None:
                if _bytes(expected) == b"":
                    data[key] = _bytes(desired)
                    return _bytes(desired)
                return _bytes(expected)  # torch's answer for a missing key: the expected value
            if held == _bytes(expected):
                data[key] = _bytes(desired)
                return _bytes(desired)
            return held

        return bytes(self._do(f"compare_set {key} {expected!r:.20} {desired!r:.30}", run))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._do(f"check {list(keys)}", lambda: all(k in self.sched.data for k in keys)))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None:
        data = self.sched.data
        self.sched.call(self.actor, f"wait {list(keys)}", lambda: None, lambda: all(k in data for k in keys),
                        self.sched.now + timeout.total_seconds())

    def delete_key(self, key: str) -> bool:
        return bool(self._do(f"delete {key}", lambda: self.sched.data.pop(key, None) is not None))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return list(self._do(f"multi_get {list(keys)}", lambda: [self.sched.data[k] for k in keys]))

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._do(f"multi_set {list(keys)}",
                 lambda: self.sched.data.update({k: _bytes(v) for k, v in zip(keys, values, strict=True)}))


def _bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
