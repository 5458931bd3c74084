"""The simulator's results in words: tables, verdicts, the markdown block and the plot.

The plot needs matplotlib (``pip install inprocess[bench]``); everything
else here needs nothing beyond the standard library.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from inprocess.control.store_ops import WAIT_CHUNK_S

from .config import WATCHED_PEERS, SimConfig

MD_BEGIN = "<!-- control-plane results: begin (written by python -m benchmarks.control_plane --out DIR) -->"
MD_END = "<!-- control-plane results: end -->"
# Earlier runs wrote this opening marker; a results block that starts with it is replaced too.
_OLD_MD_BEGIN = "<!-- control-plane results: begin (written by control_plane_sim.py) -->"

Column = tuple[str, str, str]

COLUMNS: list[Column] = [
    ("mode", "mode", "{}"),
    ("N", "n", "{:d}"),
    ("nodes", "nodes", "{:.0f}"),
    ("median ms", "median_ms", "{:.0f}"),
    ("max ms", "max_ms", "{:.0f}"),
    ("wake max ms", "wake_max_ms", "{:.0f}"),
    ("ops/rank", "ops_per_rank_median", "{:g}"),
    ("ops leader", "ops_leader", "{:g}"),
    ("ops/node", "ops_per_node_median", "{:g}"),
    ("requests/rank", "requests_per_rank_median", "{:g}"),
    ("requests/node", "requests_per_node_median", "{:g}"),
    ("requests/restart", "requests_total", "{:.0f}"),
    ("B/rank", "bytes_per_rank_median", "{:.0f}"),
    ("B/node", "bytes_per_node_median", "{:.0f}"),
    ("B leader", "bytes_leader", "{:.0f}"),
    ("decision B", "decision_bytes", "{:.0f}"),
    ("server req/s", "server_requests_per_s", "{:.0f}"),
    ("server CPU ms", "server_cpu_ms", "{:.0f}"),
    ("server CPU us/req", "server_cpu_us_per_request", "{:.1f}"),
    ("client CPU ms", "client_cpu_ms", "{:.0f}"),
    ("assign ms", "assignment_ms", "{:.1f}"),
    ("decode ms", "decode_ms", "{:.2f}"),
    ("load", "load_average", "{:.1f}"),
]

# Steady state: no restart under way.
STEADY_COLUMNS: list[Column] = [
    ("mode", "mode", "{}"),
    ("N", "n", "{:d}"),
    ("idle req/s", "steady_requests_per_s", "{:g}"),
    ("idle server CPU %", "steady_server_cpu_pct", "{:.1f}"),
    ("heartbeat requests/round", "hb_requests_per_round", "{:.0f}"),
    ("B/monitor/round", "hb_bytes_per_monitor", "{:.0f}"),
    ("round server CPU ms", "hb_server_cpu_ms", "{:.0f}"),
    ("server CPU us/req", "hb_server_cpu_us_per_request", "{:.1f}"),
    ("steady req/s", "steady_state_requests_per_s", "{:.0f}"),
    ("steady server CPU %", "steady_state_server_cpu_pct", "{:.2f}"),
]


def table(results: list[dict[str, Any]], markdown: bool = False, columns: list[Column] | None = None) -> str:
    columns = COLUMNS if columns is None else columns
    head = [c[0] for c in columns]
    rows = [[fmt.format(r[key]) if key in r else "-" for _, key, fmt in columns] for r in results]
    if markdown:
        align = [":---" if key == "mode" else "---:" for _, key, _ in columns]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _scaling(mode: str, what: str, a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """1024 -> 16384 ranks, in figures and in words."""
    sc: dict[str, Any] = {
        "n_ratio": 16.0,
        "server_cpu_ratio": b["server_cpu_ms"] / max(a["server_cpu_ms"], 1e-9),
        "requests_ratio": b["requests_total"] / a["requests_total"],
        "median_ms_ratio": b["median_ms"] / a["median_ms"],
        "ops_per_rank": [a["ops_per_rank_median"], b["ops_per_rank_median"]],
        "bytes_per_rank": [a["bytes_per_rank_median"], b["bytes_per_rank_median"]],
    }
    per_node = ""
    if mode == "node":
        sc["ops_per_node"] = [a["ops_per_node_median"], b["ops_per_node_median"]]
        per_node = f"; per node: ops {a['ops_per_node_median']:g} -> {b['ops_per_node_median']:g}"
    line = (
        f"{what}, 1024 -> 16384 ranks (x16): server requests x{sc['requests_ratio']:.1f}, "
        f"server CPU x{sc['server_cpu_ratio']:.1f}, median time x{sc['median_ms_ratio']:.1f}; per rank: "
        f"ops {a['ops_per_rank_median']:g} -> {b['ops_per_rank_median']:g}, "
        f"bytes {a['bytes_per_rank_median']:.0f} -> {b['bytes_per_rank_median']:.0f}{per_node}"
    )
    return sc, line


def _at_16384(mode: str, what: str, b: dict[str, Any]) -> str:
    requests = f"{b['requests_per_rank_median']:g} per rank"
    if mode == "node":
        requests += f", {b['requests_per_node_median']:g} per node"
    return (
        f"{what}, 16384 ranks: the median rank held the decision {b['median_ms']:.0f} ms after the fault, "
        f"the last {b['max_ms']:.0f} ms: target (median < 1000 ms) "
        f"{'met' if b['median_ms'] < 1000 else 'NOT met'}; {b['requests_total']:.0f} server requests per "
        f"restart ({requests}); server CPU {b['server_cpu_ms']:.0f} ms "
        f"({b['server_cpu_us_per_request']:.1f} us per request), client CPU {b['client_cpu_ms']:.0f} ms, "
        f"1-minute load average {b['load_average']:.1f}"
    )


def _steady(mode: str, what: str, last: dict[str, Any]) -> str:
    waiters = (f"every node agent (not every trigger: they wait on the board) re-sends its blocking get "
               f"of the event once per {WAIT_CHUNK_S:g} s" if mode == "node" else
               f"every trigger re-sends its blocking get once per {WAIT_CHUNK_S:g} s")
    return (
        f"{what}, steady state at {last['n']} ranks: {last['steady_state_requests_per_s']:.0f} requests/s, "
        f"{last['steady_state_server_cpu_pct']:.2f} % of the server's core: per heartbeat interval "
        f"({last.get('heartbeat_interval_s', 30.0):g} s) every monitor sends one add and one multi_get of "
        f"{WATCHED_PEERS} peers' counters (3 requests on the wire: ADD, WAIT, MULTI_GET; measured "
        f"{last['hb_server_cpu_us_per_request']:.1f} us of server CPU each), and {waiters} "
        f"(CANCEL_WAIT + WAIT); the restart protocol sends nothing else between restarts (measured with "
        f"every wait parked: {last['steady_requests_per_s']:g} requests/s). During a restart: "
        f"{last['server_requests_per_s']:.0f} requests/s ({last['requests_total']:.0f} requests in "
        f"{last['max_ms']:.0f} ms)"
    )


def verdicts(results: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The figures the targets are about, in words, per mode."""
    scaling: dict[str, Any] = {}
    lines = []
    for mode in ("node", "direct"):
        rs = [r for r in results if r["mode"] == mode]
        if not rs:
            continue
        big = {r["n"]: r for r in rs}
        sc: dict[str, Any] = {}
        what = f"{mode} mode" + (f" ({rs[0]['ranks_per_node']} ranks per node)" if mode == "node" else "")
        if 1024 in big and 16384 in big:
            sc, line = _scaling(mode, what, big[1024], big[16384])
            lines.append(line)
        if 16384 in big:
            b = big[16384]
            sc["target_1s_median_met"] = b["median_ms"] < 1000.0
            sc["max_under_1s"] = b["max_ms"] < 1000.0
            lines.append(_at_16384(mode, what, b))
        if "steady_state_requests_per_s" in rs[-1]:
            lines.append(_steady(mode, what, rs[-1]))
        scaling[mode] = sc
    return scaling, lines


# --joiners: per kind of restart (measure.phase_figures), over the restarts of that kind.
JOIN_BAR_MEDIAN_MS, JOIN_BAR_MAX_MS = 500.0, 1000.0  # issue 21: every restart that admits joiners


def join_table(results: list[dict[str, Any]]) -> str:
    """One row per mode, N and kind of restart (lose, admit, plain)."""
    head = ["mode", "N", "restarts", "kind", "median ms p50", "median ms worst", "max ms p50", "max ms worst",
            "ops/rank", "ops/rank max", "ops leader", "requests/rank", "server CPU ms", "decision B", "admit ms",
            "admit calls", "joiners", "joiner admitted ms", "joiner decided max ms", "joiner ops"]
    rows = [head]
    for r in results:
        phases = r.get("phases")
        if phases is None and "per_restart" in r:  # the baseline job, without joiners
            per = r["per_restart"]
            medians, maxima = [x["median_ms"] for x in per], [x["max_ms"] for x in per]
            phases = {"no joins": {
                "restarts": len(per), "median_ms_p50": statistics.median(medians), "median_ms_worst": max(medians),
                "max_ms_p50": statistics.median(maxima), "max_ms_worst": max(maxima),
                "ops_per_rank_median": r["ops_per_rank_median"], "ops_per_rank_max": r["ops_per_rank_max"],
                "ops_leader": r["ops_leader"], "requests_per_rank": r["requests_total"] / r["ranks"],
                "server_cpu_ms": r["server_cpu_ms"], "decision_bytes": max(x["decision_bytes"] for x in per),
                "admit_ms": r.get("admit_ms")}}
        for phase, f in (phases or {}).items():
            def g(key: str, fmt: str, f: dict[str, Any] = f) -> str:
                v = f.get(key)
                return "-" if v is None else fmt.format(v)
            rows.append([r["mode"], str(r["n"]), str(f["restarts"]), phase, g("median_ms_p50", "{:.0f}"),
                         g("median_ms_worst", "{:.0f}"), g("max_ms_p50", "{:.0f}"), g("max_ms_worst", "{:.0f}"),
                         g("ops_per_rank_median", "{:g}"), g("ops_per_rank_max", "{:g}"), g("ops_leader", "{:g}"),
                         g("requests_per_rank", "{:.2f}"), g("server_cpu_ms", "{:.0f}"),
                         g("decision_bytes", "{:.0f}"), g("admit_ms", "{:.1f}"), g("admit_calls", "{:g}"),
                         g("joiners", "{:d}"), g("joiner_admitted_median_ms", "{:.0f}"),
                         g("joiner_decided_max_ms", "{:.0f}"), g("joiner_ops_median", "{:g}")])
    widths = [max(len(row[k]) for row in rows) for k in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def join_verdicts(results: list[dict[str, Any]]) -> list[str]:
    """Issue 21's bar for every restart that admitted joiners: median <= 0.5 s and maximum <= 1 s."""
    lines = []
    for r in results:
        admit = r.get("phases", {}).get("admit")
        if admit is None:
            continue
        ok = sum(1 for m, x in zip(admit["median_ms"], admit["max_ms"], strict=True)
                 if m <= JOIN_BAR_MEDIAN_MS and x <= JOIN_BAR_MAX_MS)
        verdict = "met" if ok == admit["restarts"] else "NOT met"
        medians = ", ".join(f"{m:.0f}" for m in admit["median_ms"])
        maxima = ", ".join(f"{m:.0f}" for m in admit["max_ms"])
        lines.append(f"{r['mode']} N={r['n']} with {admit['joiners']} joiners: bar (median <= "
                     f"{JOIN_BAR_MEDIAN_MS:.0f} ms, max <= {JOIN_BAR_MAX_MS:.0f} ms) {verdict} in {ok} of "
                     f"{admit['restarts']} admitting restarts (medians {medians} ms; maxima {maxima} ms)")
    return lines


def plot(results: list[dict[str, Any]], path: str, cfg: SimConfig) -> bool:
    """Draws time against N, both modes, into ``path``; False (nothing written)
    without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colours = {"node": "tab:blue", "direct": "tab:orange"}
    every_n: set[int] = set()
    for mode in ("node", "direct"):
        rs = [r for r in results if r["mode"] == mode]
        if not rs:
            continue
        ns = [r["n"] for r in rs]
        every_n.update(ns)
        c = colours[mode]
        what = f"node agents, {rs[0]['ranks_per_node']} ranks/node" if mode == "node" else "direct (every rank)"
        ax.plot(ns, [r["max_ms"] for r in rs], "o-", color=c, label=f"{what}: max over ranks (fault → decision held)")
        ax.plot(ns, [r["median_ms"] for r in rs], "s-", color=c, alpha=0.6, label=f"{what}: median over ranks")
        # /proc counts CPU time in 10 ms ticks: a restart under one tick reads 0, not drawn on the log scale.
        cpu = [r["server_cpu_ms"] if r["server_cpu_ms"] > 0 else float("nan") for r in rs]
        ax.plot(ns, cpu, "^--", color=c, label=f"{what}: store server CPU per restart (10 ms ticks)")
    ax.axhline(1000, color="red", lw=0.8, label="target: median under 1 s at 16,384")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(every_n)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(n) for n in ticks])
    ax.set_xlabel("simulated ranks N")
    ax.set_ylabel("ms")
    ax.set_title(f"Restart control plane, one TCPStore, {cfg.procs} client processes ({os.cpu_count()} cores)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "?"


def markdown_block(results: list[dict[str, Any]], cfg: SimConfig, command: str, lines: list[str],
                   png: str | None) -> str:
    """The results block: the command, the tables, the verdicts and the plot's link (if drawn)."""
    modes = " and ".join(
        f"node mode ({r['ranks_per_node']} ranks per node: one board and one agent relay per node)"
        if r["mode"] == "node" else "direct mode (every rank talks to the store)"
        for r in {r["mode"]: r for r in results}.values()
    )
    picture = [f"![control-plane time against N]({png})", ""] if png else []
    return "\n".join([
        MD_BEGIN,
        "",
        f"Command: `{command}` — {os.cpu_count()} cores, torch {_torch_version()}, {modes}; "
        f"{cfg.procs} client processes x {cfg.groups} groups (2 connections each; plus a leader and a control "
        f"connection per process), fault kind `{cfg.kind}`, median of {cfg.restarts} restarts per N, decode "
        f"`{cfg.decode}`; \"load\": the 1-minute load average at the end of each job (this machine's "
        f"{os.cpu_count()} cores are shared with whatever else runs on it).",
        "",
        table(results, markdown=True),
        "",
        f"Steady state (no restart; heartbeat interval {cfg.heartbeat_interval_s:g} s, the Wrapper's default):",
        "",
        table(results, markdown=True, columns=STEADY_COLUMNS),
        "",
        *[f"- {line}" for line in lines],
        "",
        *picture,
        MD_END,
    ])


def write_markdown(path: str, block: str) -> None:
    """Replace the results block of ``path`` (between its markers), keeping the
    prose around it; a file without one gets the block appended (a new file:
    the block alone)."""
    text = open(path).read() if os.path.exists(path) else ""
    for begin in (MD_BEGIN, _OLD_MD_BEGIN):
        if begin in text and MD_END in text.split(begin, 1)[1]:
            head, rest = text.split(begin, 1)
            text = head + block + rest.split(MD_END, 1)[1]
            break
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)
