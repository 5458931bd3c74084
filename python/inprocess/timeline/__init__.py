"""See a restart: merge the events of every rank into one timeline.

``python -m inprocess.timeline DIR [--out PREFIX] [--png]`` reads every
``rank<N>.jsonl`` that :mod:`inprocess.events` wrote in ``DIR`` and writes

- ``PREFIX.trace.json``: a trace in the Trace Event Format, for
  https://ui.perfetto.dev or chrome://tracing. One process per rank; on its
  first thread a slice per phase, from the rank's ``phase`` event to its next
  one, and instants for its faults, decisions and exit; on its second thread
  the abort, from ``restart_detected`` to ``abort_done`` (it runs on the
  restart trigger thread, concurrently with the main thread's phases);
- ``PREFIX.png`` with ``--png`` (matplotlib, the ``timeline`` extra): bars per
  rank coloured by phase, the failed ranks marked, each restart zoomed in;

and prints a summary of each restart. ``PREFIX`` defaults to ``DIR/timeline``.

**One clock for every rank.** Each event carries ``t_ns`` (CLOCK_MONOTONIC of
its host) and ``wall`` (``time.time()``). The processes of one host read the
same monotonic clock, which no NTP step or slew moves: within a host, events
are ordered and durations measured by ``t_ns`` alone, to the ns. The monotonic
clocks of two hosts have unrelated origins, so each host gets one offset,
the median over its events of ``wall - t_ns``, and its events are placed at
``t_ns + offset``. Durations within a host stay exact; hosts are aligned to
the precision of their wall clocks (NTP: about a ms), which is the best the
events allow. With a single host this is the monotonic clock shifted by a
constant. Times in the trace are µs since the earliest event.

**What a file may hold.** A rank's file can hold several wrapped calls (the
``call`` field) and the events of a relaunched process appended after those
of the one before; each ``call_start`` begins a new segment. A killed rank's
file just stops: its last phase is drawn until the other ranks learnt of it
(their first restart detection or decision after its last event), and a
fault that only the decision reports (its monitor saw the death) is placed
there. A last line cut by the kill is skipped with a warning; any other bad
line is skipped with a warning naming its file and line (``--strict``: an
error).
"""

from inprocess.timeline.model import Instant, Restart, Slice, Timeline, build
from inprocess.timeline.reading import EventFileError, Loaded, load
from inprocess.timeline.trace import to_trace, write_trace

__all__ = [
    "EventFileError",
    "Instant",
    "Loaded",
    "Restart",
    "Slice",
    "Timeline",
    "build",
    "load",
    "to_trace",
    "write_trace",
]
