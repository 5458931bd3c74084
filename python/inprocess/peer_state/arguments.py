"""The checks of what a user gives a peer state: bad input named with what was expected."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_CHUNK_BYTES = 64 << 20


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_arguments(kind: str, every: int, chunk_bytes: int) -> None:
    if not is_int(every) or every < 1:
        raise ValueError(f"{kind}(every={every!r}): expected an int >= 1")
    if not is_int(chunk_bytes) or chunk_bytes < 1 << 10:
        raise ValueError(f"{kind}(chunk_bytes={chunk_bytes!r}): expected an int >= 1024")


def check_objects(kind: str, objects: Mapping[str, Any]) -> None:
    if not objects:
        raise ValueError(f"{kind}(): name at least one object, e.g. {kind}(model=model)")
    for name, obj in objects.items():
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(f"{kind}({name}=...): a {type(obj).__qualname__} has no "
                            f"{' and no '.join(missing)}(): expected an object with state_dict() and "
                            "load_state_dict() (a module, an optimizer, a scheduler)")


def check_step(kind: str, step: int) -> None:
    if not is_int(step) or step < 0:
        raise ValueError(f"{kind}.commit(step={step!r}): expected an int >= 0")
