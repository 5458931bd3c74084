"""A process that joins a running job: its side of :mod:`inprocess.control.joining`.

Started with ``INPROCESS_JOIN=1`` and the job's environment, the process
checks that the store runs a job of its own incarnation, waits for its
monitor's first beat on its seat's counter when the seat is free (so that the
peers' monitors can see it lost from its announcement on), announces itself
(its seat, its configuration, its topology keys) and waits, stamping its
progress like a spare, until a restart's leader resolves it. Admitted, it
reads that barrier's decision and enters the job with it; refused, it leaves
with the reason; closed (the job ended while it waited), its call returns.

Linked to its node's agent (engine/runtime.py), it sleeps on the node's board
instead of a blocking wait at the store: it reads its record once per decision
or event the agent posts (a leader resolves joiners only in a restart, and its
decision follows), and every _BACKSTOP_S besides; the admitting decision comes
from the board too. Without news, a waiting joiner makes no store call.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from ..control import seats
from ..control.join_records import ADMITTED, CLOSED, ENDED, GONE, REFUSED, Announcement, Outcome
from ..control.joining import JoinKeys
from ..control.leadership import parse_lost_mark
from ..control.node_link import BOARD_CLOSED, BOARD_NEWS, NodeBoardLink
from ..control.protocol import Decision, RestartProtocol
from ..control.records import HOST
from ..exception import RestartError, TimeoutError
from ..state import State

log = logging.getLogger("inprocess")

# How often a waiting joiner stamps its progress at least (a spare stamps every soft_timeout/4).
_STAMP_S = 1.0
# With a node board, how often a waiting joiner reads its record without news on the board.
_BACKSTOP_S = 10.0


class JoinRefused(RestartError):
    """The running job refused this process (its configuration differs, or its incarnation)."""


class JoinClosed(Exception):
    """The job ended while this process waited to join it."""


def job_config(wrapper: Any, fn: Callable[..., Any]) -> dict[str, str]:
    """What a joiner's configuration must share with the job's, as plain strings: the wrapped
    function, the world's shape, the timeouts and the rank assignment."""
    t = wrapper.timeouts
    module = getattr(fn, "__module__", "?")
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    config = {
        "function": f"{module}.{qualname}",
        "initial_world_size": os.environ.get("WORLD_SIZE", "?"),
        "rank_assignment": type(wrapper.rank_assignment).__name__,
    }
    # One entry per timeout, so that a refusal names the one that differs.
    config.update({name: str(value) for name, value in sorted(vars(t).items()) if not name.startswith("_")})
    return config


def wait_for_admission(
    p: RestartProtocol, state: State, token: str, config: dict[str, str], keys: list[list[str]] | None,
    stamp: Callable[[], None], timeout: float, monitor_beat_s: float | None = None,
) -> Decision:
    """Announce this process and wait until a leader resolves it; returns the decision that
    admits it (its seat's life is set on ``p``). Raises :class:`JoinRefused` or :class:`JoinClosed`.

    ``monitor_beat_s``: with a monitor that heartbeats, how long to wait for its first beat
    on a free seat's counter before announcing: a joiner is admitted only once the peers'
    monitors can see it lost (None: no such monitor)."""
    join = JoinKeys(p.counted, p.call, p.incarnation)
    _check_incarnation(join, p.incarnation)
    seat = state.initial_rank
    held = p.read_seat(seat)
    if held is not None and not seats.parse(held).counted_out:
        log.info("rank %d: seat %d is held by a running process of the job: this process waits until it is free",
                 seat, seat)
    elif monitor_beat_s is not None:
        with join.quiet_waits() as quiet:  # no torch warning per wait that times out
            _await_first_beat(quiet, token, stamp, monitor_beat_s)
    join.announce(Announcement(token, seat, HOST, os.getpid(), config, keys))
    # Read after the announcement: a job that ended before it closed it, or says so here.
    _check_incarnation(join, p.incarnation)
    link = p.link if p.link is not None and p.link.alive() else None
    log.info("rank %d: waiting to join the running job (token %s)%s", seat, token,
             f", on node board slot {link.slot}" if link is not None else "")
    outcome = None
    try:
        if link is not None:
            outcome = _wait_on_board(join, token, link, stamp)
        if outcome is None:  # not from the board: the store's wait, torch-free (no warning per wait that times out)
            with join.quiet_waits() as quiet:
                while outcome is None:
                    stamp()
                    outcome = quiet.wait_outcome(token, _STAMP_S)
    except RestartError:
        raise
    except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
        raise JoinClosed(f"the store went away while this process waited to join ({type(e).__name__}: {e})") \
            from None
    if outcome.kind == REFUSED:
        raise JoinRefused(f"the running job refused initial rank {seat}: {outcome.why}")
    if outcome.kind in (CLOSED, GONE):
        raise JoinClosed(f"initial rank {seat} did not join: {outcome.why}")
    assert outcome.kind == ADMITTED
    if outcome.seat != seat:
        raise RestartError(f"joiner {token} asked for seat {seat} and was admitted into seat {outcome.seat}")
    p.life = outcome.life
    log.info("rank %d: admitted at barrier %d (life %d of its seat)", seat, outcome.barrier, outcome.life)
    # Published before the admission was read (the leader admits, then decides and publishes): no long wait.
    decision = p.decision_on_board(outcome.barrier)
    return decision if decision is not None else p.wait_decision(outcome.barrier, timeout)


def _wait_on_board(join: JoinKeys, token: str, link: NodeBoardLink, stamp: Callable[[], None]) -> Outcome | None:
    """The joiner's outcome, read once per decision or event that its node's agent posts (only a
    restart's leader resolves a joiner, and its decision follows; the job's end is a complete event
    or a decision that ends it), and every _BACKSTOP_S (a peer's monitor may withdraw it). None
    once the board can tell no more (the agent gone, the job ending): the store's wait takes over.
    """
    posted = link.read_decision()
    decision_seen, event_seen = -1 if posted is None else posted[0], link.event()
    ending = _job_ends(posted, event_seen)
    outcome = join.read_outcome(token)
    looked = time.monotonic()
    while outcome is None:
        if ending:
            return None  # no decision will come: the job's end closes this joiner at the store
        stamp()
        news = link.wait_news(decision_seen, event_seen, _STAMP_S)
        if news == BOARD_CLOSED or not link.alive():
            return None
        if news == BOARD_NEWS:
            posted = link.read_decision()
            decision_seen, event_seen = -1 if posted is None else posted[0], link.event()
            ending = _job_ends(posted, event_seen)
        elif time.monotonic() - looked < _BACKSTOP_S:
            continue
        outcome = join.read_outcome(token)
        looked = time.monotonic()
    return outcome


def _job_ends(posted: tuple[int, bytes | None] | None, event: int) -> bool:
    """Whether the board says the job ends: a complete event, or a decision that ends it (its
    agent relays nothing after either)."""
    if event >= 0 and event % 2 == 1:
        return True
    if posted is None or posted[1] is None or parse_lost_mark(posted[1]) is not None:
        return False
    return Decision.ends_job(posted[1])


def _await_first_beat(join: JoinKeys, token: str, stamp: Callable[[], None], seconds: float) -> None:
    """Until this joiner's monitor beat on its seat's counter (it says so under the joiner's
    token), at most ``seconds``: a monitor that started late is warned about, not waited for."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        stamp()
        try:
            join.counted.get_blocking(join.watched_key(token), min(left, _STAMP_S), "its monitor's first heartbeat")
            return
        except TimeoutError:
            continue
    log.warning("joiner %s: its monitor did not beat within %gs; it announces itself unwatched by the peers' "
                "monitors until it does", token, seconds)


def withdraw(p: RestartProtocol, token: str, why: str) -> Outcome | None:
    """This joiner leaves before it entered the job: its announcement is withdrawn. Returns
    the outcome that holds (an admission that came first must then be counted out)."""
    join = JoinKeys(p.counted, p.call, p.incarnation)
    outcome = join.resolve(token, Outcome(GONE, why=why))
    return outcome if outcome.kind == ADMITTED else None


def _check_incarnation(join: JoinKeys, incarnation: str) -> None:
    running = join.running_incarnation()
    if running is not None and running.startswith(ENDED):
        if running[len(ENDED):] == incarnation:
            raise JoinClosed("the job it would join has ended")
        running = running[len(ENDED):]
    if running is None:
        raise JoinRefused(f"INPROCESS_JOIN=1, but no job of call {join.call} has run at this store: nothing to join "
                          f"(start the job's first processes without INPROCESS_JOIN)")
    if running != incarnation:
        raise JoinRefused(f"this process belongs to incarnation {incarnation or '(none)'!r} of the job, and the "
                          f"store runs incarnation {running or '(none)'!r}: a process of another incarnation "
                          f"cannot join it (its launcher's variables differ: TORCHELASTIC_RESTART_COUNT, "
                          f"SLURM_RESTART_COUNT, ...)")
