"""Joining a running job: a SIGKILLed rank's replacement process (INPROCESS_JOIN=1) is admitted
into its seat at the next restart, as a spare or an active rank; real processes, store, gloo."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from typing_extensions import Self

from conftest import WORKERS, leftover_processes
from inprocess.launch import LocalJob

pytestmark = pytest.mark.multiprocess


class Respawner:
    """Stands in for a launcher that replaces a killed rank process: each process of the job that
    dies of SIGKILL is replaced, after ``delay_s``, by one with the same seat and INPROCESS_JOIN=1."""

    def __init__(self, job: LocalJob, delay_s: float = 0.2, max_per_seat: int = 3):
        self.job = job
        self.delay_s = delay_s
        self.max_per_seat = max_per_seat
        self.processes: list[tuple[int, int, subprocess.Popen[str]]] = [
            (rp.rank, 0, rp.popen) for rp in job.ranks]
        self.outputs: dict[tuple[int, int], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="respawner", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for _, _, popen in self.processes:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(10)

    def _run(self) -> None:
        watched = list(self.processes)
        while not self._stop.is_set() and watched:
            for entry in list(watched):
                seat, life, popen = entry
                if popen.poll() is None:
                    continue
                watched.remove(entry)
                if popen.returncode == -signal.SIGKILL and life < self.max_per_seat:
                    time.sleep(self.delay_s)
                    replacement = self.job.respawn(seat, life + 1)
                    new = (seat, life + 1, replacement.popen)
                    self.processes.append(new)
                    watched.append(new)
            time.sleep(0.05)

    def wait(self, timeout: float) -> dict[tuple[int, int], int]:
        """Until every process, replacements included, exited; their exit statuses by (seat, life)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(p.poll() is not None for _, _, p in self.processes) and not self._thread_busy():
                break
            time.sleep(0.1)
        else:
            running = [(s, lf) for s, lf, p in self.processes if p.poll() is None]
            for _, _, popen in self.processes:
                if popen.poll() is None:
                    os.killpg(popen.pid, signal.SIGKILL)
            for seat, life, popen in self.processes:
                self.outputs[(seat, life)] = popen.communicate(timeout=10)[0] or ""
            raise TimeoutError(f"processes still running after {timeout:g}s: {running}\n{self.describe()}")
        for seat, life, popen in self.processes:
            out, _ = popen.communicate(timeout=10)
            self.outputs[(seat, life)] = out or ""
        return {(seat, life): popen.returncode for seat, life, popen in self.processes}

    def _thread_busy(self) -> bool:
        # A SIGKILLed process whose replacement has not started yet.
        return any(p.returncode == -signal.SIGKILL and life < self.max_per_seat
                   and not any(s == seat and lf == life + 1 for s, lf, _ in self.processes)
                   for seat, life, p in self.processes)

    def describe(self) -> str:
        text = ""
        for seat, life, popen in self.processes:
            out = self.outputs.get((seat, life))
            if out is None and popen.poll() is not None and popen.stdout is not None:
                try:
                    out = popen.stdout.read()
                except Exception:
                    out = ""
            text += f"--- seat {seat} life {life} (rc={popen.returncode}) ---\n{(out or '')[-4000:]}\n"
        return text


Outputs = tuple[dict[tuple[int, int], int], dict[tuple[int, int], Any], str]


def run_joins(tmp_path: pathlib.Path, plan: dict[str, Any], world_size: int, timeout: float = 150.0,
              env: dict[str, str] | None = None, ranks_per_node: int | None = None) -> Outputs:
    """The job's exit statuses and results by (seat, life), and every process's output."""
    out = tmp_path / "out"
    out.mkdir()
    job_env = {"INPROCESS_TEST_OUT": str(out), "INPROCESS_TEST_PLAN": json.dumps(plan),
               "INPROCESS_TEST_DUMP_AFTER": str(timeout - 10), "INPROCESS_TEST_LOG": "INFO",
               "INPROCESS_RESTART_STORM": "off"}
    job_env.update(env or {})
    with LocalJob([str(WORKERS / "join_worker.py")], world_size, env=job_env, ranks_per_node=ranks_per_node) as job:
        with Respawner(job) as respawner:
            codes = respawner.wait(timeout)
            text = respawner.describe()
            pgids = {p.pid for _, _, p in respawner.processes}
        left = leftover_processes(pgids, grace=10.0)
        assert not left, f"processes left running: {left}\n{text}"
    logs = {}
    for path in out.glob("seat*.life*.json"):
        seat, life = path.stem.removeprefix("seat").split(".life")
        logs[(int(seat), int(life))] = json.loads(path.read_text())
    return codes, logs, text


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ranks_per_node", [None, pytest.param(2, marks=pytest.mark.slow)],
                         ids=["one node", "node agents"])
def test_a_respawned_rank_joins_as_the_spare_and_takes_over_at_the_next_fault(
        tmp_path: pathlib.Path, ranks_per_node: int | None) -> None:
    """5 seats, 4 active and a spare. Seat 1 is SIGKILLed: the spare (seat 4) takes over, and the
    respawned seat 1 waits as a joiner. Seat 2 is SIGKILLed once it waits: the joiner is admitted into
    seat 1 and activated in the same restart; the respawned seat 2 waits, and the job's end closes it.
    With 2 ranks per node, the others arrive through their node agents, the joiner directly."""
    # The ranks block in a collective while seat 2 waits for the joiner's start (seconds of imports
    # on a loaded machine): the soft timeout must outlast it.
    plan = {"steps": 90, "step_s": 0.03, "active": 4, "end_after_joiners": 1,
            "wrapper": {"soft_timeout": 90, "hard_timeout": 120, "barrier_timeout": 150},
            "kills": [{"seat": 1, "life": 0, "step": 10}, {"seat": 2, "life": 0, "step": 40, "after_joiners": 1}]}
    codes, logs, text = run_joins(tmp_path, plan, world_size=5, ranks_per_node=ranks_per_node)
    assert codes[(1, 0)] == -signal.SIGKILL and codes[(2, 0)] == -signal.SIGKILL, text
    finishers = [(0, 0), (3, 0), (4, 0), (1, 1)]
    for key in finishers + [(2, 1)]:
        assert codes.get(key) == 0, f"{key}: {codes}\n{text}"
    results = {key: logs[key]["result"] for key in finishers}
    for key, result in results.items():
        assert result["step"] == 90 and result["active_world_size"] == 4, (key, result)
    params = {json.dumps(r["params"]) for r in results.values()}
    assert len(params) == 1, f"the active ranks ended with different parameters: {results}"
    # The joiner took seat 1 over in the second restart, and was activated by it.
    restarts = results[(0, 0)]["restarts"]
    assert [r["terminated"] for r in restarts] == [[1], [2]], json.dumps(restarts, indent=1)
    assert restarts[1]["joined"] == [1] and 1 in restarts[1]["activated"], restarts
    assert restarts[0]["joined"] == [] and restarts[0]["activated"] == [4], restarts
    first = logs[(1, 1)]["iterations"][0]
    assert first["iteration"] == 2 and first["start_step"] >= 40, logs[(1, 1)]
    # Seat 2's replacement waited to the end, and returned like a spare.
    assert logs[(2, 1)]["outcome"] == "returned" and logs[(2, 1)]["result"] is None, logs[(2, 1)]
    # Told by the job's end, or (the store host exits right after) by the store going away.
    assert ("did not join: the job ended" in text or "the store went away while this process waited to join"
            in text), text[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_leader_that_dies_while_it_admits_a_joiner_is_taken_over_and_the_joiner_runs(
        tmp_path: pathlib.Path) -> None:
    """As above, but the leader of the restart that admits seat 1's joiner dies right after writing
    the admission, before it moves the seat or tells the joiner. Another rank takes the lead over;
    the joiner is admitted once (no stale seat, no second admission) and runs to the end with the
    others."""
    plan = {"steps": 90, "step_s": 0.03, "active": 4, "end_after_joiners": 1,
            "wrapper": {"soft_timeout": 90, "hard_timeout": 120, "barrier_timeout": 150},
            "kills": [{"seat": 1, "life": 0, "step": 10}, {"seat": 2, "life": 0, "step": 40, "after_joiners": 1}],
            "die_admitting": True}
    codes, logs, text = run_joins(tmp_path, plan, world_size=5)
    leaders = [key for key, log in logs.items() if log.get("died_admitting")]
    assert len(leaders) == 1 and leaders[0][1] == 0, f"no leader died admitting: {leaders}\n{text}"
    leader = leaders[0][0]
    killed = {(1, 0), (2, 0), (leader, 0)}
    assert all(codes.get(key) == -signal.SIGKILL for key in killed), f"{codes}\n{text}"
    finishers = [(seat, 0) for seat in (0, 3, 4) if seat != leader] + [(1, 1)]
    assert all(codes.get(key) == 0 for key in finishers), f"{finishers}: {codes}\n{text}"
    results = {key: logs[key]["result"] for key in finishers}
    assert all(r["step"] == 90 for r in results.values()), results
    assert len({json.dumps(r["params"]) for r in results.values()}) == 1, results
    joined = [r["joined"] for r in results[finishers[0]]["restarts"] if r["joined"]]
    assert joined and joined[0] == [1] and sum(j.count(1) for j in joined) == 1, results[finishers[0]]["restarts"]
    # (The replacements of the killed seats waited, or came after the job's end and said so.)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_five_kills_under_the_launchers_respawn_end_with_the_world_and_a_spare(tmp_path: pathlib.Path) -> None:
    """The issue's job: 4 active ranks and a spare under ``inprocess.launch --respawn``; whoever is
    active rank 1 is SIGKILLed five times. The first time the spare takes over; then each restart
    admits the process respawned after the one before, ranked where its seat stands: seat 1's joiner
    is active rank 1 again, so seats 1 and 2 die in turn (seat 1 three times: ``--respawn 3``). The
    job ends with 4 active ranks of equal parameters and a joiner waiting."""
    out = tmp_path / "out"
    out.mkdir()
    kills = [{"active_rank": 1, "step": 10 + 20 * k, "after_joiners": 0 if k == 0 else 1} for k in range(5)]
    plan = {"steps": 110, "step_s": 0.03, "active": 4, "end_after_joiners": 1, "kills": kills,
            "wrapper": {"soft_timeout": 90, "hard_timeout": 120, "barrier_timeout": 150}}
    env = {**os.environ, "INPROCESS_TEST_OUT": str(out), "INPROCESS_TEST_PLAN": json.dumps(plan),
           "INPROCESS_TEST_LOG": "INFO", "INPROCESS_RESTART_STORM": "off"}
    cmd = [sys.executable, "-m", "inprocess.launch", "--nproc", "5", "--respawn", "3", "--respawn-backoff", "0.1",
           "--timeout", "360", str(WORKERS / "join_worker.py")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    text = res.stdout[-6000:] + res.stderr[-12000:]
    logs = {}
    for path in out.glob("seat*.life*.json"):
        seat, life = path.stem.removeprefix("seat").split(".life")
        logs[(int(seat), int(life))] = json.loads(path.read_text())
    alive = [key for key, log in logs.items() if os.path.exists(f"/proc/{log['pid']}")]
    assert not alive, f"processes left running: {alive}"
    assert res.returncode == 0, text
    killed = sorted(key for key, log in logs.items() if "killed_at" in log)
    assert killed == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1)], (killed, text)  # (seat, life)
    finishers = {key: log["result"] for key, log in logs.items() if log.get("result")}
    assert len(finishers) == 4, (sorted(finishers), text)
    assert {r["step"] for r in finishers.values()} == {110}
    assert {r["active_world_size"] for r in finishers.values()} == {4}
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1, finishers
    spares = [key for key, log in logs.items() if log.get("outcome") == "returned" and log.get("result") is None]
    assert len(spares) == 1, (logs, text)
    # Seen from a rank that lived through every restart: each excluded one rank; from the second on,
    # each admitted the process respawned after the one before, and activated it.
    survivor = next(r for r in finishers.values() if len(r["restarts"]) == 5)
    for index, restart in enumerate(survivor["restarts"]):
        assert len(restart["terminated"]) == 1, restart
        if index > 0:
            assert len(restart["joined"]) == 1 and restart["joined"] == restart["activated"], restart
    assert "5 respawns" in res.stderr, res.stderr[-3000:]


@pytest.mark.timeout(200)
def test_without_spares_a_loss_shrinks_the_world_and_a_grow_at_a_safe_point_takes_the_joiner_back(
        tmp_path: pathlib.Path) -> None:
    """4 seats, all active, GrowPolicy(check_every=5). Seat 2 is SIGKILLed: the job goes on with 3.
    Its respawned process waits; at the end of an atomic() block (a safe point) every rank stops,
    the job restarts on purpose (a grow, not a fault), admits the joiner and runs with 4 again."""
    plan = {"steps": 30, "until_world": 4, "step_s": 0.03, "active": 4, "grow": {"check_every": 5},
            "kills": [{"seat": 2, "life": 0, "step": 10}],
            "wrapper": {"soft_timeout": 90, "hard_timeout": 120, "barrier_timeout": 150}}
    codes, logs, text = run_joins(tmp_path, plan, world_size=4)
    assert codes == {(0, 0): 0, (1, 0): 0, (2, 0): -signal.SIGKILL, (3, 0): 0, (2, 1): 0}, text
    finishers = {key: logs[key]["result"] for key in [(0, 0), (1, 0), (3, 0), (2, 1)]}
    assert {r["active_world_size"] for r in finishers.values()} == {4}, finishers
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1
    assert len({r["step"] for r in finishers.values()}) == 1
    restarts = finishers[(0, 0)]["restarts"]
    assert len(restarts) == 2, json.dumps(restarts, indent=1)
    assert restarts[0]["terminated"] == [2] and restarts[0]["joined"] == [], restarts
    grow = restarts[1]
    assert grow["causes"] == ["grow"] and grow["terminated"] == [], grow
    assert grow["joined"] == [2] and grow["activated"] == [2], grow
    # Recorded by whichever rank arrived last at the grow point.
    assert re.search(r"grow after iteration 1: cause: rank \d grow: Grow: 1 joiner waiting, 1 seat empty", text), \
        text[-4000:]
