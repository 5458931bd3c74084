"""python -m inprocess.timeline: event files in, a trace (and a PNG) out.

Unit tests write event files by hand (every time chosen, so every slice is
known); the end-to-end test runs a real 3-rank job with events on and checks
the trace against the events its ranks wrote.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import struct
import subprocess
import sys
from typing import Any

import pytest

from conftest import WORKERS, leftover_processes
from inprocess.launch import LocalJob
from inprocess.timeline import EventFileError, build, load, to_trace
from inprocess.timeline.summary import summary_lines

WALL0 = 1_800_000_000.0
MONO0 = 5_000_000_000_000
RESTART_PHASES = ["ABORTING", "FINALIZING", "HEALTH_CHECK", "RESTART_BARRIER"]
ONE_RESTART = ["INITIAL_BARRIER", "RUNNING", *RESTART_PHASES, "RUNNING", "COMPLETION", "DONE"]


class RankFile:
    """Writes one rank's events; times in ms on this writer's host clock."""

    def __init__(self, directory: pathlib.Path, rank: int, host: str = "h1", mono0: int = MONO0,
                 wall0: float = WALL0, wall_jitter_ms: float = 0.0):
        self.path = directory / f"rank{rank}.jsonl"
        self.rank, self.host, self.mono0, self.wall0 = rank, host, mono0, wall0
        self.jitter = wall_jitter_ms
        self.call = 0
        self.n = 0

    def t_ns(self, ms: float) -> int:
        return self.mono0 + round(ms * 1e6)

    def emit(self, ms: float, kind: str, **fields: Any) -> None:
        self.n += 1
        # The wall clock is read apart from the monotonic one: it jitters.
        jitter = self.jitter * (1 if self.n % 2 else -1) / 1e3
        record = {"t_ns": self.t_ns(ms), "wall": self.wall0 + ms / 1e3 + jitter, "rank": self.rank,
                  "call": self.call, "kind": kind, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def raw(self, text: str) -> None:
        with open(self.path, "a") as f:
            f.write(text)

    def start(self, ms: float, call: int = 0, pid: int = 100, world_size: int = 2) -> None:
        self.call = call
        self.emit(ms, "call_start", world_size=world_size, host=self.host, pid=pid)

    def phase(self, ms: float, name: str, iteration: int) -> None:
        self.emit(ms, "phase", phase=name, iteration=iteration)

    def iteration(self, ms: float, iteration: int, mode: str = "ACTIVE", world_size: int = 2) -> None:
        self.emit(ms, "iteration_start", iteration=iteration, mode=mode, job_rank=self.rank,
                  active_rank=self.rank if mode == "ACTIVE" else None, world_size=world_size,
                  active_world_size=world_size)

    def decision(self, ms: float, iteration: int, faults: list[dict[str, Any]] | None = None,
                 terminated: list[int] | None = None, world_size: int = 2) -> None:
        faults = faults or []
        self.emit(ms, "decision", iteration=iteration, world_size=world_size, active_world_size=world_size,
                  terminated=terminated or [], leader=0, n_faults=len(faults), faults=faults)

    def restart(self, ms: float, iteration: int, detected_ms: float, aborted_ms: float) -> None:
        """The wrapper's order: ABORTING, then the trigger's two events dated earlier, then the rest."""
        self.phase(ms, "ABORTING", iteration)
        self.emit(detected_ms, "restart_detected", iteration=iteration)
        self.emit(aborted_ms, "abort_done", iteration=iteration)
        self.phase(ms + 1, "FINALIZING", iteration)
        self.phase(ms + 2, "HEALTH_CHECK", iteration)
        self.phase(ms + 3, "RESTART_BARRIER", iteration)

    def done(self, ms: float, iteration: int) -> None:
        self.phase(ms, "COMPLETION", iteration)
        self.phase(ms + 1, "DONE", iteration)
        self.emit(ms + 1.5, "exit", outcome="completed", reason=None, iteration=iteration)


FAULT = {"rank": 1, "kind": "exception", "type": "RuntimeError", "message": "boom"}


def one_restart_job(directory: pathlib.Path, ranks: int = 2, message: str = "boom", **kwargs: Any) -> list[RankFile]:
    """Rank 1 raises at 100 ms; each rank r resumes at 112 + r ms; all done at 200 ms."""
    files = [RankFile(directory, r, **kwargs) for r in range(ranks)]
    fault = {**FAULT, "message": message}
    for r, f in enumerate(files):
        f.start(0, world_size=ranks)
        f.phase(0.5, "INITIAL_BARRIER", 0)
        f.decision(10, 0, world_size=ranks)
        f.iteration(10.2, 0, world_size=ranks)
        f.phase(11, "RUNNING", 0)
        if r == 1:
            f.emit(100, "fault", iteration=0, fault="exception", type="RuntimeError", message=message)
        f.restart(102, 0, detected_ms=101 + r * 0.1, aborted_ms=101.5 + r * 0.1)
        f.decision(110, 1, faults=[fault], world_size=ranks)
        f.iteration(111, 1, world_size=ranks)
        f.phase(112 + r, "RUNNING", 1)
        f.done(200, 1)
    return files


def trace_of(directory: pathlib.Path) -> dict[str, Any]:
    return to_trace(build(load(str(directory))))


def slices(trace: dict[str, Any], rank: int, cat: str = "phase") -> list[dict[str, Any]]:
    found = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank + 1 and e["cat"] == cat]
    return sorted(found, key=lambda e: e["ts"])


def instants(trace: dict[str, Any], cat: str) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "i" and e["cat"] == cat]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inprocess.timeline", *args], capture_output=True, text=True,
                          timeout=60, env=env)


# -- slices, instants, tracks --------------------------------------------------------------


def test_a_slice_per_phase_from_its_event_to_the_next(tmp_path: pathlib.Path) -> None:
    one_restart_job(tmp_path)
    trace = trace_of(tmp_path)
    for rank in (0, 1):
        got = slices(trace, rank)
        assert [s["name"] for s in got] == ONE_RESTART
        starts = [0.5, 11, 102, 103, 104, 105, 112 + rank, 200, 201]
        ends = starts[1:] + [201.5]  # DONE lasts until the exit event
        assert [s["ts"] for s in got] == pytest.approx([ms * 1000 for ms in starts])
        assert [s["dur"] for s in got] == pytest.approx([(e - s) * 1000 for s, e in zip(starts, ends, strict=True)])
        assert [s["args"]["iteration"] for s in got] == [0, 0, 0, 0, 0, 0, 1, 1, 1]
        assert got[1]["args"]["mode"] == "ACTIVE" and got[1]["args"]["active_world_size"] == 2


def test_timestamps_are_microseconds_since_the_earliest_event(tmp_path: pathlib.Path) -> None:
    one_restart_job(tmp_path)
    trace = trace_of(tmp_path)
    stamps = [e["ts"] for e in trace["traceEvents"] if "ts" in e]
    assert min(stamps) == 0  # the first call_start
    assert max(e["ts"] + e.get("dur", 0) for e in trace["traceEvents"] if "ts" in e) == pytest.approx(201_500)


def test_the_abort_is_a_slice_on_the_trigger_thread(tmp_path: pathlib.Path) -> None:
    one_restart_job(tmp_path)
    trace = trace_of(tmp_path)
    for rank in (0, 1):
        (abort,) = slices(trace, rank, cat="abort")
        assert abort["ts"] == pytest.approx((101 + rank * 0.1) * 1000)
        assert abort["dur"] == pytest.approx(500)
        main_tid = slices(trace, rank)[0]["tid"]
        assert abort["tid"] != main_tid
        marks = {e["name"]: e for e in instants(trace, "restart") if e["pid"] == rank + 1}
        assert set(marks) == {"restart_detected", "abort_done"}
        assert all(m["tid"] == abort["tid"] and m["s"] == "t" for m in marks.values())


def test_tracks_are_named_and_unique_per_rank(tmp_path: pathlib.Path) -> None:
    one_restart_job(tmp_path, ranks=3)
    events = trace_of(tmp_path)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {1: "rank 0 (h1, pid 100)", 2: "rank 1 (h1, pid 100)", 3: "rank 2 (h1, pid 100)"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(threads) == 6 and len({tid for _, tid in threads}) == 6  # tids unique across the trace
    assert sorted(set(threads.values())) == ["abort (trigger thread)", "phases (main thread)"]
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in "Xi"}
    assert used <= set(threads)


def test_fault_and_decision_instants(tmp_path: pathlib.Path) -> None:
    one_restart_job(tmp_path)
    trace = trace_of(tmp_path)
    (fault,) = instants(trace, "fault")
    assert fault["pid"] == 2 and fault["ts"] == pytest.approx(100_000)
    assert fault["name"] == "fault: exception RuntimeError"
    assert fault["args"]["message"] == "boom"
    decisions = instants(trace, "decision")
    assert sorted((d["pid"], d["args"]["iteration"]) for d in decisions) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(d["args"]["faults"] == ([FAULT] if d["args"]["iteration"] else []) for d in decisions)
    exits = instants(trace, "exit")
    assert [e["name"] for e in exits] == ["exit: completed"] * 2


def test_events_written_out_of_clock_order_are_ordered(tmp_path: pathlib.Path) -> None:
    """restart_detected and abort_done come after ABORTING in the file, dated earlier."""
    one_restart_job(tmp_path)
    timeline = build(load(str(tmp_path)))
    main = [s for s in timeline.slices if s.rank == 0 and s.track == "main"]
    assert all(a.end_ns == b.start_ns for a, b in zip(main, main[1:], strict=False))
    stamps = [i.t_ns for i in timeline.instants]
    assert stamps == sorted(stamps)


# -- clocks ----------------------------------------------------------------------------------


def test_one_host_is_timed_by_its_monotonic_clock_not_by_wall(tmp_path: pathlib.Path) -> None:
    """Wall readings that jitter by ±0.3 ms change no duration within a host."""
    one_restart_job(tmp_path, wall_jitter_ms=0.3)
    trace = trace_of(tmp_path)
    got = slices(trace, 1)
    assert [s["dur"] for s in got[:3]] == pytest.approx([10_500, 91_000, 1_000], abs=1e-3)
    assert trace["otherData"]["clock"] == "one host: CLOCK_MONOTONIC"


def test_hosts_with_unrelated_monotonic_clocks_are_aligned_by_wall(tmp_path: pathlib.Path) -> None:
    a = RankFile(tmp_path, 0, host="a", mono0=MONO0)
    b = RankFile(tmp_path, 1, host="b", mono0=17, wall0=WALL0 + 0.002)  # b booted long after a; started 2 ms later
    for f in (a, b):
        f.start(0)
        f.phase(1, "INITIAL_BARRIER", 0)
        f.phase(5, "RUNNING", 0)
        f.done(9, 0)
    trace = trace_of(tmp_path)
    assert slices(trace, 0)[1]["ts"] == pytest.approx(5_000)
    # 2 ms later, by wall: to the µs (a float time.time() resolves about 0.2 µs today)
    assert slices(trace, 1)[1]["ts"] == pytest.approx(7_000, abs=1)
    assert slices(trace, 1)[1]["dur"] == pytest.approx(4_000)
    assert "2 hosts" in trace["otherData"]["clock"] and trace["otherData"]["hosts"] == ["a", "b"]


# -- damaged and mixed input -----------------------------------------------------------------


def killed_rank_job(directory: pathlib.Path) -> None:
    """Rank 0 is SIGKILLed in iteration 0 mid-write; rank 1 restarts without it."""
    r0, r1 = RankFile(directory, 0), RankFile(directory, 1)
    for f in (r0, r1):
        f.start(0)
        f.phase(1, "INITIAL_BARRIER", 0)
        f.decision(2, 0)
        f.iteration(2.5, 0)
        f.phase(3, "RUNNING", 0)
    r0.raw('{"t_ns":5000050000000,"wall":1800000000.05,"ra')  # cut by the kill
    killed = {"rank": 0, "kind": "killed", "type": "SIGKILL", "message": "rank process 100 died"}
    r1.emit(60, "fault", iteration=0, fault="after_restart", type="RuntimeError", message="connection closed")
    r1.restart(62, 0, detected_ms=58, aborted_ms=59)
    r1.decision(70, 1, faults=[killed, {**FAULT, "kind": "after_restart"}], terminated=[0], world_size=1)
    r1.iteration(71, 1, world_size=1)
    r1.phase(72, "RUNNING", 1)
    r1.done(90, 1)


def test_a_killed_rank_cut_mid_line(tmp_path: pathlib.Path) -> None:
    killed_rank_job(tmp_path)
    loaded = load(str(tmp_path))
    assert loaded.warnings == [f"{tmp_path / 'rank0.jsonl'}:6: incomplete last line skipped "
                               "(its writer was killed while writing it?)"]
    trace = to_trace(build(loaded))
    running = slices(trace, 0)[-1]
    # It ran until the survivor's trigger learnt of the restart (58 ms): inferred, and said so.
    assert running["name"] == "RUNNING" and running["ts"] == pytest.approx(3_000)
    assert running["dur"] == pytest.approx(55_000)
    assert running["args"]["end"] == "inferred"
    faults = {(e["pid"], e["args"]["fault"]): e for e in instants(trace, "fault")}
    assert set(faults) == {(1, "killed"), (2, "after_restart")}
    assert faults[(1, "killed")]["ts"] == pytest.approx(58_000)
    assert "not recorded" in faults[(1, "killed")]["args"]["time"]


def test_a_dated_fault_in_a_decision_is_placed_at_its_time(tmp_path: pathlib.Path) -> None:
    """Should decisions carry each fault's t_ns and host, the death is drawn when its monitor saw it."""
    killed_rank_job(tmp_path)
    lines = (tmp_path / "rank1.jsonl").read_text().splitlines()
    for k, line in enumerate(lines):
        record = json.loads(line)
        if record["kind"] == "decision" and record["iteration"] == 1:
            record["faults"][0].update(t_ns=MONO0 + 40_000_000, host="h1")
            lines[k] = json.dumps(record)
    (tmp_path / "rank1.jsonl").write_text("\n".join(lines) + "\n")
    (fault,) = [e for e in instants(trace_of(tmp_path), "fault") if e["args"]["fault"] == "killed"]
    assert fault["ts"] == pytest.approx(40_000) and "time" not in fault["args"]


def test_the_summary_names_the_death_first(tmp_path: pathlib.Path) -> None:
    killed_rank_job(tmp_path)
    loaded = load(str(tmp_path))
    text = "\n".join(summary_lines(build(loaded), str(tmp_path), loaded.n_events))
    assert "restart 1 (iteration 0 failed): rank 0 killed SIGKILL: rank process 100 died\n" in text
    assert "secondary errors (raised once the restart was under way) on rank(s) 1; excluded: rank(s) 0" in text
    # from rank 1's detection (58 ms) to its RUNNING (72 ms)
    assert "14.0 ms from the first fault (restart detected on rank 1) to the last rank's next RUNNING" in text


def test_the_summary_keeps_the_words_of_a_long_message(tmp_path: pathlib.Path) -> None:
    message = "[/src/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5036. " + "x" * 100
    one_restart_job(tmp_path, message=message)
    loaded = load(str(tmp_path))
    line = summary_lines(build(loaded), str(tmp_path), loaded.n_events)[1]
    words = message.split("] ", 1)[1]  # the source location goes; the message is cut at 70 characters
    assert line == f"restart 1 (iteration 0 failed): rank 1 exception RuntimeError: {words[:67]}..."


def test_the_slowest_phase_is_the_one_that_held_the_others_back(tmp_path: pathlib.Path) -> None:
    """Rank 0's main thread stays blocked in the function 5 s after its restart was
    detected (a gloo send that only its timeout ends): rank 1 waits all that time in
    the barrier, but the phase to blame is rank 0's."""
    r0, r1 = RankFile(tmp_path, 0), RankFile(tmp_path, 1)
    for f in (r0, r1):
        f.start(0)
        f.phase(1, "INITIAL_BARRIER", 0)
        f.phase(3, "RUNNING", 0)
    r1.emit(100, "fault", iteration=0, fault="exception", type="RuntimeError", message="boom")
    r1.restart(102, 0, detected_ms=101, aborted_ms=101.5)
    r0.restart(5102, 0, detected_ms=101, aborted_ms=101.5)
    for f in (r0, r1):
        f.decision(5110, 1, faults=[FAULT])
        f.phase(5111, "RUNNING", 1)
    (restart,) = build(load(str(tmp_path))).restarts
    assert restart.slowest is not None
    assert (restart.slowest.rank, restart.slowest.name, restart.slowest.dur_ns) == (
        0, "RUNNING after the restart was detected", 5_001_000_000)
    assert restart.recovery_ns == 5_011_000_000


def test_a_malformed_line_is_named_by_file_and_line(tmp_path: pathlib.Path) -> None:
    one_restart_job(tmp_path)
    path = tmp_path / "rank1.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(2, "not json at all\n")
    lines.insert(5, json.dumps({"t_ns": "soon", "wall": 1.0, "rank": 1, "call": 0, "kind": "phase"}) + "\n")
    lines.insert(7, json.dumps({"t_ns": 1, "wall": 1.0, "rank": 1, "call": 0, "kind": "phase"}) + "\n")
    path.write_text("".join(lines))
    loaded = load(str(tmp_path))
    assert loaded.warnings[0].startswith(f"{path}:3: line skipped: not JSON")
    assert loaded.warnings[1] == f"{path}:6: line skipped: field 't_ns' is 'soon'; expected an int"
    assert loaded.warnings[2] == f"{path}:8: line skipped: no 'phase' field"
    assert [s["name"] for s in slices(to_trace(build(loaded)), 1)] == ONE_RESTART  # the rest is whole
    with pytest.raises(EventFileError) as err:
        load(str(tmp_path), strict=True)
    assert (err.value.path, err.value.line) == (str(path), 3)
    cli = run_cli(str(tmp_path), "--strict")
    assert cli.returncode == 1 and f"{path}:3: not JSON" in cli.stderr, cli.stderr


def test_several_calls_and_a_relaunched_process_in_one_file(tmp_path: pathlib.Path) -> None:
    """Call 0 restarts, call 1 runs clean in the same process; then the launcher
    starts the process again, and its call 0 appends to the same files."""
    files = [RankFile(tmp_path, r) for r in (0, 1)]
    one_restart_job(tmp_path)
    for f in files:
        f.start(300, call=1)
        f.phase(301, "INITIAL_BARRIER", 0)
        f.phase(305, "RUNNING", 0)
        f.done(320, 0)
        f.start(1000, call=0, pid=200)  # the relaunched process
        f.phase(1001, "INITIAL_BARRIER", 0)
        f.phase(1005, "RUNNING", 0)
    files[1].emit(1010, "fault", iteration=0, fault="exception", type="ValueError", message="again")
    for f in files:
        f.restart(1012, 0, detected_ms=1011, aborted_ms=1011.5)
        f.decision(1020, 1, faults=[{**FAULT, "type": "ValueError", "message": "again"}])
        f.phase(1021, "RUNNING", 1)
        f.done(1030, 1)
    loaded = load(str(tmp_path))
    assert loaded.warnings == []
    assert [(run.call, run.ordinal) for run in loaded.runs] == [(0, 0), (1, 0), (0, 1)]
    timeline = build(loaded)
    assert [(r.call, r.attempt, r.iteration, r.causes[0]["type"]) for r in timeline.restarts] == [
        (0, 0, 0, "RuntimeError"), (0, 1, 0, "ValueError")]
    assert timeline.restarts[1].recovery_ns == 11_000_000  # the fault at 1010 ms -> RUNNING at 1021 ms
    # Iteration 0 happens in every run: the run tells them apart (the PNG zooms into one run's).
    assert [r.run for r in timeline.restarts] == [0, 2]
    assert sorted({(s.run, s.iteration) for s in timeline.slices if s.name == "ABORTING"}) == [(0, 0), (2, 0)]
    names = [s["name"] for s in slices(to_trace(timeline), 0)]
    assert names == [*ONE_RESTART, "INITIAL_BARRIER", "RUNNING", "COMPLETION", "DONE", *ONE_RESTART]
    assert timeline.ranks[0].pids == [100, 200]


def test_a_spare_waiting_gets_a_slice(tmp_path: pathlib.Path) -> None:
    """A spare emits no phase when its iteration starts: the timeline adds a SPARE slice."""
    f = RankFile(tmp_path, 0)
    f.start(0, world_size=1)
    f.phase(1, "INITIAL_BARRIER", 0)
    f.decision(2, 0, world_size=1)
    f.iteration(3, 0, mode="INACTIVE", world_size=1)
    f.done(50, 0)
    got = slices(trace_of(tmp_path), 0)
    assert [(s["name"], s["ts"], s["dur"]) for s in got[:2]] == [("INITIAL_BARRIER", 1000, 2000),
                                                                 ("SPARE", 3000, 47_000)]


def test_lines_before_any_call_start_are_kept_with_a_warning(tmp_path: pathlib.Path) -> None:
    f = RankFile(tmp_path, 0)
    f.phase(1, "INITIAL_BARRIER", 0)
    f.phase(2, "RUNNING", 0)
    loaded = load(str(tmp_path))
    assert loaded.warnings[0].startswith(f"{tmp_path / 'rank0.jsonl'}:1: call 0 has no call_start")
    assert [s["name"] for s in slices(to_trace(build(loaded)), 0)] == ["INITIAL_BARRIER", "RUNNING"]


def test_cli_refuses_a_directory_without_events(tmp_path: pathlib.Path) -> None:
    missing = run_cli(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    empty = run_cli(str(tmp_path))
    assert empty.returncode == 2 and "holds no rank<N>.jsonl file" in empty.stderr
    (tmp_path / "rank0.jsonl").write_text("")
    blank = run_cli(str(tmp_path))
    assert blank.returncode == 2 and "no event in 1 file(s)" in blank.stderr


def test_cli_writes_the_trace_and_prints_the_summary(tmp_path: pathlib.Path) -> None:
    (tmp_path / "ev").mkdir()
    one_restart_job(tmp_path / "ev")
    out = run_cli(str(tmp_path / "ev"), "--out", str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "restart 1 (iteration 0 failed): rank 1 exception RuntimeError: boom"
    # from rank 1's fault (100 ms) to rank 1's RUNNING (113 ms); RESTART_BARRIER of rank 1 lasted 113 - 105 ms
    assert lines[2] == "  13.0 ms from the first fault (rank 1 exception RuntimeError) to the last rank's next RUNNING"
    # Both arrive at the barrier at 105 ms: rank 1 has the higher number, and waits 8 ms there.
    assert lines[3] == "  slowest phase: RESTART_BARRIER on rank 1 (the last at the barrier), 8.0 ms"
    trace = json.loads((tmp_path / "t.trace.json").read_text())
    assert [s["name"] for s in slices(trace, 0)] == ONE_RESTART


def test_png_without_matplotlib_says_how_to_install_it(tmp_path: pathlib.Path) -> None:
    one_restart_job(tmp_path)
    blocker = tmp_path / "no_mpl" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named matplotlib (test)')\n")
    env = {"PYTHONPATH": str(blocker.parent), "PATH": "/usr/bin:/bin"}
    out = run_cli(str(tmp_path), "--png", env=env)
    assert out.returncode == 2, out.stderr
    assert 'pip install "inprocess[timeline]"' in out.stderr
    assert not (tmp_path / "timeline.trace.json").exists()  # refused before doing anything


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the optional 'timeline' extra)")
def test_png(tmp_path: pathlib.Path) -> None:
    killed_rank_job(tmp_path)
    out = run_cli(str(tmp_path), "--png")
    assert out.returncode == 0, out.stderr
    data = (tmp_path / "timeline.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert 800 <= width <= 2000 and 300 <= height <= 2000, (width, height)
    assert 10_000 < len(data) < 500_000


# -- end to end ------------------------------------------------------------------------------


def read_events(directory: pathlib.Path, rank: int) -> list[dict[str, Any]]:
    lines = (directory / f"rank{rank}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda e: e["t_ns"])


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_real_job_s_trace_matches_its_events(tmp_path: pathlib.Path) -> None:
    events_dir = tmp_path / "events"
    with LocalJob([str(WORKERS / "timeline_worker.py"), str(events_dir), "1"], 3) as job:
        ranks = job.wait(timeout=120)
        assert not leftover_processes({r.popen.pid for r in ranks}, grace=10.0)
    assert [r.returncode for r in ranks] == [0, 0, 0], job.outputs()[-8000:]
    assert all("finished iteration 1" in r.output for r in ranks), job.outputs()[-8000:]

    out = run_cli(str(events_dir), "--out", str(tmp_path / "job"))
    assert out.returncode == 0, out.stderr
    assert "restart 1 (iteration 0 failed): rank 1 exception RuntimeError: timeline test fault" in out.stdout
    trace = json.loads((tmp_path / "job.trace.json").read_text())

    for rank in range(3):
        events = read_events(events_dir, rank)
        phases = [e for e in events if e["kind"] == "phase"]
        got = slices(trace, rank)
        assert [s["name"] for s in got] == ONE_RESTART, [s["name"] for s in got]
        assert [s["name"] for s in got] == [p["phase"] for p in phases]
        # Each slice lasts from its phase event to the next (DONE: to the exit event), to the ns.
        ends = [p["t_ns"] for p in phases[1:]] + [events[-1]["t_ns"]]
        for s, p, end in zip(got, phases, ends, strict=True):
            assert abs(s["dur"] * 1000 - (end - p["t_ns"])) <= 1, (s, p, end)
        for a, b, pa, pb in zip(got, got[1:], phases, phases[1:], strict=False):
            assert abs((b["ts"] - a["ts"]) * 1000 - (pb["t_ns"] - pa["t_ns"])) <= 1
        (abort,) = slices(trace, rank, cat="abort")
        detected = next(e for e in events if e["kind"] == "restart_detected")
        aborted = next(e for e in events if e["kind"] == "abort_done")
        assert abs(abort["dur"] * 1000 - (aborted["t_ns"] - detected["t_ns"])) <= 1
    # One host: every rank on the same clock, so one rank's events place another's.
    first = min(e["t_ns"] for r in range(3) for e in read_events(events_dir, r))
    fault_event = next(e for e in read_events(events_dir, 1) if e["kind"] == "fault")
    first_hand = [e for e in instants(trace, "fault") if e["args"]["fault"] == "exception"]
    assert [e["pid"] for e in first_hand] == [2]  # rank 1, and only rank 1
    assert abs(first_hand[0]["ts"] * 1000 - (fault_event["t_ns"] - first)) <= 1


# -- one rule for causes: the summary and the PNG ---------------------------------------------


def death_after_its_consequence_job(directory: pathlib.Path) -> None:
    """Rank 0 is SIGKILLed; rank 1's broken connection is recorded first-hand at 50 ms, rank 2's
    error after the restart began, and rank 0's monitor records the death at 57 ms."""
    files = [RankFile(directory, r) for r in range(3)]
    for f in files:
        f.start(0, world_size=3)
        f.phase(1, "INITIAL_BARRIER", 0)
        f.decision(2, 0, world_size=3)
        f.iteration(2.5, 0, world_size=3)
        f.phase(3, "RUNNING", 0)
    closed = "[/src/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5036"
    files[1].emit(50, "fault", iteration=0, fault="exception", type="RuntimeError", message=closed)
    files[2].emit(52, "fault", iteration=0, fault="after_restart", type="ValueError", message="interrupted")
    killed = {"rank": 0, "kind": "killed", "type": "SIGKILL", "message": "rank process 100 died",
              "t_ns": MONO0 + 57_000_000, "host": "h1"}
    decided = [{"rank": 1, "kind": "exception", "type": "RuntimeError", "message": closed},
               {"rank": 2, "kind": "after_restart", "type": "ValueError", "message": "interrupted"}, killed]
    for r, f in enumerate(files[1:], start=1):
        f.restart(53, 0, detected_ms=51 + r * 0.1, aborted_ms=52 + r * 0.1)
        f.decision(60, 1, faults=decided, terminated=[0], world_size=2)
        f.iteration(61, 1, world_size=2)
        f.phase(62, "RUNNING", 1)
        f.done(90, 1)


def test_the_timeline_and_the_summary_name_the_same_causes(tmp_path: pathlib.Path) -> None:
    from inprocess.engine.restart_record import RestartRecord
    from inprocess.timeline.model import drawn_as_consequence

    death_after_its_consequence_job(tmp_path)
    loaded = load(str(tmp_path))
    timeline = build(loaded)
    (restart,) = timeline.restarts
    # The rule of the restart record, on the same faults:
    record = RestartRecord(0, [_record(f) for f in restart.causes + restart.secondary], 3, [0])
    assert [(f.rank, f.kind) for f in record.causes] == [(0, "killed")]
    assert [(f["rank"], f["kind"]) for f in restart.causes] == [(0, "killed")]
    # What the PNG draws as a cause (red, labelled) is what the summary names, and nothing else.
    drawn = {(i.rank, i.args["fault"]) for i in timeline.instants
             if i.category == "fault" and not drawn_as_consequence(i)}
    assert drawn == {(0, "killed")}
    roles = {(i.rank, i.args["fault"]): i.args["role"] for i in timeline.instants if i.category == "fault"}
    assert roles == {(0, "killed"): "cause", (1, "exception"): "consequence", (2, "after_restart"): "consequence"}
    # Measured from the cause, with the consequence seen 7 ms before its record said so.
    assert restart.first_fault_ns == pytest.approx(57_000_000)
    assert restart.earlier_sign_ns == pytest.approx(50_000_000)
    text = "\n".join(summary_lines(timeline, str(tmp_path), loaded.n_events))
    assert "restart 1 (iteration 0 failed): rank 0 killed SIGKILL: rank process 100 died\n" in text
    assert "5.0 ms from the first fault (rank 0 killed SIGKILL) to the last rank's next RUNNING" in text
    assert "fault on rank 1 was seen 7.0 ms before that fault was recorded" in text
    trace = to_trace(timeline)
    assert {(e["pid"] - 1, e["args"]["role"]) for e in instants(trace, "fault")} == {
        (0, "cause"), (1, "consequence"), (2, "consequence")}


def _record(fault: dict[str, Any]) -> Any:
    from inprocess.control.protocol import FaultRecord

    return FaultRecord(fault["rank"], 0, fault["kind"], fault["type"], fault["message"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the optional 'timeline' extra)")
def test_the_png_labels_the_causes_only_and_zooms_from_the_first(tmp_path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    from inprocess.timeline import plot

    death_after_its_consequence_job(tmp_path)
    timeline = build(load(str(tmp_path)))
    fig, ax = plt.subplots()
    row = {rank: k for k, rank in enumerate(timeline.ranks)}
    plot._draw_zoom(ax, timeline, row, timeline.restarts[0], 1)
    labels = [t.get_text() for t in ax.texts]
    plt.close(fig)
    assert labels == ["killed SIGKILL"]
    assert "rank 0: killed SIGKILL" in ax.get_title(loc="left")
    assert ax.get_xlabel() == "ms from its first cause"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the optional 'timeline' extra)")
def test_the_png_says_when_restarts_are_not_zoomed(tmp_path: pathlib.Path) -> None:
    from inprocess.timeline import plot

    files = [RankFile(tmp_path, r) for r in range(2)]
    restarts = plot.MAX_ZOOMS + 2
    for r, f in enumerate(files):
        f.start(0)
        f.phase(1, "INITIAL_BARRIER", 0)
        f.decision(2, 0)
        for i in range(restarts):
            base = 10 + 100 * i
            f.iteration(base, i)
            f.phase(base + 1, "RUNNING", i)
            if r == 1:
                f.emit(base + 50, "fault", iteration=i, fault="exception", type="RuntimeError", message="boom")
            f.restart(base + 52, i, detected_ms=base + 51, aborted_ms=base + 51.5)
            f.decision(base + 60, i + 1, faults=[FAULT])
        f.iteration(10 + 100 * restarts, restarts)
        f.phase(11 + 100 * restarts, "RUNNING", restarts)
        f.done(20 + 100 * restarts, restarts)
    texts: list[str] = []
    original = plot.plt.Figure.text

    def record_text(self: Any, x: float, y: float, s: str, *args: Any, **kwargs: Any) -> Any:
        texts.append(s)
        return original(self, x, y, s, *args, **kwargs)

    plot.plt.Figure.text = record_text  # type: ignore[method-assign]
    try:
        plot.draw(build(load(str(tmp_path))), str(tmp_path / "t.png"))
    finally:
        plot.plt.Figure.text = original  # type: ignore[method-assign]
    assert any(f"restarts 1 to {plot.MAX_ZOOMS} only, of {restarts}" in t for t in texts), texts
