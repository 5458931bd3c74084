"""pg_tracker against the real torch.distributed: a group left registered by an
init_process_group that a restart interrupted is forgotten at the restart."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

# One rank, world 1, gloo over a HashStore. The restart's interrupt is stood in for by an
# exception from torch's own _update_default_pg, the call that follows the group's
# registration in init_process_group (distributed_c10d.py, torch 2.13: the default group
# is registered by _new_process_group_helper, then _update_default_pg(default_pg)).
PROGRAM = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from inprocess.engine import pg_tracker

    pg_tracker.install()
    original = c10d._update_default_pg

    def interrupted(pg):
        c10d._update_default_pg = original
        raise KeyboardInterrupt("the restart's interrupt")

    c10d._update_default_pg = interrupted
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except KeyboardInterrupt:
        pass
    assert not dist.is_initialized() and c10d._world.pg_map, "the group was not left registered"
    if sys.argv[1] == "without-forgetting":  # release_groups as it was before it forgot them
        pg_tracker._forget_orphaned_groups = lambda c10d: None
    pg_tracker.release_groups()
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as e:
        print(f"second init: {type(e).__name__}: {e}")
        sys.exit(3)
    t = __import__("torch").ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    print("second init: ok", t.tolist())
""")


def run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=50)


def test_without_forgetting_them_the_next_init_process_group_fails():
    """release_groups resets torch's group counter (the next group is named "0" again, as
    on every peer), so the orphan's name "0" is taken."""
    res = run("without-forgetting")
    assert res.returncode == 3, res.stdout + res.stderr
    assert "has already been created" in res.stdout, res.stdout + res.stderr


def test_release_groups_forgets_a_group_an_interrupted_init_left_registered():
    res = run("release")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "second init: ok [1.0, 1.0]" in res.stdout, res.stdout + res.stderr
