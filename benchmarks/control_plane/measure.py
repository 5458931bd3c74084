"""What the simulator measures, per restart and per N, and the checks behind it.

Every rank (and in node mode every node's relay) sends the server exactly
the requests, keys and values of the real protocol, in its real order;
``RestartProtocol.ops`` and ``.requests`` are counted per rank (the deferred
get once) and per node (its relay's two protocols). Every restart is checked:
every live rank holds the same decision bytes (in node mode also every node's
relay) and the row ``ShiftRanks`` must give it, and exactly one rank led;
the run fails otherwise.

What differs from a real job: (a) at most P*(groups+1) requests are in
flight and as many waits are parked on the server (a real job parks N waits
in direct mode, one per node in node mode, and sends up to N requests at
once); (b) within a group the ranks (and nodes) are served one after
another, so a rank's time includes its predecessors' round trips; (c) the
Python work of all N ranks (protocol code, syscalls) shares this machine's
cores with the server, where a real job spreads it over N hosts. The times
are therefore an upper bound for the control plane; the server's own CPU
time per restart (from /proc) is the part a real job cannot spread: the
TCPStore server is one event-loop thread. (d) Over loopback the kernel runs
the receiver's TCP receive path and wake-up inside the sender's ``write``:
the server's CPU per request includes work that a network would do on the
client's host. (e) Decoding: see :mod:`.decoding`. Node mode: see
:mod:`.nodes`. (i) A real job still opens two connections per rank (and the
monitors'), of which node mode uses one request per rank per restart; the
agents add two per node.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from inprocess.control.membership import ACTIVE, TERMINATED
from inprocess.control.store_ops import WAIT_CHUNK_S

from .config import SimConfig


def pick_faulty(n: int, restarts: int) -> list[int]:
    """Distinct ranks spread over the job (and over the client processes)."""
    out: list[int] = []
    for j in range(restarts):
        r = (n // 2 + 1 + j * (n // (restarts + 1) + 3)) % n
        while r in out:
            r = (r + 1) % n
        out.append(r)
    return out


def expected_row(n: int, faulty: list[int], restart: int, kind: str, rank: int) -> tuple[int, int, int]:
    """(mode, rank, active_rank) that ShiftRanks must give ``rank`` after ``restart``."""
    if kind != "killed":
        return ACTIVE, rank, rank
    dead = faulty[: restart + 1]
    if rank in dead:
        return TERMINATED, -1, -1
    new = rank - sum(1 for d in dead if d < rank)
    return ACTIVE, new, new


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _node_figures(j: int, done: list[dict[str, Any]], alive: list[int], rpn: int,
                  digests: set[str]) -> dict[str, Any]:
    """Node mode: every node with a live rank relayed the event and the decision
    and forwarded its arrivals, and its relay read the same decision bytes as
    the ranks."""
    nodes = [d for rec in done for d in rec["nodes"]]
    live_nodes = sorted({r // rpn for r in alive})
    if sorted(rec[0] for rec in nodes) != live_nodes:
        raise RuntimeError(f"restart {j}: {len(nodes)} nodes relayed the decision, expected {len(live_nodes)}")
    node_digests = {rec[5] for rec in nodes}
    if node_digests != digests:
        raise RuntimeError(f"restart {j}: node relays read {len(node_digests)} decisions, not the ranks' one")
    n_ops = [rec[1] for rec in nodes]
    n_reqs = [rec[2] for rec in nodes]
    n_bytes = [rec[3] + rec[4] for rec in nodes]
    return {
        "nodes": len(nodes),
        "ops_per_node_median": statistics.median(n_ops),
        "ops_per_node_max": max(n_ops),
        "ops_nodes_total": sum(n_ops),
        "requests_per_node_median": statistics.median(n_reqs),
        "requests_per_node_max": max(n_reqs),
        "requests_nodes_total": sum(n_reqs),
        "bytes_per_node_median": statistics.median(n_bytes),
    }


def restart_figures(n: int, j: int, faulty: list[int], cfg: SimConfig, done: list[dict[str, Any]],
                    rpn: int = 0, rows: list[tuple[int, int, int]] | None = None,
                    joined: list[int] | None = None) -> dict[str, Any]:
    """The figures of restart ``j`` from every client process's records; raises
    if the ranks disagree or a rank holds a wrong assignment. ``rows``: every
    rank's expected row when it is not :func:`expected_row`'s (with joiners);
    ``joined``: seats admitted in this restart, whose joiners hold the
    decision but are not ranks of it yet (:func:`joiner_figures` checks them)."""

    def expected(r: int) -> tuple[int, int, int]:
        return rows[r] if rows is not None else expected_row(n, faulty, j, cfg.kind, r)

    reporters = [d["reporter"] for d in done if d["reporter"] is not None]
    if len(reporters) != 1:
        raise RuntimeError(f"restart {j}: {len(reporters)} fault reports, expected 1")
    t0, rep_ops, rep_req, rep_out, rep_in = reporters[0]
    records = [rec for d in done for rec in d["records"]]
    newcomers = set(joined or [])
    alive = [r for r in range(n) if expected(r)[0] != TERMINATED and r not in newcomers]
    if sorted(rec[0] for rec in records) != alive:
        raise RuntimeError(f"restart {j}: {len(records)} ranks hold a decision, expected {len(alive)}")
    digests = {rec[11] for rec in records}
    mdigests = {rec[12] for rec in records}
    wrong = [rec[0] for rec in records if tuple(rec[8:11]) != expected(rec[0])]
    leaders = [rec for rec in records if rec[7]]
    if len(digests) != 1 or len(mdigests) != 1 or wrong or len(leaders) != 1:
        raise RuntimeError(
            f"restart {j}: ranks disagree: {len(digests)} decision digests, {len(mdigests)} table digests, "
            f"{len(wrong)} wrong assignments (e.g. {wrong[:5]}), {len(leaders)} leaders"
        )
    done_ms = [(rec[2] - t0) / 1e6 for rec in records]
    woken_ms = [(rec[1] - t0) / 1e6 for rec in records]
    ops = [rec[3] for rec in records]
    reqs = [rec[4] for rec in records]
    bytes_ = [rec[5] + rec[6] for rec in records]
    leader = leaders[0]
    window_s = max(done_ms) / 1e3
    node_figures = _node_figures(j, done, alive, rpn, digests) if rpn > 0 else {}
    total_requests = sum(reqs) + rep_req + node_figures.get("requests_nodes_total", 0)
    return {
        "restart": j,
        "ranks": len(records),
        **node_figures,
        "requests_ranks_total": sum(reqs),
        "requests_reporter": rep_req,
        "median_ms": statistics.median(done_ms),
        "p99_ms": _pct(done_ms, 0.99),
        "max_ms": max(done_ms),
        "wake_median_ms": statistics.median(woken_ms),
        "wake_max_ms": max(woken_ms),
        "decided_ms": (leader[2] - t0) / 1e6,  # the leader held its decision: it published it just before
        "ops_per_rank_median": statistics.median(ops),
        "ops_per_rank_max": max(ops),
        "ops_leader": leader[3],
        "ops_reporter": rep_ops,
        "ops_total": sum(ops) + rep_ops + node_figures.get("ops_nodes_total", 0),
        "requests_per_rank_median": statistics.median(reqs),
        "requests_total": total_requests,
        "bytes_per_rank_median": statistics.median(bytes_),
        "bytes_per_rank_mean": sum(bytes_) / len(bytes_),
        "bytes_leader": leader[5] + leader[6],
        "bytes_reporter": rep_out + rep_in,
        "server_requests_per_s": total_requests / window_s,
        "decision_bytes": leader[14],
        "assignment_ms": leader[13] / 1e6,
        "decode_ms": max(d["decode_us"] for d in done) / 1e3,
        "decisions": sorted(digests),
    }


def joiner_figures(j: int, t0: int, admitted: list[int], done: list[dict[str, Any]], digests: set[str],
                   admit_ms: float | None, rows: list[tuple[int, int, int]] | None,
                   admit_calls: int | None = None) -> dict[str, Any]:
    """Restart j admitted ``admitted``: every joiner got its admission at barrier j+1 and read the
    ranks' decision, holding its expected row in it."""
    joiners = sorted((rec for d in done for rec in d["joiners"]), key=lambda rec: rec[0])
    seats = [rec[0] for rec in joiners]
    if seats != admitted:
        raise RuntimeError(f"restart {j}: {len(seats)} joiners admitted, expected {len(admitted)}")
    bad = [rec[0] for rec in joiners
           if rec[5] != j + 1 or rows is None or tuple(rec[7]) != rows[rec[0]] or rec[8] not in digests]
    if bad:
        raise RuntimeError(f"restart {j}: joiners of seats {bad[:5]} hold another barrier, decision or row")
    if not joiners:
        return {"joiners": 0, "admit_ms": admit_ms, "admit_calls": admit_calls}
    admitted_ms = [(rec[2] - t0) / 1e6 for rec in joiners]
    decided_ms = [(rec[3] - t0) / 1e6 for rec in joiners]
    ops = [rec[6] for rec in joiners]
    return {
        "joiners": len(joiners),
        "joiner_admitted_median_ms": statistics.median(admitted_ms),
        "joiner_decided_max_ms": max(decided_ms),
        "joiner_ops_median": statistics.median(ops),
        "joiner_ops_max": max(ops),
        "admit_ms": admit_ms,
        "admit_calls": admit_calls,
    }


def phase_figures(restarts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """--joiners: per phase (lose, admit, plain), each restart's median and maximum over its ranks."""
    out: dict[str, dict[str, Any]] = {}
    for phase in ("lose", "admit", "plain"):
        rs = [r for r in restarts if r.get("phase") == phase]
        if not rs:
            continue
        medians = [r["median_ms"] for r in rs]
        maxes = [r["max_ms"] for r in rs]
        f: dict[str, Any] = {
            "restarts": len(rs),
            "median_ms": medians,
            "max_ms": maxes,
            "median_ms_p50": statistics.median(medians),
            "median_ms_worst": max(medians),
            "max_ms_p50": statistics.median(maxes),
            "max_ms_worst": max(maxes),
            "ops_per_rank_median": statistics.median(r["ops_per_rank_median"] for r in rs),
            "ops_per_rank_max": max(r["ops_per_rank_max"] for r in rs),
            "ops_leader": statistics.median(r["ops_leader"] for r in rs),
            "requests_per_rank": statistics.median(r["requests_total"] / r["ranks"] for r in rs),
            "server_cpu_ms": statistics.median(r["server_cpu_ms"] for r in rs),
            "decision_bytes": max(r["decision_bytes"] for r in rs),
            "admit_ms": statistics.median(r["admit_ms"] for r in rs if r.get("admit_ms") is not None)
            if any(r.get("admit_ms") is not None for r in rs) else None,
            "admit_calls": statistics.median(r["admit_calls"] for r in rs if r.get("admit_calls") is not None)
            if any(r.get("admit_calls") is not None for r in rs) else None,
        }
        if phase == "admit":
            f["joiners"] = rs[0]["joiners"]
            f["joiner_admitted_median_ms"] = statistics.median(r["joiner_admitted_median_ms"] for r in rs)
            f["joiner_decided_max_ms"] = max(r["joiner_decided_max_ms"] for r in rs)
            f["joiner_ops_median"] = statistics.median(r["joiner_ops_median"] for r in rs)
            f["joiner_ops_max"] = max(r["joiner_ops_max"] for r in rs)
        out[phase] = f
    return out


def summary(n: int, cfg: SimConfig, procs: int, connections: int, restarts: list[dict[str, Any]],
            hb: list[dict[str, Any]], rpn: int = 0) -> dict[str, Any]:
    """One N in one mode: medians over its restarts, and the steady state."""
    out: dict[str, Any] = {"mode": "node" if rpn > 0 else "direct", "n": n, "ranks_per_node": rpn, "procs": procs,
                           "connections": connections, "restarts": len(restarts)}
    for key, value in restarts[0].items():
        if isinstance(value, (int, float)) and key != "restart":
            out[key] = statistics.median(r[key] for r in restarts)
    # Steady state, per heartbeat interval (cfg.heartbeat_interval_s): every
    # monitor's add + multi_get (measured), plus every blocking get of the
    # event re-sent once per WAIT_CHUNK_S (CANCEL_WAIT + a new WAIT): one per
    # trigger in direct mode, one per node agent (its broadcast thread) in
    # node mode, where the triggers wait on the board.
    monitors = n - (len(restarts) if cfg.kind == "killed" else 0)
    waiters = restarts[-1]["nodes"] if rpn > 0 else monitors
    if hb:
        hb_requests = statistics.median(h["requests"] for h in hb)
        hb_cpu_ms = statistics.median(h["server_cpu_ms"] for h in hb)
        out["hb_requests_per_round"] = hb_requests
        out["hb_server_cpu_ms"] = hb_cpu_ms
        out["hb_wall_ms"] = statistics.median(h["wall_ms"] for h in hb)
        out["hb_bytes_per_monitor"] = statistics.median(h["bytes"] for h in hb) / monitors
        out["hb_server_cpu_us_per_request"] = 1e3 * hb_cpu_ms / hb_requests
        rewaits = 2 * waiters / WAIT_CHUNK_S
        out["steady_state_requests_per_s"] = hb_requests / cfg.heartbeat_interval_s + rewaits
        out["steady_state_server_cpu_pct"] = 100.0 * (
            hb_cpu_ms / 1e3 / cfg.heartbeat_interval_s
            + rewaits * out["hb_server_cpu_us_per_request"] / 1e6
        )
    out["worst_max_ms"] = max(r["max_ms"] for r in restarts)
    out["server_cpu_us_per_rank"] = 1e3 * out["server_cpu_ms"] / n
    out["server_cpu_us_per_request"] = 1e3 * out["server_cpu_ms"] / out["requests_total"]
    out["load_average"] = os.getloadavg()[0]
    out["all_agree"] = True  # restart_figures raises otherwise
    out["heartbeat_interval_s"] = cfg.heartbeat_interval_s
    out["per_restart"] = restarts
    return out
