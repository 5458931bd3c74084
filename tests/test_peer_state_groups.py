"""Peer state over parallel groups: a 2 x 2 tensor x data parallel job (tensor groups {0, 1} and
{2, 3}, data-parallel groups {0, 2} and {1, 3}) restores its state over each data-parallel group
named by ``restore(group=...)``: ReplicatedState from a replica of the same tensor slice,
ShardedState from the copy of a shard kept by another rank of the group, on another node. Spares
take a lost rank's number (FillGaps). The job ends bitwise equal to the job without faults."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import pytest

from conftest import run_job


def _job(tmp_path: pathlib.Path, name: str, plan: dict[str, Any], world_size: int) -> Any:
    folder = tmp_path / name
    folder.mkdir()
    return run_job(folder, plan, world_size=world_size, timeout=200, worker="tp_dp_state_worker.py",
                   ranks_per_node=2)


def _faults(kinds: list[str], steps: int) -> tuple[int, list[dict[str, Any]]]:
    seed = random.randrange(1 << 30)
    draw = random.Random(seed)
    at = sorted(draw.sample(range(1, steps - 1), len(kinds)))
    victims = draw.sample(range(4), len(kinds))
    faults = [{"iteration": i, "rank": r, "step": s, "kind": k}
              for i, (r, s, k) in enumerate(zip(victims, at, kinds, strict=True))]
    print(f"seed {seed}: faults at (iteration, initial rank, step, kind) "
          f"{[(f['iteration'], f['rank'], f['step'], f['kind']) for f in faults]}")
    return seed, faults


def _ends_bitwise_equal(tmp_path: pathlib.Path, mode: str, kinds: list[str], steps: int = 8) -> None:
    seed, faults = _faults(kinds, steps)
    clean = _job(tmp_path, "clean", {"steps": steps, "mode": mode}, world_size=4)
    expected = {clean.rank(r)["result"]["rank"]: clean.rank(r)["result"]["digest"] for r in range(4)}
    assert expected[0] == expected[2] != expected[1] == expected[3] or mode == "sharded", clean.describe()
    spares = kinds.count("sigkill")
    faulty = _job(tmp_path, "faulty", {"steps": steps, "mode": mode, "faults": faults}, world_size=4 + spares)
    why = f"seed {seed}, faults {faults}\n{faulty.describe()}"
    killed = {f["rank"] for f in faults if f["kind"] == "sigkill"}
    finished = {}
    for r in range(4 + spares):
        if r in killed:
            assert faulty.returncodes[r] == -9, why
            continue
        result = faulty.rank(r)["result"]
        assert faulty.returncodes[r] == 0 and result["step"] == steps, why
        finished[result["rank"]] = result["digest"]
    assert finished == expected, why  # every rank of the 2 x 2 layout, by its rank at the end
    # Every iteration resumed at the same step on every rank, and a spare's first restore received.
    logs = [faulty.rank(r) for r in range(4 + spares)]
    by_iteration: dict[int, set[Any]] = {}
    for log in logs:
        for it in log["iterations"]:
            by_iteration.setdefault(it["iteration"], set()).add(it["resumed"])
    assert all(len(resumed) == 1 for resumed in by_iteration.values()), (by_iteration, why)
    for spare in range(4, 4 + spares):
        first = logs[spare]["iterations"][0]
        assert first["resumed"] is not None and first["nbytes"] > 0, why
    if mode == "sharded":  # a shard's copy is on another node than the shard where its group spans two
        for iteration in by_iteration:
            node = {it["rank"]: it["node"] for log in logs for it in log["iterations"] if it["iteration"] == iteration}
            for rank, here in node.items():
                keeper = next(it["keeper"] for log in logs for it in log["iterations"]
                              if it["iteration"] == iteration and it["rank"] == rank)
                assert keeper % 2 == rank % 2 and keeper != rank, (iteration, rank, keeper, why)  # in its group
                if node[rank % 2] != node[rank % 2 + 2]:
                    assert node[keeper] != here, (iteration, rank, keeper, node, why)
                else:  # both spares took the seats of one group: they are on one node, and it is said
                    assert "every rank of the group is on one node" in faulty.job.outputs(), why


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sharded_within_data_parallel_groups_a_kill_ends_bitwise_equal(tmp_path: pathlib.Path) -> None:
    _ends_bitwise_equal(tmp_path, "sharded", ["sigkill"])


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs of 4 and 5 processes
@pytest.mark.timeout(300)
def test_replicated_over_data_parallel_groups_a_kill_and_an_exception_end_bitwise_equal(
        tmp_path: pathlib.Path) -> None:
    _ends_bitwise_equal(tmp_path, "replicated", random.sample(["sigkill", "exception"], 2))


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs of 4 and 6 processes
@pytest.mark.timeout(300)
def test_sharded_within_data_parallel_groups_two_kills_end_bitwise_equal(tmp_path: pathlib.Path) -> None:
    _ends_bitwise_equal(tmp_path, "sharded", ["sigkill", "sigkill"])
