"""Peer state for FSDP2 (``fully_shard``) on CPU/gloo: a lost rank's shard of the parameters and
of the Adam state comes from its partner's copy, read and loaded through
torch.distributed.checkpoint's state dicts, and the job ends bitwise equal to the job without
faults; a snapshot that does not fit the module (other FQNs, other placements, no DTensors) is
refused before anything is loaded."""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys
from typing import Any

import pytest

from conftest import WORKERS, run_job


def _job(tmp_path: pathlib.Path, name: str, plan: dict[str, Any], world_size: int) -> Any:
    folder = tmp_path / name
    folder.mkdir()
    return run_job(folder, plan, world_size=world_size, timeout=200, worker="fsdp_state_worker.py")


def _kills_end_bitwise_equal(tmp_path: pathlib.Path, active: int, kills: int, steps: int) -> None:
    seed = random.randrange(1 << 30)
    draw = random.Random(seed)
    at = sorted(draw.sample(range(1, steps - 1), kills))
    victims = draw.sample(range(active), kills)  # initial ranks; each kill is in the next iteration
    faults = [{"iteration": i, "rank": r, "step": s, "kind": "sigkill"}
              for i, (r, s) in enumerate(zip(victims, at, strict=True))]
    print(f"seed {seed}: SIGKILL at (iteration, initial rank, step) "
          f"{[(f['iteration'], f['rank'], f['step']) for f in faults]}")
    clean = _job(tmp_path, "clean", {"steps": steps, "max_active": active}, world_size=active)
    digests = {clean.rank(r)["result"]["digest"] for r in range(active)}
    assert len(digests) == 1, clean.describe()
    expected = {"step": steps, "digest": digests.pop()}
    faulty = _job(tmp_path, "faulty", {"steps": steps, "max_active": active, "faults": faults},
                  world_size=active + kills)
    why = f"seed {seed}, faults {faults}\n{faulty.describe()}"
    survivors = [r for r in range(active + kills) if r not in victims]
    for r in survivors:
        assert faulty.returncodes[r] == 0, why
        assert faulty.rank(r)["result"] == expected, why
    assert all(faulty.returncodes[r] == -9 for r in victims), why
    # Each spare's first restore received its shard (parameters and Adam state) from a copy.
    for spare in range(active, active + kills):
        first = faulty.rank(spare)["iterations"][0]
        assert first["resumed"] is not None and first["rank"] in first["receivers"] and first["nbytes"] > 0, why


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_fsdp2_a_spare_takes_a_killed_ranks_shard_bitwise(tmp_path: pathlib.Path) -> None:
    """2 ranks and a spare: one SIGKILL at a random step (the fast version of the one below)."""
    _kills_end_bitwise_equal(tmp_path, active=2, kills=1, steps=8)


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs of 4 and 6 FSDP2 processes
@pytest.mark.timeout(400)
def test_fsdp2_four_ranks_two_spares_two_sigkills_bitwise(tmp_path: pathlib.Path) -> None:
    """4 ranks and 2 spares, FSDP2 per layer, Adam; SIGKILLs of two ranks at random steps (the seed
    is printed): every survivor ends with full parameters and Adam state equal to the job's
    without faults."""
    _kills_end_bitwise_equal(tmp_path, active=4, kills=2, steps=12)


@pytest.mark.timeout(120)
def test_a_snapshot_that_does_not_fit_is_refused_before_anything_is_loaded() -> None:
    res = subprocess.run([sys.executable, str(WORKERS / "dtensor_check_worker.py")], capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["same"] == {"error": None, "unchanged": False, "equal_to_source": True}, out
    assert "at '1.bias': the snapshot holds a DTensor (Shard(dim=0),) of [4]" in out["other_fqns"]["error"], out
    assert "here: nothing" in out["other_fqns"]["error"], out
    placements = out["other_placements"]["error"]
    assert "(Shard(dim=0),) of [6]" in placements and "here: a DTensor (Replicate(),) of [6]" in placements, out
    assert "holds DTensors and this iteration's model has none" in out["plain"]["error"], out
    assert all(out[name]["unchanged"] for name in ("other_fqns", "other_placements", "plain")), out
