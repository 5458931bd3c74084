"""``python -m inprocess.timeline DIR [--out PREFIX] [--png] [--strict]``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from inprocess.timeline.model import build
from inprocess.timeline.reading import EventFileError, load
from inprocess.timeline.summary import summary_lines
from inprocess.timeline.trace import write_trace

INSTALL_HINT = 'pip install "inprocess[timeline]"  (or: pip install "matplotlib>=3.5")'


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inprocess.timeline",
        description="Merge the events of a job (one rank<N>.jsonl per rank) into a Perfetto/Chrome trace, "
                    "optionally a PNG, and print a summary of its restarts.",
    )
    parser.add_argument("directory", help="the events directory (Wrapper(events_dir=...) or INPROCESS_EVENTS_DIR)")
    parser.add_argument("--out", default=None,
                        help="prefix of the files written: PREFIX.trace.json, PREFIX.png (default: DIR/timeline)")
    parser.add_argument("--png", action="store_true", help="also draw PREFIX.png (needs matplotlib)")
    parser.add_argument("--strict", action="store_true",
                        help="a malformed line is an error (default: skipped with a warning)")
    ns = parser.parse_args(argv)
    if ns.png:
        try:
            from inprocess.timeline import plot
        except ImportError as e:
            print(f"inprocess.timeline: --png needs matplotlib ({e}); install it with:\n  {INSTALL_HINT}",
                  file=sys.stderr)
            return 2
    try:
        loaded = load(ns.directory, strict=ns.strict)
    except EventFileError as e:
        print(f"inprocess.timeline: malformed event: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"inprocess.timeline: {e}", file=sys.stderr)
        return 2
    prefix = ns.out if ns.out is not None else os.path.join(ns.directory, "timeline")
    out_dir = os.path.dirname(prefix) or "."
    if not os.path.isdir(out_dir):
        parser.error(f"--out {prefix!r}: the directory {out_dir!r} does not exist")
    timeline = build(loaded)
    for warning in timeline.warnings:
        print(f"inprocess.timeline: warning: {warning}", file=sys.stderr)
    trace_path = prefix + ".trace.json"
    write_trace(timeline, trace_path, source=os.path.abspath(ns.directory))
    for line in summary_lines(timeline, ns.directory, loaded.n_events):
        print(line)
    print(f"trace: {trace_path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if ns.png:
        png_path = prefix + ".png"
        plot.draw(timeline, png_path, title=os.path.basename(os.path.abspath(ns.directory)))
        print(f"png: {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
