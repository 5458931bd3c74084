"""The monitor process (python -m inprocess.processes.monitor) against real ranks, signals and a real TCPStore.

A fake rank (tests/workers/monitor_rank.py) creates its heartbeat page, spawns
its monitor with HelperProcess.start(MonitorConfig(...)) and then faults. The test process is a child
subreaper while a test runs, so the monitor, orphaned when its rank dies, is
re-parented to it: the test reads the monitor's exit status and reaps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from inprocess import _native
from inprocess.control.protocol import TERMINATED_UNIT, RestartProtocol
from inprocess.processes.contract import MonitorConfig
from inprocess.processes.monitor import EXIT_OK, EXIT_STORE, HEARTBEAT_GONE, monitor_heartbeat_key

torch_dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="pidfds and subreapers are Linux-only")

WORKER = pathlib.Path(__file__).parent / "workers" / "monitor_rank.py"
PR_SET_CHILD_SUBREAPER = 36
S = 1_000_000_000


def _set_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class RankRun:
    """One fake rank and its monitor."""

    def __init__(self, tmp: pathlib.Path, port: int, **plan: Any):
        self.logfile = tmp / f"monitor{plan.get('rank', 1)}.log"
        self.pidfile = tmp / f"monitor{plan.get('rank', 1)}.pid"
        self.plan = {
            "store_port": port, "rank": 1, "call": 0, "iteration": 2, "world_size": 4, "phase": "RUNNING",
            "hard_timeout_s": 0.0, "grace_s": 0.2, "action": "wait",
            "logfile": str(self.logfile), "pidfile": str(self.pidfile),
        }
        self.plan.update(plan)
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(self.plan)], stdout=subprocess.PIPE, text=True
        )
        self.monitor_pid: int | None = None
        self.monitor_status: int | None = None

    def spawned(self) -> int:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "spawned", f"rank said {line!r}; log:\n{self.log()}"
        self.monitor_pid = int(line[1])
        return self.monitor_pid

    def ready(self) -> int:
        self.spawned()
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line == ["ready", str(self.monitor_pid)], f"rank said {line!r}; log:\n{self.log()}"
        return self.monitor_pid  # type: ignore[return-value]

    def log(self) -> str:
        return self.logfile.read_text() if self.logfile.exists() else "(no monitor log)"

    def wait_rank(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def wait_monitor(self, timeout: float) -> int:
        """The monitor's exit code (it was re-parented to this process)."""
        assert self.monitor_pid is not None
        if self.monitor_status is None:
            deadline = time.monotonic() + timeout
            while True:  # test harness: waitpid has no timeout
                try:
                    pid, status = os.waitpid(self.monitor_pid, os.WNOHANG)
                except ChildProcessError:  # not re-parented yet: its rank is still dying
                    pid, status = 0, 0
                if pid:
                    self.monitor_status = status
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"monitor {self.monitor_pid} still running; log:\n{self.log()}")
                time.sleep(0.01)
        return os.waitstatus_to_exitcode(self.monitor_status)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        if self.monitor_pid is not None and self.monitor_status is None:
            try:
                pid, status = os.waitpid(self.monitor_pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = 0, 0
            if pid == 0:
                try:
                    os.kill(self.monitor_pid, signal.SIGKILL)
                    _, status = os.waitpid(self.monitor_pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
            self.monitor_status = status


@pytest.fixture
def store() -> Iterator[Any]:
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


@pytest.fixture
def rank_run(tmp_path: pathlib.Path, store: Any) -> Iterator[Any]:
    runs: list[RankRun] = []
    shm_before = _shm()
    _set_subreaper(True)

    def start(**plan: Any) -> RankRun:
        if plan.get("phase", "RUNNING") == "RUNNING":
            _in_iteration(store, rank=plan.get("rank", 1), iteration=plan.get("iteration", 2))
        run = RankRun(tmp_path, store.port, **plan)
        runs.append(run)
        return run

    try:
        yield start
    finally:
        try:
            for run in runs:
                run.cleanup()
        finally:
            _set_subreaper(False)
    for run in runs:
        assert run.monitor_pid is None or not os.path.exists(f"/proc/{run.monitor_pid}"), "a monitor remains"
        assert not run.pidfile.exists(), "the monitor left its pidfile"
    assert _shm() <= shm_before, f"left in /dev/shm: {sorted(_shm() - shm_before)}"


def _in_iteration(store: Any, rank: int, iteration: int, world_size: int = 4) -> None:
    """The store as the rank left it running ``iteration``: its seat at barrier
    ``iteration``, and that barrier's decision (everyone active)."""
    from inprocess.control.membership import Membership
    from inprocess.control.protocol import Decision

    p = RestartProtocol(store, 0)
    p.seat_table.write({rank: str(iteration)})
    p.publish_decision(Decision(iteration, Membership.all_active(world_size), [], [], 0, leader=0))


def _faults(store: Any, iteration: int) -> list[Any]:
    return RestartProtocol(store, 0).read_faults(iteration)


def _arrivals(store: Any, barrier: int) -> int:
    return int(store.add(f"inprocess/0/{barrier}/arrivals", 0))


def _assert_died_in_iteration(store: Any, run: RankRun, kind: str, type_: str | None = None) -> None:
    assert run.wait_monitor(10) == EXIT_OK, run.log()
    faults = _faults(store, 2)
    assert len(faults) == 1, (faults, run.log())
    f = faults[0]
    assert (f.rank, f.iteration, f.kind) == (1, 2, kind), (f, run.log())
    if type_ is not None:
        assert f.type == type_, f
    assert "phase RUNNING" in f.message
    assert store.get("inprocess/0/2/event") == b"restart"
    assert _arrivals(store, 3) == TERMINATED_UNIT  # one terminated arrival, no healthy one
    assert store.get("inprocess/0/3/terminated") == b"1,"
    assert "modules: torch=False" in run.log()


@pytest.mark.timeout(60)
def test_sigkill_is_recorded_and_the_monitor_arrives_for_the_rank(rank_run: Any, store: Any) -> None:
    run = rank_run()
    mpid = run.ready()
    # The monitor watches: it is light and holds no torch.
    maps = pathlib.Path(f"/proc/{mpid}/maps").read_text()
    assert "libtorch" not in maps and "torch/_C" not in maps
    status = pathlib.Path(f"/proc/{mpid}/status").read_text()
    rss_kb = int(status.split("VmRSS:")[1].split()[0])
    rollup = pathlib.Path(f"/proc/{mpid}/smaps_rollup").read_text()
    uss_kb = sum(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Private_"))
    print(f"monitor RSS {rss_kb} kB, USS {uss_kb} kB")
    assert rss_kb < 64 * 1024
    assert int(run.pidfile.read_text()) == mpid
    os.kill(run.proc.pid, signal.SIGKILL)
    # The rank stays an unreaped zombie until the monitor is done, so that the
    # monitor can read how it died (best effort in a real job: the launcher
    # may reap it first, and the fault is then of kind "exited").
    _assert_died_in_iteration(store, run, "killed", "SIGKILL")
    assert run.wait_rank(10) == -signal.SIGKILL


@pytest.mark.timeout(60)
def test_hard_timeout_kills_the_rank(rank_run: Any, store: Any) -> None:
    run = rank_run(action="hang", hard_timeout_s=0.5, grace_s=0.2)
    run.ready()
    t0 = time.monotonic()
    rc = run.wait_rank(20)
    assert rc == -signal.SIGTERM  # a sleeping Python dies of SIGTERM within the grace
    assert time.monotonic() - t0 < 10
    _assert_died_in_iteration(store, run, "hard_timeout", "HardTimeout")
    assert "EXITED_DURING_GRACE" in _faults(store, 2)[0].message


@pytest.mark.timeout(60)
def test_sigstop_is_handled_by_the_hard_timeout(rank_run: Any, store: Any) -> None:
    run = rank_run(action="wait", hard_timeout_s=0.5, grace_s=0.2)
    run.ready()
    os.kill(run.proc.pid, signal.SIGSTOP)
    assert run.wait_rank(20) in (-signal.SIGTERM, -signal.SIGKILL)
    _assert_died_in_iteration(store, run, "hard_timeout", "HardTimeout")


@pytest.mark.timeout(60)
def test_normal_exit_leaves_the_store_alone(rank_run: Any, store: Any) -> None:
    run = rank_run(action="done")
    run.ready()
    assert run.wait_rank(10) == 0
    assert run.wait_monitor(10) == EXIT_OK, run.log()
    for key in ("inprocess/0/2/faults", "inprocess/0/2/event", "inprocess/0/3/arrivals", "inprocess/0/3/terminated"):
        assert not store.check([key]), key
    assert "nothing to do" in run.log()


@pytest.mark.timeout(60)
def test_os_exit_is_recorded(rank_run: Any, store: Any) -> None:
    run = rank_run(action="exit1")
    run.ready()
    _assert_died_in_iteration(store, run, "exited", "exit code 1")
    assert run.wait_rank(10) == 1


@pytest.mark.timeout(60)
def test_segfault_is_recorded(rank_run: Any, store: Any) -> None:
    run = rank_run(action="segv")
    run.ready()
    _assert_died_in_iteration(store, run, "killed", "SIGSEGV")
    assert run.wait_rank(10) == -signal.SIGSEGV


@pytest.mark.timeout(60)
def test_rank_gone_before_the_monitor_watches(rank_run: Any, store: Any) -> None:
    run = rank_run(action="early")
    run.spawned()
    assert run.wait_rank(10) == 3
    _assert_died_in_iteration(store, run, "exited")


@pytest.mark.timeout(60)
def test_sigterm_stops_the_monitor_without_touching_the_store(rank_run: Any, store: Any) -> None:
    run = rank_run(action="wait")
    mpid = run.ready()
    pidfd = _native.pidfd_open(mpid)  # the rank is its parent here: watch it through a pidfd
    try:
        os.kill(mpid, signal.SIGTERM)
        assert _native.wait_for_exit(pidfd, 10 * S), run.log()
    finally:
        os.close(pidfd)
    assert "stopped by SIGTERM" in run.log()
    assert not run.pidfile.exists()
    # The rank goes on; its death later is nobody's business but the test's.
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait_rank(10)
    assert not store.check(["inprocess/0/2/faults"])


@pytest.mark.timeout(60)
def test_a_monitor_stopped_with_its_dying_rank_counts_it_out_and_marks_nothing_gone(rank_run: Any,
                                                                                   store: Any) -> None:
    """A node torn down: its processes get SIGTERM, then SIGKILL, the monitor and its rank alike. A
    monitor stopped while its rank is still in the job (phase RUNNING) must not mark its seat left on
    purpose (its peers would never count the rank out: the job waited barrier_timeout, one run in four
    of tests/test_slurm_real.py's store-apart case); its rank dying meanwhile, it counts it out itself."""
    run = rank_run(action="wait", heartbeat_interval_s=0.05, heartbeat_timeout_s=5.0, initial_world_size=4)
    mpid = run.ready()
    key = monitor_heartbeat_key(0, 1)
    store.wait([key])
    os.kill(mpid, signal.SIGTERM)
    os.kill(run.proc.pid, signal.SIGKILL)
    assert run.wait_monitor(20) == EXIT_OK, run.log()
    run.wait_rank(10)
    assert int(store.add(key, 0)) < HEARTBEAT_GONE, run.log()  # not marked left on purpose
    faults = _faults(store, 2)
    assert [(f.rank, f.kind, f.type) for f in faults] == [(1, "killed", "SIGKILL")], run.log()
    assert _arrivals(store, 3) == TERMINATED_UNIT


@pytest.mark.timeout(60)
def test_rank_that_arrived_at_the_restart_barrier(rank_run: Any, store: Any) -> None:
    """Died after counting itself in at barrier 3, once barrier 3 had decided: the
    monitor reports a fault in iteration 3 and arrives at barrier 4. Its seat says
    so; the page says nothing of it (the rank may die right after its add)."""
    from inprocess.control.membership import Membership
    from inprocess.control.protocol import Decision

    p = RestartProtocol(store, 0)
    p.seat_table.write({1: "3"})  # counted itself in at barrier 3
    membership = Membership.all_active(4)
    membership.terminate({2})
    p.publish_decision(Decision(3, membership, [2], [], 0, leader=0))
    run = rank_run(phase="RESTART_BARRIER")
    run.ready()
    os.kill(run.proc.pid, signal.SIGKILL)
    assert run.wait_monitor(10) == EXIT_OK, run.log()
    run.wait_rank(10)
    assert not store.check(["inprocess/0/3/terminated"])  # no double arrival at barrier 3
    faults = p.read_faults(3)
    assert [(f.rank, f.kind) for f in faults] == [(1, "killed")]
    assert _arrivals(store, 4) == TERMINATED_UNIT
    assert store.get("inprocess/0/4/terminated") == b"1,"


@pytest.mark.timeout(60)
def test_the_leader_dead_before_its_decision_is_excluded_by_it(rank_run: Any, store: Any) -> None:
    """Rank 1 arrived first at barrier 3 (so it leads) and dies before it decided:
    its monitor ends the leader's term with a lost mark, which wakes the three
    ranks waiting for the decision; one of them takes the lead over and barrier
    3's own decision excludes rank 1, with the monitor's fault record in it."""
    import threading

    from inprocess.compose import Compose
    from inprocess.control.membership import Membership
    from inprocess.control.protocol import Decision
    from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide

    p = RestartProtocol(store, 0)
    p.publish_decision(Decision(2, Membership.all_active(4), [], [], 0, leader=0))  # expected at barrier 3: 4
    for r in range(4):
        p.seat_table.write({r: "2"})
    assert p.arrive(3, 1, 4) == (1, 0, False)  # rank 1 first: the leader
    run = rank_run(phase="RESTART_BARRIER")
    run.ready()

    def decide_fn(dead: set[int], faults: list[Any], leader: int) -> Decision:
        return decide(Compose(ActivateAllRanks(), ShiftRanks()), Membership.all_active(4), dead, faults, 3, leader)

    got: dict[int, Any] = {}

    def waiter(r: int) -> None:
        try:
            got[r] = RestartProtocol(store.clone(), 0).barrier(3, r, 4, decide=decide_fn, timeout=20)
        except Exception as e:  # reported below
            got[r] = e

    threads = [threading.Thread(target=waiter, args=(r,)) for r in (0, 2, 3)]
    for t in threads:
        t.start()
    os.kill(run.proc.pid, signal.SIGKILL)
    for t in threads:
        t.join(25)
    assert run.wait_monitor(10) == EXIT_OK, run.log()
    run.wait_rank(10)
    decisions = [got[r] for r in (0, 2, 3)]
    assert all(isinstance(d, Decision) for d in decisions), (decisions, run.log())
    assert len({d.to_json() for d in decisions}) == 1
    d = decisions[0]
    assert d.term == 1 and d.leader in (0, 2, 3) and d.terminated == [1] and d.membership.world_size == 3
    assert [(f.rank, f.kind, f.type) for f in d.faults] == [(1, "killed", "SIGKILL")]
    assert "phase RESTART_BARRIER" in d.faults[0].message
    assert p.read_seat(1) == "t3:m1"  # counted out at barrier 3 itself, by its monitor
    assert not store.check(["inprocess/0/4/arrivals"])  # nothing waits at barrier 4 for it
    assert "counted rank 1 out at barrier 3" in run.log()


@pytest.mark.timeout(60)
def test_rank_dead_before_the_initial_barrier(rank_run: Any, store: Any) -> None:
    run = rank_run(phase="INITIAL_BARRIER", world_size=0, iteration=0, initial_world_size=4)
    run.ready()
    os.kill(run.proc.pid, signal.SIGKILL)
    run.wait_rank(10)
    assert run.wait_monitor(10) == EXIT_OK, run.log()
    assert _arrivals(store, 0) == TERMINATED_UNIT
    assert store.get("inprocess/0/0/terminated") == b"1,"


@pytest.mark.timeout(30)
def test_cli_validation() -> None:
    base = ["--store-host", "h", "--store-port", "1", "--call", "0", "--rank", "0",
            "--heartbeat-fd", "3", "--pid", "1", "--store-timeout-s", "10", "--barrier-timeout-s", "10",
            "--grace-s", "1"]
    assert MonitorConfig.from_argv(base).grace_s == 1.0
    for bad in (["--store-port", "0"], ["--rank", "-1"], ["--grace-s", "x"], ["--pid", "0"]):
        proc = subprocess.run([sys.executable, "-m", "inprocess.processes.monitor", *base, *bad],
                              capture_output=True, text=True, timeout=20)
        assert proc.returncode == 2 and bad[0] in proc.stderr, (bad, proc.stderr)
    # An fd that is no heartbeat page is refused with a message.
    proc = subprocess.run([sys.executable, "-m", "inprocess.processes.monitor", *base[:-2], "--grace-s", "1"],
                          capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "heartbeat" in proc.stderr


@pytest.mark.timeout(60)
def test_monitor_heartbeats_through_the_store(rank_run: Any, store: Any) -> None:
    run = rank_run(heartbeat_interval_s=0.05)
    run.ready()
    key = monitor_heartbeat_key(0, 1)
    store.wait([key])
    first = int(store.add(key, 0))
    time.sleep(0.5)
    assert int(store.add(key, 0)) > first
    os.kill(run.proc.pid, signal.SIGKILL)
    assert run.wait_monitor(10) == EXIT_OK, run.log()
    run.wait_rank(10)
    stopped = int(store.add(key, 0))
    time.sleep(0.2)
    assert int(store.add(key, 0)) == stopped  # no heartbeat after the monitor exited


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank0_beat", [True, False], ids=["counter stands still", "counter never created"])
def test_a_silent_peer_is_counted_out_and_only_it(rank_run: Any, store: Any, rank0_beat: bool) -> None:
    """Rank 1's monitor (world 4, heartbeat_timeout 2 s) watches ranks 2, 3 and 0 in iteration 2.
    Ranks 2 and 3 beat on; rank 0's counter stands still after one beat, or never appears: its
    node was cut off before its monitor's first heartbeat reached the store. Either way rank 0 is
    counted out once heartbeat_timeout has passed, and nobody else. Before, a counter never
    created was never watched: the job waited at the restart barrier until barrier_timeout."""
    interval, timeout = 0.1, 2.0
    keys = {r: monitor_heartbeat_key(0, r) for r in (0, 2, 3)}
    RestartProtocol(store, 0).seat_table.write({0: "2"})  # rank 0 runs iteration 2, as rank 1 does
    if rank0_beat:
        store.add(keys[0], 1)
    run = rank_run(action="wait", heartbeat_interval_s=interval, heartbeat_timeout_s=timeout,
                   initial_world_size=4)

    def beat_and_read(seconds: float, until_fault: bool) -> list[Any]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            store.add(keys[2], 1)
            store.add(keys[3], 1)
            faults = _faults(store, 2)
            if faults and until_fault:
                return faults
            time.sleep(interval)
        return _faults(store, 2)

    store.add(keys[2], 1)
    store.add(keys[3], 1)
    run.ready()
    watched_from = time.monotonic()
    faults = beat_and_read(20, until_fault=True)
    took = time.monotonic() - watched_from
    assert faults, f"rank 0 was not counted out within 20 s:\n{run.log()}"
    # Not at once: its silence is timed from the monitor's first look (just before "ready").
    assert took > timeout / 2, (took, run.log())
    faults = beat_and_read(2 * timeout, until_fault=False)  # ranks 2 and 3 beat on: they stay
    assert [(f.rank, f.iteration, f.kind, f.type) for f in faults] == [(0, 2, "unresponsive", "HeartbeatTimeout")], \
        (faults, run.log())
    assert "the monitor of rank 0 sent no heartbeat" in faults[0].message, faults[0]
    assert store.get("inprocess/0/2/event") == b"restart"
    os.kill(run.proc.pid, signal.SIGKILL)
    assert run.wait_monitor(20) == EXIT_OK, run.log()


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_the_monitor_starts_does_not_end_it(rank_run: Any, store: Any) -> None:
    """A Ctrl-C reaches the rank's whole process group, its monitor too, which ignores SIGINT:
    also in the second or so before its interpreter reaches the line that says so (the rank
    starts it with SIGINT blocked). Before, a Ctrl-C then ended the monitor and left the rank
    unwatched."""
    run = rank_run(action="wait")
    mpid = run.spawned()
    sent = 0
    deadline = time.monotonic() + 30
    while not run.pidfile.exists() and os.path.exists(f"/proc/{mpid}") and time.monotonic() < deadline:
        os.kill(mpid, signal.SIGINT)  # from its first instructions to the moment it watches
        sent += 1
        time.sleep(0.005)
    assert sent > 10, f"the monitor ended after {sent} SIGINT(s) during its start:\n{run.log()}"
    assert run.proc.stdout is not None
    line = run.proc.stdout.readline().split()
    assert line == ["ready", str(mpid)], (line, run.log())
    os.kill(mpid, signal.SIGINT)  # and once it watches
    os.kill(run.proc.pid, signal.SIGKILL)
    _assert_died_in_iteration(store, run, "killed", "SIGKILL")  # it still did its work


@pytest.mark.timeout(60)
def test_a_monitor_whose_store_is_gone_exits_at_once(tmp_path: pathlib.Path) -> None:
    """The store server went away (the job is ending), then the rank died: the monitor's
    connection is refused, which means gone. It exits with EXIT_STORE at once, instead of
    retrying to connect until its store timeout (10 s here) for the count-out and again for
    its heartbeat."""
    with _monitor_of_a_store_that_goes(tmp_path, heartbeat_interval_s=0.2) as (run, server):
        time.sleep(0.5)  # a few heartbeats on its connection
        server.kill()
        server.wait(10)
        start = time.monotonic()
        os.kill(run.proc.pid, signal.SIGKILL)
        assert run.wait_monitor(20) == EXIT_STORE, run.log()
        took = time.monotonic() - start
        assert took < 3, (took, run.log())
        assert "refused" in run.log()


@pytest.mark.timeout(60)
def test_a_store_gone_while_the_rank_lives_is_one_warning_not_one_per_heartbeat(tmp_path: pathlib.Path) -> None:
    with _monitor_of_a_store_that_goes(tmp_path, heartbeat_interval_s=0.05) as (run, server):
        time.sleep(0.3)
        server.kill()
        server.wait(10)
        time.sleep(1.5)  # about 30 heartbeat intervals without a store
        os.kill(run.proc.pid, signal.SIGKILL)
        assert run.wait_monitor(20) == EXIT_STORE, run.log()
        failed = [line for line in run.log().splitlines() if "heartbeat to the store failed" in line]
        warned = [line for line in failed if " WARNING " in line]
        assert len(failed) > 3 and len(warned) == 1 and "(1 in a row" in warned[0], run.log()


@contextlib.contextmanager
def _monitor_of_a_store_that_goes(tmp_path: pathlib.Path, heartbeat_interval_s: float) -> Iterator[Any]:
    """A monitor watching rank 1 in iteration 2, its store served by a process the test may kill."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import datetime, sys, torch.distributed as d; "
         "from inprocess.control.host_names import numeric_host_names; numeric_host_names(); "
         "s = d.TCPStore('127.0.0.1', 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False); "
         "print(s.port, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    run: RankRun | None = None
    _set_subreaper(True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = torch_dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=10))
        _in_iteration(client, rank=1, iteration=2)
        del client
        run = RankRun(tmp_path, port, heartbeat_interval_s=heartbeat_interval_s)
        run.ready()
        yield run, server
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)
        try:
            if run is not None:
                run.cleanup()
        finally:
            _set_subreaper(False)
