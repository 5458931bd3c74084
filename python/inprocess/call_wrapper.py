"""``CallWrapper``: one call of a wrapped function, as the function sees it.

It is what the user holds: the call's state (``iteration``, ``frozen_state``,
``restarts``), progress and hang protection (``ping``, ``disable_hang_protection``),
the blocks a restart does not cut (``atomic``, ``safe_point``) and the
iteration's ``store``. The restart itself is the engine's: the loop
(:mod:`inprocess.engine.loop`) and the executor of its plans
(:mod:`inprocess.engine.recovery`), on the resources of
:class:`inprocess.engine.runtime.RankRuntime`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from . import calls
from .engine import loop
from .engine.config import Settings
from .engine.recovery import Recovery
from .engine.restart_record import RestartRecord
from .engine.runtime import RankRuntime
from .environment import env_int
from .state import FrozenState, State

__all__ = ["CallWrapper", "RestartRecord", "current_call"]

current_call = calls.current_call


class CallWrapper:
    """One call of a wrapped function: its state, and the user's handles on its restarts.

    It is passed to the function as the parameter annotated ``CallWrapper``
    (or ``Optional[CallWrapper]``), and is also returned by
    :func:`inprocess.current_call`. The function receives the same argument
    objects on every iteration: state it mutates carries over.
    ``restarts`` lists a :class:`RestartRecord` per restart this rank went through.
    """

    def __init__(self, wrapper: Settings):
        self._w = wrapper
        self.state: State
        self.restarts: list[RestartRecord] = []
        self._recovery: Recovery | None = None  # set while the call runs

    # -- public API (used from inside the wrapped function) --------------------

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def frozen_state(self) -> FrozenState:
        return self.state.freeze()

    def ping(self) -> None:
        """Manual progress: arms the soft/hard timeouts for the rest of the iteration."""
        rec = self._recovery
        if rec is not None:
            rec.storm.step()  # a step: progress, for the storm brake (engine/storm.py)
            if rec.rt is not None:
                rec.rt.hang_guard.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block that a restart does not interrupt: it waits for the block's end.

        Do not run collectives inside: a peer's fault cannot release them.
        """
        with self._runtime.interrupter.lock:
            yield
        self.safe_point()  # its end is a safe point: the job may grow here

    def safe_point(self) -> None:
        """Marks a point between steps where a restart loses no work (an iteration boundary of the
        training loop): with ``Wrapper(grow=GrowPolicy(...))`` the job may restart here, on purpose, to
        take in processes waiting to join it (:mod:`inprocess.engine.grow`). Cheap: one store read
        every ``GrowPolicy.check_every`` calls; nothing without a policy."""
        if self._recovery is not None:
            self._recovery.safe_point()

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """Suspends the soft and hard timeouts for a block, re-arming them after."""
        rec = self._recovery
        if rec is None or rec.rt is None:
            yield
            return
        with rec.rt.hang_guard.suspended():
            yield

    @property
    def store(self) -> dist.Store:
        """A store scoped to this iteration, for ``init_process_group(store=...)``.

        Its keys are deleted once every rank has left the iteration.
        """
        rec = self._recovery
        if rec is None or rec.rt is None:
            raise RuntimeError("CallWrapper.store is available inside the wrapped function only")
        return rec.rt.iteration_store(self.state.iteration)

    @property
    def _running(self) -> Recovery:
        if self._recovery is None or self._recovery.rt is None:
            raise RuntimeError("this CallWrapper's call is not running")
        return self._recovery

    @property
    def _runtime(self) -> RankRuntime:
        """The running call's resources (its store, node link, heartbeat page): for tests and benchmarks."""
        return self._running.runtime

    # -- the call ------------------------------------------------------------------

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call_index = self._enter()
        try:
            self._recovery = Recovery(self._w, self.state, self.restarts, fn)
            return loop.run_call(self._recovery, call_index, fn, args, kwargs)
        finally:
            self._exit()

    def _enter(self) -> int:
        """Checks the environment, registers this call as the process's current one; returns its index."""
        if dist.is_available() and dist.is_initialized():
            # The message names the condition as nvidia_resiliency_ext words it, which callers match on.
            raise ValueError(
                "inprocess.Wrapper: expected not torch.distributed.is_initialized(), but a process group "
                "already exists; create process groups inside the wrapped function, so that a restart can "
                "rebuild them"
            )
        rank = env_int("RANK")
        world_size = env_int("WORLD_SIZE")
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
        call_index = calls.register(self)
        self.state = State(initial_rank=rank, initial_world_size=world_size, rank=rank, world_size=world_size)
        return call_index

    def _exit(self) -> None:
        self._recovery = None
        calls.forget(self)
