"""Per-rank view of the job: who this rank is in the current iteration.

:class:`State` and :class:`FrozenState` have the fields, order and defaults of
``nvidia_resiliency_ext.inprocess.State``: ``State(rank, world_size)`` or, as
here also, ``State()``, which reads ``RANK`` (default 0) and ``WORLD_SIZE``
(default 1) from the environment like ``State.from_env()``. ``initial_rank``
and ``initial_world_size`` default to ``rank`` and ``world_size``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Iterable
from typing import Any

from .environment import env_int


class Mode(enum.IntEnum):
    """A rank's mode in one iteration."""

    INITIALIZED = 0  # before the first rank assignment
    ACTIVE = 1  # runs the wrapped function
    INACTIVE = 2  # a spare: waits, ready to replace an active rank
    TERMINATED = 3  # left the job; never comes back


def _rank_from_env() -> int:
    return env_int("RANK", 0)


def _world_size_from_env() -> int:
    return env_int("WORLD_SIZE", 1)


def _unset(value: object) -> bool:
    return value is None


@dataclasses.dataclass
class State:
    """Mutable state of one rank, owned by its :class:`inprocess.CallWrapper`.

    ``rank``/``world_size`` count every rank still in the job (active and
    spare); ``active_rank``/``active_world_size`` count the ranks that run the
    function (``active_rank`` is None on a spare, ``active_world_size`` None
    before the first rank assignment). ``initial_*`` never change.
    """

    rank: int = dataclasses.field(default_factory=_rank_from_env)
    world_size: int = dataclasses.field(default_factory=_world_size_from_env)
    active_rank: int | None = None
    active_world_size: int | None = None
    # None until __post_init__ copies rank and world_size (the NVRx defaults).
    initial_rank: int = None  # type: ignore[assignment]
    initial_world_size: int = None  # type: ignore[assignment]
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    def __post_init__(self) -> None:
        if _unset(self.initial_rank):
            self.initial_rank = self.rank
        if _unset(self.initial_world_size):
            self.initial_world_size = self.world_size

    @classmethod
    def from_env(cls) -> State:
        """This rank's state before the first assignment, from ``RANK`` and ``WORLD_SIZE``."""
        return cls(_rank_from_env(), _world_size_from_env())

    def freeze(self) -> FrozenState:
        return FrozenState(**self._fields())

    def advance(self) -> None:
        """The next iteration: its number, and no exception yet."""
        self.iteration += 1
        self.fn_exception = None

    def copy_from(self, other: Any, fields: Iterable[str] | None = None) -> None:
        """Copy ``fields`` (default: all) from another State or FrozenState."""
        wanted = None if fields is None else set(fields)
        for f in dataclasses.fields(self):
            if wanted is None or f.name in wanted:
                setattr(self, f.name, getattr(other, f.name))

    def set_distributed_vars(self) -> None:
        """``RANK``/``WORLD_SIZE`` for the function: the active rank and size; removed on a spare."""
        if self.mode == Mode.ACTIVE and self.active_rank is not None:
            os.environ["RANK"] = str(self.active_rank)
            os.environ["WORLD_SIZE"] = str(self.active_world_size)
        else:
            # A spare has no rank in the running job; it never sees "None" there.
            os.environ.pop("RANK", None)
            os.environ.pop("WORLD_SIZE", None)

    def _fields(self) -> dict[str, Any]:
        # A shallow copy: fn_exception is the exception object itself, not a copy.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def freeze_dataclass(cls: type) -> type:
    """A frozen dataclass named ``Frozen<Name>`` with the fields (names, types, defaults) of dataclass ``cls``,
    as NVRx builds its ``FrozenState`` from ``State``. (``FrozenState`` here is written out, with the
    same fields, so that type checkers see it.)"""
    given: object = cls  # checked at run time: callers are not all type-checked
    if not (isinstance(given, type) and dataclasses.is_dataclass(given)):
        raise ValueError(f"cls={cls!r}: expected a dataclass type")
    fields = [(f.name, f.type, f) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(f"Frozen{cls.__name__}", fields, frozen=True)


@dataclasses.dataclass(frozen=True)
class FrozenState:
    """Read-only snapshot of :class:`State` (the same fields and defaults), the argument of every hook."""

    rank: int = dataclasses.field(default_factory=_rank_from_env)
    world_size: int = dataclasses.field(default_factory=_world_size_from_env)
    active_rank: int | None = None
    active_world_size: int | None = None
    initial_rank: int = None  # type: ignore[assignment]
    initial_world_size: int = None  # type: ignore[assignment]
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: BaseException | None = None

    def __post_init__(self) -> None:
        if _unset(self.initial_rank):
            object.__setattr__(self, "initial_rank", self.rank)
        if _unset(self.initial_world_size):
            object.__setattr__(self, "initial_world_size", self.world_size)
