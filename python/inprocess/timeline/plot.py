"""The PNG of a timeline (needs matplotlib: ``pip install "inprocess[timeline]"``).

Top: the whole job, one row per rank, a bar per phase, a cross where a rank
failed (red: a cause; grey, small: a consequence, by the rule of the restart
record that the text summary follows too), a dotted line per restart. Below:
each restart (the first :data:`MAX_ZOOMS`; a note says when there are more)
zoomed in, time in ms from its first cause, the causes labelled with their
kind and type, and under each rank's bar a thin one for the abort on its
trigger thread.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, none opened

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from inprocess.timeline.model import MAIN, SPARE, TRIGGER, Restart, Timeline, drawn_as_consequence  # noqa: E402

MAX_ZOOMS = 4

PHASE_COLOURS = {
    "INITIAL_BARRIER": "#bdbdbd",
    "RUNNING": "#74c476",
    SPARE: "#c7e9c0",
    "ABORTING": "#fdae6b",
    "FINALIZING": "#e6550d",
    "HEALTH_CHECK": "#fed976",
    "RESTART_BARRIER": "#9e9ac8",
    "COMPLETION": "#6baed6",
    "DONE": "#08519c",
    "TERMINATED": "#252525",
}
OTHER_PHASE = "#969696"
ABORT_COLOUR = "#8c510a"
FAULT_COLOUR = "#d62728"
SECONDARY_COLOUR = "#7f7f7f"
BAR = 0.56  # height of a phase bar, in rows
ABORT_BAR = 0.16


def draw(timeline: Timeline, path: str, title: str = "") -> None:
    """Writes the PNG of ``timeline`` to ``path``."""
    ranks = list(timeline.ranks)
    row = {rank: k for k, rank in enumerate(ranks)}
    zoomable = [r for r in timeline.restarts if r.first_fault_ns is not None]
    zooms = zoomable[:MAX_ZOOMS]
    panel_height = 0.8 + 0.32 * len(ranks)
    fig = plt.figure(figsize=(12, min(2.0 + panel_height * (2 if zooms else 1), 30)), dpi=100)
    grid = fig.add_gridspec(2 if zooms else 1, max(1, len(zooms)), hspace=0.55, wspace=0.08)
    overview = fig.add_subplot(grid[0, :])
    _draw_rows(overview, timeline, row, origin=0, zoomed=False)
    for number, r in enumerate(timeline.restarts, start=1):
        if r.first_fault_ns is not None:
            overview.axvline(r.first_fault_ns / 1e6, color=FAULT_COLOUR, linestyle=":", linewidth=0.8)
            overview.annotate(str(number), (r.first_fault_ns / 1e6, 1.0), xycoords=("data", "axes fraction"),
                              xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                              fontsize=8, color=FAULT_COLOUR)
    overview.set_xlabel("ms since the first event")
    restarts = len(timeline.restarts)
    overview.set_title(f"{title + ': ' if title else ''}{len(ranks)} ranks, {restarts} restart"
                       f"{'' if restarts == 1 else 's'}", loc="left", fontsize=11)
    for k, r in enumerate(zooms):
        ax = fig.add_subplot(grid[1, k], sharey=overview)
        _draw_zoom(ax, timeline, row, r, timeline.restarts.index(r) + 1)
        if k:
            ax.tick_params(labelleft=False)
    if len(zoomable) > len(zooms):
        fig.text(0.01, 0.005, f"Zoomed below: restarts 1 to {len(zooms)} only, of {len(timeline.restarts)}; the "
                 "text summary (python -m inprocess.timeline DIR) lists every one, and the trace shows each.",
                 fontsize=8, color="#444444", ha="left", va="bottom")
    _legend(fig, timeline)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def _draw_rows(ax: Axes, timeline: Timeline, row: dict[int, int], origin: int, zoomed: bool) -> None:
    for s in timeline.slices:
        y = row[s.rank]
        start, width = (s.start_ns - origin) / 1e6, s.dur_ns / 1e6
        if s.track == TRIGGER:
            if zoomed:
                ax.broken_barh([(start, width)], (y + BAR / 2, ABORT_BAR), facecolors=ABORT_COLOUR)
            continue
        inferred = s.args.get("end") == "inferred"
        ax.broken_barh([(start, width)], (y - BAR / 2, BAR), facecolors=PHASE_COLOURS.get(s.name, OTHER_PHASE),
                       edgecolor="white" if inferred else "none", hatch="////" if inferred else None,
                       linewidth=0.3)
    for i in timeline.instants:
        if i.category != "fault":
            continue
        secondary = drawn_as_consequence(i)
        ax.plot((i.t_ns - origin) / 1e6, row[i.rank], marker="x", markersize=5 if secondary else 9,
                markeredgewidth=1.2 if secondary else 2.5, color=SECONDARY_COLOUR if secondary else FAULT_COLOUR,
                zorder=5)
    ax.set_yticks(list(row.values()), [f"rank {r}" for r in row])
    ax.set_ylim(len(row) - 0.5, -0.5)  # rank 0 on top
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)


def _draw_zoom(ax: Axes, timeline: Timeline, row: dict[int, int], r: Restart, number: int) -> None:
    assert r.first_fault_ns is not None
    origin = r.first_fault_ns
    _draw_rows(ax, timeline, row, origin, zoomed=True)
    mine = [s for s in timeline.slices if s.run == r.run and s.iteration == r.iteration]
    ends = [s.end_ns for s in mine if s.track == MAIN and s.name not in ("RUNNING", SPARE)]
    end = r.resumed_ns if r.resumed_ns is not None else max(ends, default=origin + 10_000_000)
    detected = [s.start_ns for s in mine if s.track == TRIGGER]
    start = min([origin, *detected, *([r.earlier_sign_ns] if r.earlier_sign_ns is not None else [])])
    pad = max((end - start) * 0.12, 300_000)
    ax.set_xlim((start - origin - pad) / 1e6, (end - origin + pad) / 1e6)
    middle = (start + end) / 2
    for i in timeline.instants:
        if i.run == r.run and i.category == "fault" and i.iteration == r.iteration and not drawn_as_consequence(i):
            label = " ".join(str(x) for x in (i.args.get("fault"), i.args.get("type")) if x)
            left = i.t_ns > middle  # labels of late faults go to the left, inside the panel
            ax.annotate(label, ((i.t_ns - origin) / 1e6, row[i.rank]), xytext=(-6 if left else 6, -9),
                        textcoords="offset points", ha="right" if left else "left",
                        fontsize=8, color=FAULT_COLOUR, fontweight="bold", zorder=6,
                        bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "alpha": 0.75, "edgecolor": "none"})
    recovery = _ms(r.recovery_ns)
    cause = "no fault recorded"
    if r.causes:
        first = r.causes[0]
        cause = f"rank {first.get('rank')}: {first.get('kind')} {first.get('type')}"
        cause += f" (+{len(r.causes) - 1} more)" if len(r.causes) > 1 else ""
    title = f"restart {number}, iteration {r.iteration}\n{cause}\nall RUNNING again after {recovery}"
    if r.earlier_sign_ns is not None:
        title += f"\n({r.earlier_sign_what} seen {_ms(r.first_fault_ns - r.earlier_sign_ns)} before it)"
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_xlabel("ms from its first cause")


def _ms(ns: int | None) -> str:
    return "?" if ns is None else f"{ns / 1e6:.1f} ms"


def _legend(fig: plt.Figure, timeline: Timeline) -> None:
    seen = {s.name for s in timeline.slices if s.track == MAIN}
    handles: list[Patch | Line2D] = [Patch(facecolor=colour, label=name) for name, colour in PHASE_COLOURS.items()
                                     if name in seen]
    handles += [Patch(facecolor=OTHER_PHASE, label=name) for name in sorted(seen - set(PHASE_COLOURS))]
    if any(s.track == TRIGGER for s in timeline.slices):
        handles.append(Patch(facecolor=ABORT_COLOUR, label="abort (trigger thread)"))
    if any(s.args.get("end") == "inferred" for s in timeline.slices):
        handles.append(Patch(facecolor="#dddddd", hatch="////", edgecolor="white", label="events stopped (killed)"))
    handles.append(Line2D([], [], marker="x", color=FAULT_COLOUR, linestyle="none", markeredgewidth=2.5,
                          label="fault: a cause"))
    if any(i.category == "fault" and drawn_as_consequence(i) for i in timeline.instants):
        handles.append(Line2D([], [], marker="x", color=SECONDARY_COLOUR, linestyle="none",
                              label="consequence (not a cause)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, -0.06))
