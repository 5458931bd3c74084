"""The chaos schedule and runner (inprocess/chaos/): a seeded schedule of every fault kind at every place
the toolkit reaches, and a short run of it, checked for what must never happen."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from inprocess.chaos import invariants
from inprocess.chaos import schedule as chaos_schedule
from inprocess.chaos.runner import read_observations
from inprocess.chaos.schedule import ALL_KINDS, Schedule, draw
from inprocess.faults.plan import FaultPlan


def test_a_seed_gives_the_same_schedule_and_its_plan_parses():
    first, again = draw(11, 60, 8, 2, nodes=2), draw(11, 60, 8, 2, nodes=2)
    assert first.to_json() == again.to_json() and draw(12, 60, 8, 2).to_json() != first.to_json()
    assert Schedule.from_json(first.to_json()).to_json() == first.to_json()
    plan = FaultPlan.parse(first.plan())  # the toolkit takes every entry, or names the one it cannot
    assert len(plan.faults) >= 40 and plan.seed == 11


def test_every_kind_and_every_place_comes_in_a_long_schedule():
    s = draw(1, 600, 8, 2)
    assert {f.kind for f in s.faults} == set(ALL_KINDS)
    places = {f.where for f in s.faults}
    assert places >= {"step", "after", "abort", "finalize", "health_check", "barrier", "reassignment", "takeover",
                      "store", "joiner"}, places
    assert s.joiners and s.store_stops


def test_no_fault_of_a_schedule_ends_the_job_by_design():
    """A KeyboardInterrupt in the leader's rank assignment ends the whole job (tests/test_fault_matrix.py
    asserts it): the schedule never puts one there; nor an exception in a restart's hook (its rank leaves
    for good, with a status no launcher replaces). A frozen rank at a barrier is placed there since the
    barrier has a hang rule (the first long run found it unwatched)."""
    s = draw(2, 2000, 8, 2)
    assert not [f for f in s.faults if f.where == "reassignment" and f.kind == "sigint"]
    assert not [f for f in s.faults if f.where in chaos_schedule.HOOK_PHASES and f.kind == "exception"]
    assert [f for f in s.faults if f.where == "barrier" and f.kind in chaos_schedule.SLOW]


def test_only_the_kinds_asked_for():
    s = draw(3, 50, 4, 1, kinds={"exception", "sigkill"})
    assert {f.kind for f in s.faults} == {"exception", "sigkill"}
    with pytest.raises(ValueError, match="none of"):
        draw(3, 5, 4, 1, kinds={"nothing"})


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_short_seeded_run_breaks_no_invariant(tmp_path: pathlib.Path):
    """Seed 3: ten faults (a hang at a step, a hang in the health check, SIGINT there, SIGKILL, SIGTERM in a
    takeover, abort, exceptions, joiners that die) on 3 active ranks and a spare."""
    run = subprocess.run([sys.executable, "-m", "inprocess.chaos", "run", "--seed", "3", "--faults", "10",
                          "--ranks", "3", "--spares", "1", "--out", str(tmp_path / "run"), "--json"],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["violations"] == [] and report["partial_violations"] == []
    assert report["figures"]["restarts"] >= 10, report["figures"]
    checked = {name: v["checked"] for name, v in report["invariants"].items()}
    assert all(checked[name] > 0 for name in ("one_decision", "went_on_by_decision", "bounded_resume",
                                              "counted_at_next", "nothing_left")), checked
    assert "python -m inprocess.chaos run --seed 3 --faults 10" in run.stdout  # the seed and how to replay it


@pytest.mark.timeout(60)
def test_a_run_refuses_an_out_folder_that_holds_an_earlier_run(tmp_path: pathlib.Path):
    """Run twice into one folder, the checker read both runs' events as one job: 2 different decisions
    of barrier 0, two processes in one seat's life, "violations" that never happened. It says so at once."""
    out = tmp_path / "run"
    (out / "events").mkdir(parents=True)
    (out / "events" / "rank0.jsonl").write_text("{}\n")
    run = subprocess.run([sys.executable, "-m", "inprocess.chaos", "run", "--seed", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"--out {out} is not empty (events)" in run.stderr and "give a new or empty folder" in run.stderr
    assert not (out / "launch.log").exists()  # nothing started


@pytest.mark.parametrize("worlds, fds, leak", [
    ([2, 2, 3, 5, 8, 8, 8, 8, 8, 8, 8, 8], [17 + w for w in [2, 2, 3, 5, 8, 8, 8, 8, 8, 8, 8, 8]], False),
    ([8] * 12, [19, 19, 20, 20, 21, 22, 23, 24, 25, 26, 27, 28], True),
], ids=["the_world_grew_back", "a_leak"])
def test_descriptors_are_judged_beyond_one_per_peer(tmp_path: pathlib.Path, worlds, fds, leak):
    """A process whose group grew back from 2 to 8 ranks holds a gloo socket per peer more (seed 31's long
    run: 17 + the world at every iteration), which is no leak; descriptors that grow in one world are."""
    records = [{"iteration": i, "fds": n, "world": w} for i, (n, w) in enumerate(zip(fds, worlds, strict=True))]
    (tmp_path / "8.7199.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    o = invariants.Observations()
    read_observations(tmp_path, o)
    assert o.fds == {"8.7199": [n - w for n, w in zip(fds, worlds, strict=True)]}
    found = invariants.check_nothing_left(o).violations
    assert (len(found) == 1 and "descriptors grow" in str(found[0])) if leak else not found, found
