"""Programs written for nvidia_resiliency_ext.inprocess run unchanged after the import swap.

Each program in tests/migration/ is written the way a user of that library
writes it (from its usage guide and API documentation: the basic and the
optimal example's shapes, a custom hook of every kind); its only change is
``import inprocess`` instead of ``import nvidia_resiliency_ext.inprocess as
inprocess``. Each runs on 1 and on 4 real ranks, and the assertions are the
outcomes that library documents. The same programs gave the same records
under nvidia_resiliency_ext 0.4.1 (see the README's migration section).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any

import pytest

from inprocess.launch import LocalJob

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

PROGRAMS = pathlib.Path(__file__).parent / "migration"


def run(tmp_path: pathlib.Path, program: str, world_size: int, **env: str) -> dict[int, dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    job_env = {"MIGRATION_OUT": str(out), **env}
    with LocalJob([str(PROGRAMS / program)], world_size, env=job_env) as job:
        ranks = job.wait(200)
    assert all(rp.returncode == 0 for rp in ranks), job.outputs()[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)}


def fault_on(world_size: int, step: int) -> str:
    return f"{world_size - 1}:{step}"  # the last rank: rank 0 on one rank


@pytest.mark.parametrize("world_size", [1, 4])
def test_basic_whole_main_wrapped_restarts_and_resumes_from_the_file_checkpoint(tmp_path, world_size):
    seen = run(tmp_path, "basic.py", world_size, MIGRATION_FAULT=fault_on(world_size, 6))
    for rank, s in seen.items():
        # One fault, one restart; the second iteration resumes after the checkpoint of step 3.
        assert s["iterations"] == [0, 1], s
        assert s["resumed_at"] == [0, 4], s
        assert s["result"]["rank"] == rank and s["result"]["steps"] == 8
        assert math.isfinite(s["result"]["loss"])


@pytest.mark.parametrize("world_size", [1, 4])
def test_optimal_objects_built_once_are_reused_and_state_is_kept_in_memory(tmp_path, world_size):
    seen = run(tmp_path, "optimal.py", world_size, MIGRATION_FAULT=fault_on(world_size, 6))
    for rank, s in seen.items():
        assert s["iterations"] == [0, 1], s
        assert s["resumed_at"] == [0, 4], s  # the in-memory checkpoint of step 3
        assert s["same_model_every_iteration"], s
        assert s["result"]["rank"] == rank and s["result"]["steps"] == 8


ONE_RESTART = [
    ["initialize", 0], ["health_check", 0], ["function", 0],
    ["abort", 0], ["finalize", 0], ["health_check", 0],
    ["initialize", 1], ["health_check", 1], ["function", 1], ["completion", 1],
]


@pytest.mark.parametrize("world_size", [1, 4])
def test_custom_hooks_run_in_the_documented_order(tmp_path, world_size):
    seen = run(tmp_path, "hooks.py", world_size, MIGRATION_FAULT=fault_on(world_size, 3))
    for rank, s in seen.items():
        assert s["outcome"] == {"returned": rank}
        assert s["calls"] == ONE_RESTART, s


@pytest.mark.parametrize("world_size", [1, 4])
def test_a_failing_finalize_terminates_that_rank_with_its_own_exception(tmp_path, world_size):
    leaver = world_size - 1
    seen = run(tmp_path, "hooks.py", world_size, MIGRATION_FAULT=fault_on(world_size, 3),
               MIGRATION_FINALIZE_FAILS=str(leaver))
    assert seen[leaver]["outcome"] == {"raised": "ValueError", "message": f"finalize failed on rank {leaver}"}
    assert seen[leaver]["calls"] == ONE_RESTART[:5] + [["terminate", 0]]
    for rank in range(world_size - 1):
        # The others go on without it, renumbered from 0.
        assert seen[rank]["outcome"] == {"returned": rank}
        assert seen[rank]["calls"] == ONE_RESTART


def run_allowing(tmp_path: pathlib.Path, program: str, world_size: int, exits: dict[int, int],
                 **env: str) -> dict[int, dict[str, Any]]:
    """As run(), for a job where the ranks of ``exits`` end with that status (and write nothing)."""
    out = tmp_path / "out"
    out.mkdir()
    with LocalJob([str(PROGRAMS / program)], world_size, env={"MIGRATION_OUT": str(out), **env}) as job:
        ranks = job.wait(200)
    codes = {r: rp.returncode for r, rp in enumerate(ranks)}
    assert codes == {r: exits.get(r, 0) for r in range(world_size)}, job.outputs()[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size) if r not in exits}


COMPOSE_FORMS = {"no_argument": 42, "several_arguments": 6, "none_warns": True, "is_rank_assignment": True}


def test_custom_per_rank_assignment_and_compose_on_one_rank(tmp_path):
    seen = run(tmp_path, "assignment.py", 1, MIGRATION_FAULT="0:3:raise", MIGRATION_MAX_ACTIVE="1")
    s = seen[0]
    assert s["outcome"] == {"returned": {"rank": 0, "world_size": 1, "sum": 8.0}}, s
    assert s["iterations"] == [[0, 0, 1], [1, 0, 1]]
    # At the initial barrier and at the restart: the state of the iteration that ended (0 both times,
    # as there), nobody left.
    assert s["assignment"] == [[0, []]], s
    assert s["finalize"] == ["first", "second"]  # Compose(second, first): right to left
    assert s["initialize_is_initialize"] and s["compose"] == COMPOSE_FORMS


def test_custom_per_rank_assignment_a_spare_takes_the_place_of_a_dead_rank(tmp_path):
    # Four ranks, three active (MaxActiveWorldSize(3)): initial rank 3 waits as a spare. Initial rank 1
    # ends its process in iteration 0; ShiftRanks renumbers 0, 2, 3 as 0, 1, 2 and all three are active.
    seen = run_allowing(tmp_path, "assignment.py", 4, {1: 3}, MIGRATION_FAULT="1:3:exit", MIGRATION_MAX_ACTIVE="3")
    new_rank = {0: 0, 2: 1, 3: 2}
    for initial, s in seen.items():
        assert s["outcome"] == {"returned": {"rank": new_rank[initial], "world_size": 3, "sum": 24.0}}, s
        assert s["compose"] == COMPOSE_FORMS and s["initialize_is_initialize"]
        # The per-rank hook's inputs are agreed: every rank saw nobody leave at the initial barrier, then
        # the same terminated set (numbered by rank) at the restart.
        assert s["assignment"] == [[0, []], [0, [1]]], s
    assert [it[0] for it in seen[3]["iterations"]] == [1]  # the spare ran only once activated
    assert seen[0]["iterations"] == [[0, 0, 3], [1, 0, 3]]


def test_a_failing_rank_assignment_raises_its_own_exception_on_one_rank(tmp_path):
    seen = run(tmp_path, "assignment.py", 1, MIGRATION_FAULT="0:3:raise", MIGRATION_MAX_ACTIVE="1",
               MIGRATION_RA_RAISES="1")
    assert seen[0]["outcome"] == {"raised": "ValueError", "message": "rank assignment failed at the restart"}


NVRX_PYTHON = os.environ.get("INPROCESS_NVRX_PYTHON")
SHIM = PROGRAMS / "nvrx_shim"


def records(tmp_path: pathlib.Path, python: str | None, program: str, world_size: int, exits: dict[int, int],
            **env: str) -> dict[int, dict[str, Any]]:
    out = tmp_path / ("nvrx" if python else "ours")
    out.mkdir()
    job_env = {"MIGRATION_OUT": str(out), **env}
    if python:
        job_env["PYTHONPATH"] = str(SHIM)
    with LocalJob([str(PROGRAMS / program)], world_size, env=job_env, python=python) as job:
        ranks = job.wait(200)
    codes = {r: rp.returncode for r, rp in enumerate(ranks)}
    assert codes == {r: exits.get(r, 0) for r in range(world_size)}, job.outputs()[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size) if r not in exits}


@pytest.mark.skipif(NVRX_PYTHON is None, reason="set INPROCESS_NVRX_PYTHON to a Python with nvidia_resiliency_ext "
                                                 "to run the programs under it and compare the records")
@pytest.mark.parametrize(("program", "world_size", "exits", "env"), [
    ("optimal.py", 1, {}, {"MIGRATION_FAULT": "0:6"}),
    ("hooks.py", 4, {}, {"MIGRATION_FAULT": "3:3"}),
    ("hooks.py", 4, {}, {"MIGRATION_FAULT": "3:3", "MIGRATION_FINALIZE_FAILS": "3"}),
    ("assignment.py", 1, {}, {"MIGRATION_FAULT": "0:3:raise", "MIGRATION_MAX_ACTIVE": "1"}),
    ("assignment.py", 4, {1: 3}, {"MIGRATION_FAULT": "1:3:exit", "MIGRATION_MAX_ACTIVE": "3"}),
    ("assignment.py", 1, {}, {"MIGRATION_FAULT": "0:3:raise", "MIGRATION_MAX_ACTIVE": "1", "MIGRATION_RA_RAISES": "1"}),
])
def test_the_same_program_gives_the_same_records_under_nvidia_resiliency_ext(tmp_path, program, world_size, exits,
                                                                               env):
    # basic.py is not compared: its CudaHealthCheck needs CUDA under nvidia_resiliency_ext.
    ours = records(tmp_path, None, program, world_size, exits, **env)
    theirs = records(tmp_path, NVRX_PYTHON, program, world_size, exits, **env)
    assert ours == theirs
