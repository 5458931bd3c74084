"""The wire's one schema: every store key the package writes or reads is built here, and only here.

A wrapped call's keys live under its prefix (:func:`call_prefix`): ``inprocess/<call>/``,
or ``inprocess/<incarnation>/<call>/`` where a launcher names the job's incarnation
(:mod:`inprocess.control.incarnation`). ``<i>`` is an iteration (its barrier is barrier i),
``<t>`` a term of a barrier whose leader was lost, ``<g>`` a seat key's index, ``<r>`` an
initial rank, ``<token>`` a joiner's. The values' layouts are the records'
(:mod:`inprocess.control.records`, :mod:`inprocess.control.seats`,
:mod:`inprocess.control.joining`).

==========================  ==============================  ==================================================
key (under the call's       built by                        what it holds
prefix unless absolute)
==========================  ==============================  ==================================================
``<i>/event``               ``CallKeys.iteration``          "restart" or "complete": the first writer wins
``<i>/faults``              ``CallKeys.iteration``          fault records of iteration i (JSON lines, appended)
``<i>/completed``           ``CallKeys.iteration``          counter of active ranks whose function returned
``<i>/arrivals``            ``CallKeys.iteration``          barrier i's counter: +1 a healthy rank, +2**32 a
                                                            rank arriving terminated
``<i>/ready``               ``CallKeys.iteration``          set by whoever completes barrier i's count
``<i>/terminated``          ``CallKeys.iteration``          "r," per initial rank arriving terminated
``<i>/left``                ``CallKeys.iteration``          counter of ranks that left after completion
``<i>/given_up``            ``CallKeys.iteration``          counter of arrivals that stopped waiting for barrier i
``<i>/progress``            ``CallKeys.iteration``          counter of reporters that made progress in iteration i
                                                            (engine/storm.py)
``<i>/grow_at``             ``CallKeys.iteration``          the safe point the job grows at (engine/grow.py)
``<i>/grow_arrivals``       ``CallKeys.iteration``          counter of ranks waiting at the grow point
``<i>/decision``            ``CallKeys.term_outcome``       barrier i's decision (term 0), or a lost mark
``<i>/decision.<t>``        ``CallKeys.term_outcome``       the outcome of term t (control/leadership.py)
``<i>/lead.<t>``            ``CallKeys.term_claim``         who leads term t
``seat/<g>``                ``CallKeys.seat``               the seats of K consecutive initial ranks
``seat/per_key``            ``CallKeys.seats_per_key``      K, agreed once per call (control/seat_table.py)
``monitors/<r>``            ``CallKeys.monitor_heartbeat``  heartbeat counter of rank r's monitor process
``topology``                ``CallKeys.topology``           per-rank keys of topology-aware assignments
``settings``                ``CallKeys.settings``           the digest of the settings every rank must share,
                                                            written by the first rank at barrier 0
``settings.first``          ``CallKeys.settings_first``     that rank's settings in full (control/agreement.py)
``done``                    ``CallKeys.done``               set when the last rank left; the store host waits
``joiner/<token>``          ``CallKeys.joiner``             a joiner's record: pending, then its outcome
``joiner/<token>/told``     ``CallKeys.joiner_told``        the joiner read its outcome
``joiner/<token>/watched``  ``CallKeys.joiner_watched``     its monitor's first heartbeat counter
``joiners``                 ``CallKeys.joiners``            joiners' announcements (JSON lines, appended)
``joiners.announced``       ``CallKeys.joiners_announced``  counter of announcements
``joiners.resolved``        ``CallKeys.joiners_resolved``   "<settled>:<looked>:<barrier>" of the lines read
``joiners.resolved_count``  ``CallKeys.joiners_resolved_count``  counter of joiners resolved
``user/<i>/...``            ``CallKeys.user_prefix``        the function's own rendezvous in iteration i
                                                            (``CallWrapper.store``), deleted after it
``inprocess/running/<call>``  ``running``                   the incarnation that runs call ``<call>``
                                                            ("ended:<incarnation>" once it ended)
``inprocess/store_host/call``  ``STORE_HOST_CALL``          the call the store host serves
``inprocess/rank_assignment/...``  ``rank_assignment_exchange``  a per-rank call's exchange outside the
                                                            Wrapper (rank_assignment/store_gather.py)
==========================  ==============================  ==================================================

The native node relay builds its keys from templates that
:mod:`inprocess.processes.native_relay` takes from :class:`CallKeys` and checks
against it. ``tests/test_wire_schema.py`` fails when a key builder is missing
from this table or a key is built anywhere else. This module imports nothing.
"""

from __future__ import annotations

# The keys of one iteration (<i>/<name>), deleted with the iteration by the next barrier's leader; the grow's
# also by the rank that scheduled the grow (engine/grow.py).
ITERATION_KEYS = ("event", "faults", "completed", "arrivals", "ready", "terminated", "decision", "left", "given_up",
                  "progress")
GROW_KEYS = ("grow_at", "grow_arrivals")

STORE_HOST_CALL = "inprocess/store_host/call"

_ROOT = "inprocess"


def call_prefix(call: int, incarnation: str = "") -> str:
    """The prefix of every store key of wrapped call ``call`` in ``incarnation``:
    ``inprocess/<call>/`` without a launcher's incarnation,
    ``inprocess/<incarnation>/<call>/`` with one."""
    if type(call) is not int or call < 0:
        raise ValueError(f"call={call!r}: expected a wrapped call index (int >= 0)")
    if "/" in incarnation:
        raise ValueError(f"incarnation={incarnation!r}: expected no '/' (job_incarnation() quotes it)")
    return f"{_ROOT}/{incarnation}/{call}/" if incarnation else f"{_ROOT}/{call}/"


def running(call: int) -> str:
    """Where the job of call ``call`` names its incarnation (under no incarnation's prefix: a joiner
    of another incarnation must find it)."""
    return f"{_ROOT}/running/{call}"


def rank_assignment_exchange(namespace: str, call: int) -> str:
    """The prefix of one exchange of a per-rank assignment call outside the Wrapper; each member
    sets ``<prefix>/<member>``."""
    return f"{_ROOT}/rank_assignment/{namespace}/{call}"


class CallKeys:
    """The keys of one wrapped call (``prefix``: :func:`call_prefix`)."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str):
        self.prefix = prefix

    @classmethod
    def of(cls, call: int, incarnation: str = "") -> CallKeys:
        return cls(call_prefix(call, incarnation))

    def iteration(self, iteration: int, name: str) -> str:
        if name not in ITERATION_KEYS and name not in GROW_KEYS:
            raise ValueError(f"no iteration key {name!r}: expected one of {ITERATION_KEYS + GROW_KEYS}")
        return f"{self.prefix}{iteration}/{name}"

    def term_outcome(self, barrier: int, term: int) -> str:
        return f"{self.prefix}{barrier}/decision" + (f".{term}" if term else "")

    def term_claim(self, barrier: int, term: int) -> str:
        return f"{self.prefix}{barrier}/lead.{term}"

    def seat(self, index: int) -> str:
        return f"{self.prefix}seat/{index}"

    def seats_per_key(self) -> str:
        return f"{self.prefix}seat/per_key"

    def monitor_heartbeat(self, rank: int) -> str:
        return f"{self.prefix}monitors/{rank}"

    def topology(self) -> str:
        return f"{self.prefix}topology"

    def done(self) -> str:
        return f"{self.prefix}done"

    def settings(self) -> str:
        return f"{self.prefix}settings"

    def settings_first(self) -> str:
        return f"{self.prefix}settings.first"

    def joiner(self, token: str) -> str:
        return f"{self.prefix}joiner/{token}"

    def joiner_told(self, token: str) -> str:
        return f"{self.prefix}joiner/{token}/told"

    def joiner_watched(self, token: str) -> str:
        return f"{self.prefix}joiner/{token}/watched"

    def joiners(self) -> str:
        return f"{self.prefix}joiners"

    def joiners_announced(self) -> str:
        return f"{self.prefix}joiners.announced"

    def joiners_resolved(self) -> str:
        return f"{self.prefix}joiners.resolved"

    def joiners_resolved_count(self) -> str:
        return f"{self.prefix}joiners.resolved_count"

    def user_prefix(self, iteration: int) -> str:
        return f"{self.prefix}user/{iteration}/"
