"""Functional composition of hooks."""

from __future__ import annotations

from typing import Any, Iterator


class Compose:
    """``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last instance runs first.

    Each instance receives what the one before it returned; an instance that
    returns None passes its own input on unchanged. This is the order of
    ``nvidia_resiliency_ext.inprocess.Compose``, so existing compositions keep
    their meaning.
    """

    def __init__(self, *instances: Any):
        if not instances:
            raise ValueError("Compose() needs at least one instance, got none")
        for i, inst in enumerate(instances):
            if not callable(inst):
                raise ValueError(f"Compose argument {i}={inst!r} ({type(inst).__name__}) is not callable")
        self.instances = tuple(instances)

    def __call__(self, value: Any) -> Any:
        for inst in reversed(self.instances):
            out = inst(value)
            if out is not None:
                value = out
        return value

    def __repr__(self) -> str:
        return f"Compose({', '.join(repr(i) for i in self.instances)})"


def leaves(hook: Any) -> Iterator[Any]:
    """The non-Compose callables inside ``hook``, in execution order."""
    if isinstance(hook, Compose):
        for inst in reversed(hook.instances):
            yield from leaves(inst)
    elif hook is not None:
        yield hook
