"""Grouping keys of topology-aware assignments (:class:`Layer`, :class:`FilterCountGroupedByKey`).

``key_or_fn`` is, as there, either

* **this rank's key**, any hashable value other than a callable, computed on
  each rank before the ``Wrapper`` is built: ``socket.gethostname()``,
  ``int(os.environ["SLURM_NODEID"])``, ``state.rank // 8``, or a constant such
  as ``"job"`` for the layer that spans the whole job. Ranks whose keys are
  equal form one group; nothing requires the key to be the same on every rank.
  A ``str`` is the key itself, *not* the name of an environment variable (use
  :class:`EnvKey` for that);
* or a callable ``fn(state)`` of the rank's :class:`~inprocess.FrozenState`
  returning such a key, e.g. :class:`EnvKey` (an environment variable such as
  ``SLURM_NODEID``), :class:`HostnameKey` (the host name),
  ``lambda state: socket.gethostname()`` or ``lambda state: state.rank // 8``.

Keys travel between ranks as text (no pickle, design principle 5): a key
that is not a ``str`` is compared by its ``str()``, as NVRx's
``FilterCountGroupedByKey`` does with the store key it builds from it. So
``1`` and ``"1"`` are one group, and a value whose ``str()`` differs between
processes (an object shown by its address) cannot group ranks.

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
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ..state import FrozenState, State
from .base import JobAssignmentCtx

KeyOrFn = Hashable | Callable[[Any], Hashable]  # this rank's key, or fn(state) -> key


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


def _is_hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


_EXPECTED_KEY = (
    "expected this rank's grouping key (any hashable value: ranks with equal keys form one group, "
    "e.g. socket.gethostname() or state.rank // 8) or a callable (state) -> key, "
    "e.g. EnvKey('SLURM_NODEID') or lambda state: socket.gethostname()"
)


def check_key_or_fn(key_or_fn: Any, name: str) -> None:
    if callable(key_or_fn):
        if not _takes_one_argument(key_or_fn):
            raise ValueError(f"{name}={key_or_fn!r} ({type(key_or_fn).__name__}): a callable that cannot be called "
                             f"with the rank's state alone; {_EXPECTED_KEY}")
        return
    if key_or_fn is None:  # what a forgotten value looks like: never taken for a key
        raise ValueError(f"{name}=None: {_EXPECTED_KEY}")
    if not _is_hashable(key_or_fn):
        raise ValueError(f"{name}={key_or_fn!r} ({type(key_or_fn).__name__}) is not hashable; {_EXPECTED_KEY}")


def key_text(value: object) -> str:
    """How a key is compared and sent: a str as it is, any other value by its ``str()``."""
    return value if isinstance(value, str) else str(value)


def evaluate_key(key_or_fn: KeyOrFn, state: State | FrozenState) -> str:
    """This rank's key, as text (see the module docstring)."""
    value = key_or_fn(state) if callable(key_or_fn) else key_or_fn
    if not _is_hashable(value):
        raise ValueError(
            f"key_or_fn {key_or_fn!r} returned {value!r} ({type(value).__name__}) on initial rank "
            f"{state.initial_rank}: expected a hashable grouping key (a str, an int, a tuple ...)"
        )
    return key_text(value)


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
