"""Functional composition of hooks, as ``nvidia_resiliency_ext.inprocess.Compose``.

* ``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last instance runs first.
* Any number of arguments passes through: ``Compose(f, g)()`` calls ``g()``
  then ``f`` with what ``g`` returned; ``Compose(f, g)(a, b, c)`` calls
  ``g(a, b, c)``, and a tuple that ``g`` returns is passed on as the
  arguments of ``f`` (any other value as its single argument).
* A member that returns ``None`` although it received arguments triggers a
  warning (it probably forgot to return its input). Unlike there, its input
  is then passed on unchanged instead of ``None``, so the next member still
  gets what it expects.
* The composed object is an instance of the nearest base class its members
  share: ``isinstance(Compose(Foo(), Bar()), Initialize)`` holds when both
  are ``Initialize`` hooks, so a composition is accepted wherever one such
  hook is.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from typing_extensions import Self


T = TypeVar("T")  # NVRx's module exports this name

_compose_classes: dict[type, type] = {}
_compose_classes_lock = threading.Lock()


def nearest_common_base(instances: tuple[Any, ...]) -> type:
    """The first class in the MRO of ``type(instances[0])`` that every instance is an instance of."""
    shared = set(type(instances[0]).__mro__)
    for inst in instances[1:]:
        shared &= set(type(inst).__mro__)
    return next(cls for cls in type(instances[0]).__mro__ if cls in shared)


def find_common_ancestor(*instances: Any) -> type | None:
    """NVRx's name for :func:`nearest_common_base`, taking the instances as arguments; None without any."""
    return nearest_common_base(instances) if instances else None


def _compose_class(base: type) -> type | None:
    """``Compose`` made a subclass of ``base`` (one class per base), or None if ``base`` cannot be one."""
    if issubclass(base, Compose):
        # Compositions of compositions: the base the inner ones stand for.
        base = next((c for c in base.__mro__ if not issubclass(c, Compose)), object)
    if base is object or base.__new__ is not object.__new__:
        return None  # nothing shared, or a base that builds its instances itself
    with _compose_classes_lock:
        cls = _compose_classes.get(base)
        if cls is None:
            try:
                cls = type(f"Compose[{base.__qualname__}]", (Compose, base), {"__module__": __name__})
            except TypeError:
                return None  # functions, builtins and other final or conflicting types
            # Compose implements __call__; any other abstract method of the base is
            # never called on the composition itself (it is run member by member).
            cls.__abstractmethods__ = frozenset()  # type: ignore[attr-defined]
            _compose_classes[base] = cls
        return cls


class Compose:
    """``Compose(a, b, c)(x)`` is ``a(b(c(x)))``; see the module docstring for the rules."""

    instances: tuple[Any, ...]

    def __new__(cls, *instances: Any) -> Self:
        target: type = cls
        if cls is Compose and instances and all(callable(i) for i in instances):
            target = _compose_class(nearest_common_base(instances)) or Compose
        return object.__new__(target)

    def __init__(self, *instances: Any):
        if not instances:
            raise ValueError("Compose() needs at least one instance, got none")
        for i, inst in enumerate(instances):
            if not callable(inst):
                raise ValueError(f"Compose argument {i}={inst!r} ({type(inst).__name__}) is not callable")
        self.instances = tuple(instances)

    def __call__(self, *args: Any) -> Any:
        result: Any = args[0] if len(args) == 1 else (args if args else None)
        for inst in reversed(self.instances):
            ret = inst(*args)
            if ret is None:
                if args and args != (None,):
                    warnings.warn(
                        f"Compose: {inst!r} returned None for arguments {_short(args)}; its input is passed on "
                        f"to the next member (return it to silence this warning)",
                        stacklevel=2,
                    )
                continue
            result = ret
            args = ret if isinstance(ret, tuple) else (ret,)
        return result

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(i) for i in self.instances)})"


def _short(args: tuple[Any, ...]) -> str:
    text = repr(args)
    return text if len(text) <= 200 else text[:197] + "..."


def leaves(hook: Any) -> Iterator[Any]:
    """The non-Compose callables inside ``hook``, in execution order."""
    if isinstance(hook, Compose):
        for inst in reversed(hook.instances):
            yield from leaves(inst)
    elif hook is not None:
        yield hook
