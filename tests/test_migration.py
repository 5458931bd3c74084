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
