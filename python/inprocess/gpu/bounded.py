"""Runs a Python call that may hang (torch's backend abort, its flight
recorder dump) on a daemon thread, and waits for it no longer than a deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Bounded(Generic[T]):
    finished: bool
    value: T | None = None
    error: BaseException | None = None


def call_within(fn: Callable[[], T], timeout: float, name: str) -> Bounded[T]:
    """`fn()` on a thread of its own; past `timeout` seconds the thread is
    abandoned (a daemon: it never holds the process's exit)."""
    box: Bounded[T] = Bounded(False)
    done = threading.Event()

    def run() -> None:
        try:
            box.value = fn()
        except BaseException as e:  # handed to the caller
            box.error = e
        finally:
            done.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    if not done.wait(max(timeout, 0.0)):
        return Bounded(False)
    box.finished = True
    return box
