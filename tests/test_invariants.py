"""The invariant checker (inprocess/chaos/invariants.py): a clean job's events pass, and each invariant
finds its violation in a log made to break it (and only that one)."""

from __future__ import annotations

import copy
import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from inprocess.chaos import invariants
from inprocess.chaos.invariants import Observations
from inprocess.timeline.reading import Event, Segment

S = 1_000_000_000
TIMEOUTS = {"soft_timeout": 2.0, "hard_timeout": 4.0, "termination_grace_time": 1.0, "heartbeat_timeout": 5.0,
            "barrier_timeout": 15.0}


def event(rank: int, kind: str, t_s: float, **fields: Any) -> Event:
    record = {"t_ns": int(t_s * S), "wall": 1000.0 + t_s, "rank": rank, "call": 0, "kind": kind, **fields}
    return Event(kind, record["t_ns"], record["wall"], rank, 0, record, f"rank{rank}.jsonl:{t_s}")


def decision(rank: int, t_s: float, barrier: int, digest: str, world_size: int = 2, active: int = 2,
             terminated: list[int] | None = None, joined: list[list[int]] | None = None, life: int = 0,
             ends_job: str | None = None) -> Event:
    return event(rank, "decision", t_s, iteration=barrier, world_size=world_size, active_world_size=active,
                 terminated=terminated or [], leader=0, digest=digest, joined_lives=joined or [], life=life,
                 ends_job=ends_job, backoff_s=0.0)


def start(rank: int, t_s: float, iteration: int, active_rank: int | None, world_size: int = 2,
          active: int = 2) -> Event:
    return event(rank, "iteration_start", t_s, iteration=iteration, mode="ACTIVE" if active_rank is not None
                 else "INACTIVE", job_rank=rank, active_rank=active_rank, world_size=world_size,
                 active_world_size=active)


def clean_job() -> list[list[Event]]:
    """Two ranks; rank 1 raises in iteration 0; both restart and finish iteration 1."""
    ranks = []
    for r in (0, 1):
        events = [event(r, "call_start", 0.0, world_size=2, host="h", pid=100 + r, timeouts=TIMEOUTS),
                  decision(r, 0.1, 0, "d0"), start(r, 0.2, 0, r)]
        if r == 1:
            events.append(event(r, "fault", 1.0, iteration=0, fault="exception", type="RuntimeError", message="x"))
        events += [event(r, "restart_detected", 1.01, iteration=0), decision(r, 1.05, 1, "d1"), start(r, 1.06, 1, r),
                   event(r, "exit", 2.0, outcome="completed", reason=None, iteration=1)]
        ranks.append(events)
    return ranks


def at(events: list[Event], kind: str, iteration: int) -> int:
    """The index of the first ``kind`` event of ``iteration`` in ``events``."""
    return next(i for i, e in enumerate(events) if e.kind == kind and e.fields.get("iteration") == iteration)


def segments(ranks: list[list[Event]]) -> list[Segment]:
    return [Segment(events[0].rank, 0, 0, "h", 100 + i, sorted(events, key=lambda e: e.t_ns))
            for i, events in enumerate(ranks)]


def found(ranks: list[list[Event]], observations: Observations | None = None) -> dict[str, list[str]]:
    findings = invariants.check(segments(ranks), observations)
    return {f.invariant: [str(v) for v in f.violations] for f in findings if f.violations}


def test_a_clean_job_passes_every_invariant_and_each_checked_something():
    findings = invariants.check(segments(clean_job()), Observations(fds={"r0": [10, 11, 11, 10]},
                                                                    store_keys=[(2, ["inprocess/0/1/event"])]))
    assert invariants.violations(findings) == []
    joins = ("joiner_admitted_once",)  # no process joined: nothing to check
    assert all(f.checked > 0 for f in findings if f.invariant not in joins), [(f.invariant, f.checked)
                                                                               for f in findings]


def test_two_decisions_of_one_barrier():
    job = clean_job()
    job[1][at(job[1], "decision", 1)] = decision(1, 1.05, 1, "another")
    assert list(found(job)) == ["one_decision"]


def test_an_iteration_started_without_its_decision():
    job = clean_job()
    del job[1][at(job[1], "decision", 1)]  # rank 1 never read barrier 1's decision, yet started iteration 1
    got = found(job)
    assert "went_on_by_decision" in got and "rank 1" in got["went_on_by_decision"][0]


def test_an_iteration_started_with_another_world_size_than_its_decision():
    job = clean_job()
    job[0][at(job[0], "iteration_start", 1)] = start(0, 1.06, 1, 0, world_size=3, active=3)
    assert "went_on_by_decision" in found(job)


def test_two_ranks_with_one_active_rank():
    job = clean_job()
    job[1][at(job[1], "iteration_start", 1)] = start(1, 1.06, 1, 0)
    assert list(found(job)) == ["one_rank_each"]


def joined_job(second_life: int, old_leaves_at: float) -> list[list[Event]]:
    """Rank 1's process dies in iteration 0; a new process joins its seat at barrier 1 (life 1)."""
    job = clean_job()
    old = [e for e in job[1] if e.t_ns < 1.0 * S]
    old[-1:] = [start(1, 0.2, 0, 1), event(1, "fault", old_leaves_at, iteration=0, fault="exception", type="E",
                                           message="x")]
    new = [event(1, "call_start", 1.02, world_size=2, host="h", pid=201, timeouts=TIMEOUTS),
           decision(1, 1.05, 1, "d1", joined=[[1, second_life]], life=second_life), start(1, 1.06, 1, 1),
           event(1, "exit", 2.0, outcome="completed", reason=None, iteration=1)]
    # Barrier 1 counts the old process out (it died) and admits the new one into its seat.
    job[0][at(job[0], "decision", 1)] = decision(0, 1.05, 1, "d1", terminated=[1], joined=[[1, second_life]])
    new[1] = decision(1, 1.05, 1, "d1", terminated=[1], joined=[[1, second_life]], life=second_life)
    return [job[0], old, new]


def test_a_joiner_in_the_life_of_the_process_it_replaces():
    got = found(joined_job(second_life=0, old_leaves_at=0.9))
    assert "one_process_per_life" in got and "both held life 0" in got["one_process_per_life"][0]


def test_a_joiner_admitted_while_the_previous_process_still_takes_part():
    job = joined_job(second_life=1, old_leaves_at=0.9)
    job[1] += [decision(1, 1.05, 1, "d1x"), start(1, 1.2, 1, 1)]  # the old process read a barrier 1 that kept it
    job[1].sort(key=lambda e: e.t_ns)
    got = found(job)
    assert "one_process_per_life" in got and "still took part" in got["one_process_per_life"][0]


def test_a_clean_join_passes():
    findings = invariants.check(segments(joined_job(second_life=1, old_leaves_at=0.9)))
    assert invariants.violations(findings) == []
    checked = {f.invariant: f.checked for f in findings}
    assert checked["joiner_admitted_once"] == 1 and checked["one_process_per_life"] == 3


def test_a_seat_and_life_admitted_at_two_barriers():
    job = joined_job(second_life=1, old_leaves_at=0.9)
    job[0] += [decision(0, 1.9, 2, "d2", joined=[[1, 1]])]
    assert "joiner_admitted_once" in found(job)


def test_a_member_neither_counted_nor_terminated_at_the_next_barrier():
    job = clean_job()
    del job[1][at(job[1], "decision", 1):]  # rank 1 vanished after its fault: barrier 1 keeps it, names nobody
    got = found(job)
    assert "counted_at_next" in got and "rank 1" in got["counted_at_next"][0]
    job[0][at(job[0], "decision", 1)] = decision(0, 1.05, 1, "d1", world_size=1, active=1, terminated=[1])
    job[0][at(job[0], "iteration_start", 1)] = start(0, 1.06, 1, 0, world_size=1, active=1)
    assert "counted_at_next" not in found(job)  # counted out: fine


def test_a_rank_that_resumes_beyond_the_bound_of_its_configuration():
    job = clean_job()
    late = 1.0 + max(TIMEOUTS["hard_timeout"] + TIMEOUTS["termination_grace_time"], TIMEOUTS["heartbeat_timeout"]) \
        + TIMEOUTS["barrier_timeout"] + invariants.RESUME_SLACK_S + 1
    job[0][at(job[0], "decision", 1):] = [decision(0, late - 0.1, 1, "d1"), start(0, late, 1, 0),
                  event(0, "exit", late + 1, outcome="completed", reason=None, iteration=1)]
    got = found(job)
    assert list(got) == ["bounded_resume"] and "beyond the" in got["bounded_resume"][0]


def test_a_rank_that_neither_resumes_nor_leaves():
    job = clean_job()
    del job[0][at(job[0], "iteration_start", 1):]  # read barrier 1's decision, then nothing at all
    assert "bounded_resume" in found(job)


def test_ranks_that_finish_in_different_iterations():
    job = clean_job()
    job[1][-1] = event(1, "exit", 2.0, outcome="completed", reason=None, iteration=2)
    assert list(found(job)) == ["same_final_iteration"]


def test_ranks_that_a_retry_controller_stops_in_different_iterations():
    """RetryController(max_iterations=5) says every rank stops at the same iteration; before issue 31's fix
    the first rank's RestartAbort restarted the others, which met the limit at 6."""
    job = clean_job()
    job[0][-1] = event(0, "exit", 2.0, outcome="terminated", reason="terminated", iteration=1, type="RestartAbort")
    job[1][-1] = event(1, "exit", 2.0, outcome="terminated", reason="terminated", iteration=2, type="RestartAbort")
    assert list(found(job)) == ["same_final_iteration"]


def test_what_outlives_the_job():
    observations = Observations(leftover_processes=["pid 9: python -m inprocess.processes.monitor"],
                                leftover_shm=["inprocess-hb-1"], fds={"r1": [10, 11, 12, 14, 17, 19, 21, 24],
                                                                      "r2": [10, 15, 11, 16, 11, 15, 12, 16]},
                                store_keys=[(5, ["inprocess/0/2/arrivals", "inprocess/0/4/event"])])
    messages = found(clean_job(), observations)["nothing_left"]
    assert len(messages) == 4, messages
    assert "inprocess/0/2/arrivals" in messages[-1] and not any("inprocess/0/4/event" in m for m in messages)


def test_the_command_checks_a_directory_of_events(tmp_path: pathlib.Path):
    job = clean_job()
    for events in job:
        with open(tmp_path / f"rank{events[0].rank}.jsonl", "w") as f:
            f.writelines(json.dumps(e.fields) + "\n" for e in events)
    run = subprocess.run([sys.executable, "-m", "inprocess.chaos", "check", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["violations"] == []
    broken = copy.deepcopy(job[1][-1].fields)
    broken["iteration"] = 7
    with open(tmp_path / "rank1.jsonl", "a") as f:
        f.write(json.dumps(broken) + "\n")
    run = subprocess.run([sys.executable, "-m", "inprocess.chaos", "check", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "same_final_iteration" in run.stdout, run.stdout


@pytest.mark.timeout(120)
def test_a_real_job_with_a_restart_passes(job, tmp_path: pathlib.Path):
    events = tmp_path / "events"
    res = job({"steps": 6, "faults": [{"iteration": 0, "rank": 1, "step": 2, "kind": "exception"}]}, world_size=3,
              env={"INPROCESS_EVENTS_DIR": str(events)})
    assert res.returncodes == [0, 0, 0], res.describe()
    run = subprocess.run([sys.executable, "-m", "inprocess.chaos", "check", str(events), "--json"],
                         capture_output=True, text=True, timeout=60)
    report = json.loads(run.stdout)
    assert run.returncode == 0 and report["violations"] == [], run.stdout
    assert report["invariants"]["one_decision"]["checked"] == 2  # barriers 0 and 1
    assert report["invariants"]["bounded_resume"]["checked"] == 3  # each rank resumed once
