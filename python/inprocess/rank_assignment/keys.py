"""Grouping keys of topology-aware assignments (:class:`Layer`, :class:`FilterCountGroupedByKey`).

``key_or_fn`` is, as there, either

* a ``str``: the key itself, the same on every rank (``"job"`` for the layer
  that spans the whole job). It is *not* the name of an environment
  variable; use :class:`EnvKey` for that;
* a callable ``fn(state) -> str`` of the rank's :class:`~inprocess.FrozenState`,
  e.g. :class:`EnvKey` (an environment variable such as ``SLURM_NODEID``),
  :class:`HostnameKey` (the host name), ``lambda state: socket.gethostname()``
  or ``lambda state: str(state.initial_rank // 8)``. An ``int`` result is
  turned into its decimal string; anything else is refused.

Each rank evaluates its keys once, at the initial barrier, with its state of
that moment (``rank == initial_rank``, mode ``INITIALIZED``); the leader reads
everyone's from ``ctx.topology``. (There, ``FilterCountGroupedByKey``
evaluates its key at every restart with the rank's current state; a key
that depends on ``state.rank`` therefore groups by the initial numbering
here, which is the same grouping as long as whole groups leave.)
"""

from __future__ import annotations

import inspect
import os
import socket
from typing import Any, Callable, Sequence, Union

from ..state import FrozenState, State
from .base import JobAssignmentCtx

KeyOrFn = Union[str, Callable[[Any], Any]]  # fn(state) -> str


def _is_str(value: object) -> bool:
    return isinstance(value, str)


class EnvKey:
    """Key function: the value of environment variable ``name`` on each rank.

    A rank without the variable uses ``default``; with ``default=None`` it
    raises ``ValueError`` naming the variable and the rank.
    """

    def __init__(self, name: str, default: str | None = None):
        if not _is_str(name) or not name:
            raise ValueError(f"EnvKey name={name!r}: expected a non-empty str")
        if default is not None and not _is_str(default):
            raise ValueError(f"EnvKey default={default!r}: expected a str or None")
        self.name = name
        self.default = default

    def __call__(self, state: FrozenState) -> str:
        value = os.environ.get(self.name, self.default)
        if value is None:
            raise ValueError(
                f"EnvKey: environment variable {self.name} is not set on initial rank {state.initial_rank} "
                f"and no default was given"
            )
        return value

    def __repr__(self) -> str:
        return f"EnvKey({self.name!r}, default={self.default!r})"


class HostnameKey:
    """Key function: the host name of each rank (``socket.gethostname()``)."""

    def __call__(self, state: FrozenState) -> str:
        return socket.gethostname()

    def __repr__(self) -> str:
        return "HostnameKey()"


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        return False
    except ValueError:
        return True  # no signature to inspect (some builtins): let the call decide
    return True


def check_key_or_fn(key_or_fn: Any, name: str) -> None:
    if isinstance(key_or_fn, str):
        return
    if not callable(key_or_fn) or not _takes_one_argument(key_or_fn):
        raise ValueError(
            f"{name}={key_or_fn!r} ({type(key_or_fn).__name__}): expected a str (the same key on every rank) "
            f"or a callable (state) -> str of the rank's state, e.g. EnvKey('SLURM_NODEID') or "
            f"lambda state: socket.gethostname()"
        )


def evaluate_key(key_or_fn: KeyOrFn, state: Union[State, FrozenState]) -> str:
    if isinstance(key_or_fn, str):
        return key_or_fn
    value = key_or_fn(state)
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(
        f"key_or_fn {key_or_fn!r} returned {value!r} ({type(value).__name__}) on initial rank "
        f"{state.initial_rank}: expected a str (or an int)"
    )


def check_keys(keys: Sequence[Any], width: int, owner: Any, world_size: int) -> None:
    if len(keys) != world_size:
        raise ValueError(f"{owner!r}: keys of {len(keys)} ranks for a job of {world_size} ranks")
    for r, k in enumerate(keys):
        if not isinstance(k, tuple) or len(k) != width or not all(isinstance(x, str) for x in k):
            raise ValueError(f"{owner!r}: initial rank {r} has keys {k!r}, expected a tuple of {width} str")


def topology_keys(ctx: JobAssignmentCtx, owner: Any) -> list[tuple[str, ...]]:
    try:
        keys = ctx.topology.keys(owner)
    except KeyError:
        raise ValueError(
            f"{owner!r}: ctx.topology has no keys for it; they are gathered at the initial barrier "
            f"by inprocess.Wrapper from local_keys()"
        ) from None
    n = ctx.membership.initial_world_size
    if len(keys) != n:
        raise ValueError(f"{owner!r}: keys of {len(keys)} ranks for a job of {n} ranks")
    return keys
