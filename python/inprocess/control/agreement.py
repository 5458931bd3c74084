"""Barrier 0: the settings every rank of a job must share are compared before any rank counts itself in.

Ranks launched with different settings (a ``WORLD_SIZE`` of 2 on one and 3 on another, another
wrapped function, other timeouts) would wait at barrier 0 for a count that never completes, and
end ``barrier_timeout`` later with nothing naming the cause. Here the job ends within a store round
trip of the disagreeing rank's arrival, and every rank names the setting, the values and the ranks.

Its two keys (:mod:`inprocess.control.keys`): ``settings`` holds "<initial rank>:<digest>" of the
first rank to propose (compare_set), ``settings.first`` that rank's settings in full (JSON), written
by it once it won.

Each rank, before it arrives at barrier 0, proposes the digest of its settings with one
``compare_set`` (the first proposer wins; every rank learns who it was and what it holds). The
winner writes its settings in full: one more call, for one rank. A rank whose digest differs reads
them (waiting up to :data:`FIRST_WAIT_S` for the winner's write), names the first difference, and
ends barrier 0 for everyone: it writes barrier 0's decision itself, an abort that names the
difference (a compare_set: a decision that came out first stays, and then the ranks that agreed go
on without this one), and sets ``ready``, so that a leader waiting for the count wakes, finds the
decision taken, and reads it. Every rank that arrives gets the abort and leaves with a
``RestartAbort`` naming the difference; the rank that found it raises :class:`SettingsMismatch`.
The digests cost one call per rank and a few bytes each, whatever the size of the settings.

Every process that leaves counts itself out of the call (``left``); when they number the first
proposer's ``WORLD_SIZE`` the last one ends the call's keys and its store host exits at once. When
they do not (the first proposer was the one with the odd ``WORLD_SIZE``), the store host exits by its
idle timeout once no rank's monitor heartbeats, as after a job gone without a word.

This module imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from .membership import Membership
from .records import Decision, loads_strict
from .store_ops import is_timeout

log = logging.getLogger("inprocess")

FIRST_WAIT_S = 10.0  # how long a disagreeing rank waits for the first proposer's settings in full
# How a setting is named to the user, where its key is not the name the user set.
_SHOWN = {"initial_world_size": "WORLD_SIZE", "function": "the wrapped function"}


class SettingsMismatch(ValueError):
    """This rank's settings differ from those of the job's first rank at barrier 0."""


def digest(settings: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def difference(first: dict[str, str], mine: dict[str, str], first_rank: int, my_rank: int) -> str | None:
    """The first setting on which two ranks differ, named with both values and both ranks; None if none."""
    for name in sorted(set(first) | set(mine)):
        theirs, ours = first.get(name), mine.get(name)
        if theirs != ours:
            shown = _SHOWN.get(name, name)
            return (f"the ranks of this job disagree on {shown}: initial rank {my_rank} has {ours!r}, initial "
                    f"rank {first_rank} (the first to arrive at barrier 0) has {theirs!r}; every rank of a job "
                    f"must be launched with the same {shown}")
    return None


def agree_at_barrier_zero(p: Any, initial_rank: int, settings: dict[str, str]) -> None:
    """Before this rank arrives at barrier 0 (``p``: its :class:`~inprocess.control.protocol.RestartProtocol`).
    Raises :class:`SettingsMismatch` after ending barrier 0 for every rank, when its settings differ."""
    mine = f"{initial_rank}:{digest(settings)}"
    held = p.counted.compare_set(p.keys.settings(), "", mine).decode()
    if held == mine:
        p.counted.set(p.keys.settings_first(), json.dumps({"rank": initial_rank, "settings": settings}))
        return
    first_rank, _, first_digest = held.partition(":")
    if first_digest == digest(settings):
        return
    first = _first_settings(p)
    why = (difference(first["settings"], settings, int(first["rank"]), initial_rank) if first is not None else None)
    if why is None:
        why = (f"the ranks of this job disagree on their settings (WORLD_SIZE, the wrapped function, the timeouts "
               f"or the rank assignment): initial rank {initial_rank}'s differ from those of initial rank "
               f"{first_rank}, the first to arrive at barrier 0, which did not publish them within {FIRST_WAIT_S:g}s")
    message = f"barrier 0: {why}"
    world_size = _world_size(first, settings)
    end_barrier_zero(p, initial_rank, world_size, message)
    p.leave(0, world_size)  # one of the processes that leave the aborted job: the last one ends its keys
    raise SettingsMismatch(message)


def _first_settings(p: Any) -> dict[str, Any] | None:
    try:
        p.counted.wait_key(p.keys.settings_first(), FIRST_WAIT_S, "the first rank's settings")
        value = loads_strict(p.counted.get(p.keys.settings_first()))
    except Exception as e:
        if not is_timeout(e) and type(e).__name__ != "TimeoutError":
            raise
        return None
    if not isinstance(value, dict) or not isinstance(value.get("settings"), dict):
        return None
    return value


def _world_size(first: dict[str, Any] | None, settings: dict[str, str]) -> int:
    """The initial world size of the ranks that agree with the first (those that read the abort)."""
    for source in (first["settings"] if first is not None else {}, settings):
        try:
            return max(1, int(source.get("initial_world_size", "")))
        except ValueError:
            continue
    return 1


def end_barrier_zero(p: Any, initial_rank: int, world_size: int, message: str) -> None:
    """Barrier 0's decision: an abort that says ``message``, unless a decision is out already; and
    ``ready``, for a leader waiting for a count that will not complete."""
    membership = Membership.all_active(world_size)
    leader = initial_rank if initial_rank < world_size else 0
    decision = Decision(0, membership, [], [], 0, leader, abort=message)
    held = p.terms.write(0, 0, decision.to_json())
    if held != decision.to_json().encode():
        log.info("barrier 0 was decided before this rank found the difference: the job goes on without it")
    p.counted.set(p.key(0, "ready"), "1")
