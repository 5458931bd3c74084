"""The simulator's processes: one TCPStore server, client processes, and the driver.

The TCPStore server (``use_libuv=True``) lives alone in a ``python -c``
process; the simulated ranks (and, in node mode, their nodes' boards and
relays) live in ``cfg.procs`` client processes (:mod:`.client`), which in
node mode hold whole nodes; the driver, this process, only commands them and
reads CPU times from ``/proc``. Every connection goes to 127.0.0.1. Every
process it starts dies with it (PR_SET_PDEATHSIG) and is reaped when the
session closes.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from typing_extensions import Self

from .config import SimConfig
from .joins import ADMIT, JoinPlan
from .measure import joiner_figures, phase_figures, pick_faulty, restart_figures, summary

# The server: alone in its process, until its stdin closes (the driver closes
# it or exits) or the driver dies (PR_SET_PDEATHSIG), so that it cannot
# outlive the driver.
SERVER_CODE = """
import ctypes, datetime, os, signal, sys
ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
if os.getppid() == 1:
    sys.exit(1)
import torch.distributed as dist
from inprocess.control.host_names import numeric_host_names
numeric_host_names()  # as the library's store host: no reverse DNS lookup per connection
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
                      timeout=datetime.timedelta(seconds=600))
sys.stdout.write(f"{store.port}\\n")
sys.stdout.flush()
sys.stdin.read()
"""

# torch's socket layer reverse-resolves every connected address (getnameinfo
# without NI_NUMERICHOST, client and server side); "::ffff:127.0.0.1" may not
# be in /etc/hosts, so each connect may wait on the resolver. The server and the
# client processes apply the library's redirect to the numeric form
# (inprocess/control/host_names.py), as ranks and store hosts do; this bounds the
# wait of any lookup that would be left, in the processes this benchmark starts.
CHILD_ENV = {"RES_OPTIONS": "timeout:1 attempts:2"}

Progress = Callable[[str], None]


def _client_argv() -> tuple[list[str], dict[str, str]]:
    """How to start a client process: this package's ``client`` module, with the
    directory that holds the package on the child's path (the package is
    ``benchmarks.control_plane`` from the repository root, or ``control_plane``
    under ``benchmarks/control_plane_sim.py``)."""
    package = __package__ or "control_plane"
    root = pathlib.Path(__file__).resolve().parents[package.count(".") + 1]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", f"{package}.client"], {"PYTHONPATH": path}


class Child:
    """A child process speaking JSON lines; its stdout is read by a thread."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        full_env = dict(os.environ, **CHILD_ENV, **(env or {}))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=full_env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((msg if isinstance(msg, str) else json.dumps(msg)) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float, what: str) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"pid {self.proc.pid}: no {what} within {timeout:g}s") from None
        if line is None:
            raise RuntimeError(f"pid {self.proc.pid} exited (rc={self.proc.poll()}) before {what}")
        return line

    def ask(self, msg: Any, timeout: float, what: str) -> dict[str, Any]:
        self.send(msg)
        return self.answer(timeout, what)

    def answer(self, timeout: float, what: str) -> dict[str, Any]:
        reply = json.loads(self.recv(timeout, what))
        if "error" in reply:
            raise RuntimeError(f"pid {self.proc.pid}: {reply['error']}")
        return reply

    def reap(self, grace: float = 5.0) -> None:
        """Close stdin (the child leaves on EOF), then kill if needed; always wait."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(grace)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quiet(_: str) -> None:
    pass


class Session:
    """One TCPStore server and ``cfg.procs`` client processes, reused for every N.

    Connecting is the slow part (see CHILD_ENV), so the connections are made
    once; each N is a separate job under its own key prefix (``call``).
    ``progress`` receives a line per restart as the run goes.
    """

    def __init__(self, cfg: SimConfig, progress: Progress = _quiet):
        self.cfg = cfg
        self.progress = progress
        self.server: Child | None = None
        self.clients: list[Child] = []
        self.connections = 0
        self.port = 0
        self._calls = 0

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        cfg = self.cfg
        self.server = Child([sys.executable, "-c", SERVER_CODE])
        self.port = int(self.server.recv(cfg.timeout_s, "server port"))
        argv, env = _client_argv()
        for _ in range(cfg.procs):
            self.clients.append(Child(argv, env))
        for c in self.clients:
            c.send({"port": self.port, "groups": cfg.groups, "timeout_s": cfg.timeout_s, "decode": cfg.decode,
                    "relay": cfg.relay})
        self.connections = sum(c.answer(cfg.timeout_s, "connections")["connections"] for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.reap()
        if self.server is not None:
            self.server.reap()
        self.clients, self.server = [], None

    def server_cpu(self) -> float:
        assert self.server is not None
        return cpu_seconds(self.server.proc.pid)

    def _split(self, n: int, rpn: int) -> tuple[list[Child], list[int]]:
        """The clients that take part and the rank bounds of each (whole nodes in node mode)."""
        if rpn > 0:
            nodes = -(-n // rpn)
            clients = self.clients[: max(1, min(len(self.clients), nodes))]
            procs = len(clients)
            return clients, [min(n, rpn * (nodes * k // procs)) for k in range(procs + 1)]
        clients = self.clients[: max(1, min(len(self.clients), n))]
        procs = len(clients)
        return clients, [n * k // procs for k in range(procs + 1)]

    def simulate(self, n: int, ranks_per_node: int | None = None) -> dict[str, Any]:
        """``cfg.restarts`` restarts of a job of N simulated ranks, in node mode
        (``ranks_per_node`` > 0; default: ``cfg.ranks_per_node``) or direct mode (0)."""
        cfg = self.cfg
        cfg.check_world_size(n)
        rpn = cfg.ranks_per_node if ranks_per_node is None else ranks_per_node
        if rpn < 0:
            raise ValueError(f"ranks_per_node={rpn}: expected >= 0 (0: direct mode)")
        mode = "node" if rpn > 0 else "direct"
        clients, bounds = self._split(n, rpn)
        faulty = pick_faulty(n, cfg.restarts)
        call = self._calls
        self._calls += 1
        for k, c in enumerate(clients):
            c.send({"cmd": "job", "n": n, "call": call, "lo": bounds[k], "hi": bounds[k + 1], "faulty": faulty,
                    "kind": cfg.kind, "timeout_s": cfg.timeout_s, "check_membership": cfg.check_membership,
                    "ranks_per_node": rpn, "joiners": cfg.joiners, "joiner_layout": cfg.joiner_layout})
        for c in clients:
            c.answer(cfg.timeout_s, "ranks armed")
        plan = JoinPlan(n, cfg.joiners, cfg.restarts, faulty, cfg.joiner_layout)
        restarts = []
        for j in range(cfg.restarts):
            r = self._restart(n, j, faulty, clients, rpn, plan)
            restarts.append(r)
            joined = f", {r['joiners']} joiners admitted" if r.get("joiners") else ""
            self.progress(f"N={n} {mode}: restart {j + 1}/{cfg.restarts} ({r['phase']}): median "
                          f"{r['median_ms']:.1f} ms, max {r['max_ms']:.1f} ms (all woken {r['wake_max_ms']:.0f} ms, "
                          f"decide {r.get('decide_from_ms', 0):.0f}-{r.get('decide_to_ms', 0):.0f} ms, "
                          f"leader {r['decided_ms']:.0f} ms){joined}")
        hb = self._heartbeats(clients)
        clients[0].ask({"cmd": "complete", "iteration": cfg.restarts}, cfg.timeout_s, "complete")
        for c in clients:
            c.send({"cmd": "end"})
        for c in clients:
            final = c.answer(cfg.timeout_s, "end of job")
            if final["alive_threads"] or final["errors"]:
                raise RuntimeError(f"pid {c.proc.pid}: {final['alive_threads']} rank threads left, {final['errors']}")
        out = summary(n, cfg, len(clients), self.connections, restarts, hb, rpn)
        if cfg.joiners:
            out["phases"] = phase_figures(restarts)
        return out

    def _restart(self, n: int, j: int, faulty: list[int], clients: list[Child], rpn: int,
                 plan: JoinPlan) -> dict[str, Any]:
        """Restart ``j``: an idle window measured, then the fault, until every rank holds the decision.
        With joiners (:mod:`.joins`), those of an admit restart announce themselves before the window."""
        cfg = self.cfg
        time.sleep(cfg.settle_s)
        if plan.phase(j) == ADMIT:
            announced = sum(c.ask({"cmd": "announce", "restart": j}, cfg.timeout_s, "announced")["announced"]
                            for c in clients)
            if announced != len(plan.admitted_in(j)):
                raise RuntimeError(f"restart {j}: {announced} joiners announced, expected {len(plan.admitted_in(j))}")
        s0 = sum(c.ask({"cmd": "snap"}, cfg.timeout_s, "snap")["snap"] for c in clients)
        cpu_a = self.server_cpu()
        time.sleep(cfg.steady_s)
        cpu_b = self.server_cpu()
        s1 = sum(c.ask({"cmd": "snap"}, cfg.timeout_s, "snap")["snap"] for c in clients)
        cpu_fault = self.server_cpu()
        ccpu_fault = sum(cpu_seconds(c.proc.pid) for c in clients)
        for c in clients:
            c.send({"cmd": "fault", "restart": j})
        done = [c.answer(cfg.timeout_s, f"restart {j} done") for c in clients]
        cpu_c = self.server_cpu()
        ccpu_c = sum(cpu_seconds(c.proc.pid) for c in clients)
        rows = plan.rows(j) if cfg.joiners else None
        r = restart_figures(n, j, faulty, cfg, done, rpn, rows, plan.admitted_in(j))
        r["phase"] = plan.phase(j)
        admit = [(d["admit_ns"], d["admit_calls"]) for d in done if d.get("admit_ns") is not None]
        t0 = next(d["reporter"][0] for d in done if d["reporter"] is not None)
        decided = [d["decide_ns"] for d in done if d.get("decide_ns") is not None]
        if decided:  # the leader's decide_fn (admit, assignment): after every arrival, before the decision is out
            r["decide_from_ms"], r["decide_to_ms"] = ((t - t0) / 1e6 for t in decided[0])
        r.update(joiner_figures(j, t0, plan.admitted_in(j), done, set(r["decisions"]),
                                admit[0][0] / 1e6 if admit else None, rows, admit[0][1] if admit else None))
        r["steady_requests_per_s"] = (s1 - s0) / cfg.steady_s if cfg.steady_s > 0 else 0.0
        r["steady_server_cpu_pct"] = 100.0 * (cpu_b - cpu_a) / cfg.steady_s if cfg.steady_s > 0 else 0.0
        r["server_cpu_ms"] = 1e3 * (cpu_c - cpu_fault)
        r["client_cpu_ms"] = 1e3 * (ccpu_c - ccpu_fault)
        return r

    def _heartbeats(self, clients: list[Child]) -> list[dict[str, Any]]:
        """Steady state: one heartbeat interval's worth of monitor requests,
        sent as fast as the clients can, to measure their server CPU."""
        cfg = self.cfg
        hb = []
        for _ in range(cfg.heartbeat_rounds):
            time.sleep(cfg.settle_s)
            cpu_a, t_a = self.server_cpu(), time.monotonic()
            for c in clients:
                c.send({"cmd": "heartbeats"})
            got = [c.answer(cfg.timeout_s, "heartbeat round") for c in clients]
            cpu_b, t_b = self.server_cpu(), time.monotonic()
            hb.append({"requests": sum(g["hb_requests"] for g in got), "bytes": sum(g["hb_bytes"] for g in got),
                       "server_cpu_ms": 1e3 * (cpu_b - cpu_a), "wall_ms": 1e3 * (t_b - t_a)})
        return hb


def simulate(n: int, cfg: SimConfig, progress: Progress = _quiet) -> dict[str, Any]:
    """One job of N simulated ranks (mode: ``cfg.ranks_per_node``) in a session of its own."""
    with Session(cfg, progress) as s:
        return s.simulate(n)
