"""Training state from a peer (inprocess.peer_state): a rank that takes over resumes at the
last committed step with the state every other rank holds, bitwise, and the ranks that kept
running roll back to that same step."""

from __future__ import annotations

import json
import pathlib
import random
import re
import threading
from typing import Any

import pytest
import torch

import inprocess
from conftest import WORKERS, run_job
from inprocess.launch import LocalJob
from inprocess.peer_state import ReplicatedState
from inprocess.peer_state.record import size_text
from test_join import Respawner


def _job(tmp_path: pathlib.Path, name: str, plan: dict[str, Any], world_size: int) -> Any:
    folder = tmp_path / name
    folder.mkdir()
    return run_job(folder, plan, world_size=world_size, timeout=150, worker="peer_state_worker.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(330)
@pytest.mark.parametrize("sync, snapshots", [
    ("ddp", "copy"), pytest.param("manual", "copy", marks=pytest.mark.slow), ("ddp", "live"),
    pytest.param("ddp", "background", marks=pytest.mark.slow)])
def test_takeovers_and_restarts_end_bitwise_equal_to_the_job_without_faults(sync: str, snapshots: str,
                                                                            tmp_path: pathlib.Path) -> None:
    """4 active ranks and 2 spares; two ranks SIGKILLed (a spare takes over each time, its state
    sent by a peer) and two exceptions (every rank rolls back to the newest commit), at steps drawn
    at random; the final parameters and Adam state equal those of 4 ranks without faults.

    With torch's DDP the reference job creates its DDP again before the steps the faulty job
    resumed at: a DDP object's first step reduces its gradients in its initial bucket order and
    the later ones in the order it rebuilt after that step, so that a job that created its DDP
    at other steps differs in the last bits, faults or not (a job without faults that re-creates
    DDP at those steps equals the restarted one bitwise; one that does not, by rounding only).
    A loop that all-reduces each gradient itself (as Megatron-style training does with its own
    data-parallel buffers) equals the plain job without faults. `snapshots`: ReplicatedState's
    (the worker puts optimizer.step() and commit() in call_wrapper.atomic())."""
    seed = random.randrange(1 << 30)
    draw = random.Random(seed)
    steps = 24
    at = sorted(draw.sample(range(1, steps - 1), 4))
    kinds = draw.sample(["sigkill", "sigkill", "exception", "exception"], 4)
    ranks = {"sigkill": [1, 0], "exception": [3, 2]}  # initial ranks 0-3 active, 4 and 5 spares
    faults = [{"iteration": i, "rank": ranks[kind].pop(0), "step": step, "kind": kind}
              for i, (step, kind) in enumerate(zip(at, kinds, strict=True))]
    reference_plan = {"steps": steps, "max_active": 4, "sync": sync, "ddp_created_at": at}
    clean = _job(tmp_path, "clean", reference_plan, world_size=4)
    faulty = _job(tmp_path, "faulty", {"steps": steps, "max_active": 4, "sync": sync, "faults": faults,
                                       "snapshots": snapshots}, world_size=6)
    digests = {clean.rank(r)["result"]["digest"] for r in range(4)}
    assert len(digests) == 1, clean.describe()
    expected = digests.pop()
    why = f"seed {seed}, faults {faults}\n{faulty.describe()}"
    for r in (2, 3, 4, 5):
        log = faulty.rank(r)
        assert faulty.returncodes[r] == 0 and "result" in log, why
        assert log["result"] == {"step": steps, "digest": expected}, why
    assert faulty.returncodes[0] == -9 and faulty.returncodes[1] == -9, why
    # Every fault fired, and each restart resumed at the step of its fault (every=1).
    resumed = [it["resumed"] for it in faulty.rank(2)["iterations"]]
    assert resumed == [None, *at], why
    # Each spare got its state from a peer at the step the others rolled back to.
    for spare in (4, 5):
        first = faulty.rank(spare)["iterations"][0]
        assert first["resumed"] in at and first["rank"] in first["receivers"] and first["nbytes"] > 0, why
    # (After an exception the raising rank holds the newest commit; a rank that the restart
    # interrupted between a step's last collective and its commit gets it sent too.)


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs, one waiting for a joiner's start (2 min under load)
@pytest.mark.timeout(300)
def test_a_respawned_process_joins_and_gets_its_state_from_a_peer(tmp_path: pathlib.Path) -> None:
    """4 ranks, no spare: initial rank 1 is SIGKILLed at step 9; a stand-in launcher starts its
    replacement (INPROCESS_JOIN=1), the three others wait at safe points, the grow admits it, and
    a peer sends it the state of step 9: the job ends bitwise equal to the job without faults
    (its DDP created again at step 9)."""
    steps, kill_at = 16, 9
    clean = _job(tmp_path, "clean", {"steps": steps, "ddp_created_at": [kill_at]}, world_size=4)
    expected = clean.rank(0)["result"]["digest"]
    out = tmp_path / "grown"
    out.mkdir()
    plan = {"steps": steps, "max_active": 4, "full_world": 4, "grow": {"min_waiting": 1, "check_every": 1},
            "faults": [{"iteration": 0, "rank": 1, "step": kill_at, "kind": "sigkill"}]}
    env = {"INPROCESS_TEST_OUT": str(out), "INPROCESS_TEST_PLAN": json.dumps(plan), "INPROCESS_TEST_LOG": "INFO"}
    with LocalJob([str(WORKERS / "peer_state_worker.py")], 4, env=env) as job, Respawner(job) as respawner:
        job.wait(240)
        for _, _, popen in respawner.processes:
            popen.wait(60)
    logs = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}
    why = f"{job.outputs()[-6000:]}\n{respawner.outputs}"
    assert all(log.get("result") == {"step": steps, "digest": expected} for log in logs.values()), (logs, why)
    joiner = logs[1]["iterations"][0]  # the replacement's first iteration (its file replaced the killed one's)
    assert joiner["resumed"] == kill_at and joiner["rank"] in joiner["receivers"] and joiner["nbytes"] > 0, why
    # The survivors: the restart without rank 1 (world 3, no step), then the grow (world 4, step 9 again).
    survivor = [(it["world_size"], it["resumed"]) for it in logs[2]["iterations"]]
    assert survivor == [(4, None), (3, kill_at), (4, kill_at)], why


def _run_example(name: str, steps: int) -> str:
    """examples/<name> as its docstring runs it (5 processes, initial rank 1 SIGKILLed); rank 0's output."""
    example = pathlib.Path(__file__).parent.parent / "examples" / name
    with LocalJob([str(example)], 5, env={"EXAMPLE_STEPS": str(steps)}) as job:
        ranks = job.wait(timeout=120)
    assert [r.returncode for r in ranks] == [0, -9, 0, 0, 0], job.outputs()[-6000:]
    return ranks[0].output


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_the_example_runs_as_documented() -> None:
    """examples/peer_state.py: after the exception every rank resumes at step 30; after the kill
    the spare (the new rank 3) gets step 60 from rank 0."""
    out = _run_example("peer_state.py", steps=70)
    # A rank that the restart interrupted between step 29's last collective and its commit
    # holds step 29: it gets step 30 from a peer too.
    assert re.search(r"iteration 1: 4 ranks at step 30(, sent by rank \d to rank\(s\) \[[\d, ]+\])?\n", out), out
    assert "iteration 2: 4 ranks at step 60, sent by rank 0 to rank(s) [3]" in out, out
    assert "done: step 70" in out, out


@pytest.mark.multiprocess
@pytest.mark.slow  # two jobs of 4 and 6 processes
@pytest.mark.timeout(330)
@pytest.mark.parametrize("staging", [None, "cpu"], ids=["gloo", "staged"])
def test_a_source_that_dies_during_the_transfer_is_replaced_by_another_holder(staging: str | None,
                                                                            tmp_path: pathlib.Path) -> None:
    """Rank 1 is killed at step 6; in the restore that follows, the source (initial rank 0)
    dies after three of its chunks (1 KiB each). The receiver's restore fails, the job restarts
    once more, the second spare takes rank 0's place, another holder sends the state to both
    spares, and the job ends bitwise equal to the job without faults. `staging`: gloo's own
    transfer, or the NCCL path's (staged through two buffers, every point to point batched) over
    gloo with CPU staging; on NCCL the receive from the dead source would not fail but wait for
    the restart's abort, which the source's death starts anyway."""
    steps = 12
    clean = _job(tmp_path, "clean", {"steps": steps, "ddp_created_at": [6]}, world_size=4)
    expected = clean.rank(0)["result"]["digest"]
    plan = {"steps": steps, "max_active": 4, "chunk_bytes": 1024,
            "faults": [{"iteration": 0, "rank": 1, "step": 6, "kind": "sigkill"}],
            "die_while_sending": {"iteration": 1, "rank": 0, "after": 3}, **({"staging": staging} if staging else {})}
    faulty = _job(tmp_path, "faulty", plan, world_size=6)
    why = faulty.describe()
    assert faulty.returncodes[:2] == [-9, -9], why
    for r in (2, 3, 4, 5):
        result = faulty.rank(r).get("result")
        assert faulty.returncodes[r] == 0 and result == {"step": steps, "digest": expected}, (r, result, why)
    # Iteration 1's restore lost its source (it raised on every rank: no entry); iteration 2's completed.
    last = faulty.rank(2)["iterations"][-1]
    assert (last["iteration"], last["resumed"]) == (2, 6), why
    for spare in (4, 5):
        last = faulty.rank(spare)["iterations"][-1]
        assert last["iteration"] == 2 and last["resumed"] == 6 and last["rank"] in last["receivers"], why
        assert (faulty.rank(spare)["staged"]["batches"] > 0) == (staging is not None), why


def _sharded(tmp_path: pathlib.Path, name: str, plan: dict[str, Any], world_size: int) -> Any:
    folder = tmp_path / name
    folder.mkdir()
    return run_job(folder, plan, world_size=world_size, timeout=150, worker="sharded_state_worker.py")


@pytest.mark.multiprocess
@pytest.mark.timeout(330)
@pytest.mark.parametrize("snapshots", ["copy", pytest.param("background", marks=pytest.mark.slow)])
def test_a_lost_shard_comes_from_its_partners_copy_bitwise(snapshots: str, tmp_path: pathlib.Path) -> None:
    """A toy sharded job (each of 4 ranks owns a slice of the parameters and its momentum),
    2 spares: two SIGKILLs and an exception at random steps. Each spare that takes over gets
    the lost rank's shard from the copy its partner holds; the job ends bitwise equal to the
    job without faults."""
    seed = random.randrange(1 << 30)
    draw = random.Random(seed)
    steps = 20
    at = sorted(draw.sample(range(1, steps - 1), 3))
    faults = [{"iteration": 0, "rank": 1, "step": at[0], "kind": "sigkill"},
              {"iteration": 1, "rank": 3, "step": at[1], "kind": "exception"},
              {"iteration": 2, "rank": 2, "step": at[2], "kind": "sigkill"}]
    clean = _sharded(tmp_path, "clean", {"steps": steps}, world_size=4)
    expected = clean.rank(0)["result"]["digest"]
    faulty = _sharded(tmp_path, "faulty", {"steps": steps, "faults": faults, "snapshots": snapshots}, world_size=6)
    why = f"seed {seed}, faults {faults}\n{faulty.describe()}"
    for r in (0, 3, 4, 5):
        assert faulty.returncodes[r] == 0 and faulty.rank(r).get("result") == {"step": steps, "digest": expected}, why
    # Each restart resumes at its fault's step, or one commit before it: a copy is refreshed in the
    # background after each commit, and a rank that dies (or is interrupted) right after a commit
    # may not have sent that one yet; every rank then replays the step from the same state.
    resumed = [it["resumed"] for it in faulty.rank(0)["iterations"]]
    assert resumed[0] is None and all(r in (s - 1, s) for r, s in zip(resumed[1:], at, strict=True)), (resumed, why)
    for spare in (4, 5):
        first = faulty.rank(spare)["iterations"][0]
        assert first["rank"] in first["receivers"] and first["nbytes"] > 0, why
    # After the first kill initial rank 2 is rank 1: it receives shard 1 (from rank 0's copy) and
    # sends its own old shard 2 to its new rank. Shard 3 goes to the spare from initial rank 2's copy
    # when that copy holds the step the restore picked (the lowest holder), else from its owner,
    # initial rank 3 (the copy is refreshed in the background after each commit: on a loaded machine
    # it can lag a step). Its record and its line count what it received, one shard, not what it sent.
    shifted, owner = faulty.rank(2)["iterations"][1], faulty.rank(3)["iterations"][1]
    size = shifted["shard_nbytes"]
    assert shifted["rank"] == 1 and shifted["nbytes"] == size > 0, (shifted, why)
    assert shifted["sent"] in (size, 2 * size) and shifted["sent"] + owner["sent"] == 2 * size, (shifted, owner, why)
    line = re.search(r"r2 .*peer state: shard 1 of step \d+ from rank 0: (.+) in \d+ ms", faulty.job.outputs())
    assert line and line.group(1) == size_text(size), (line and line.group(0), why)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_shard_lost_with_its_copy_falls_back_and_says_so(tmp_path: pathlib.Path) -> None:
    """Initial rank 0 keeps rank 1's copy (partners one rank apart): both killed at once, shard 1
    and its copy are gone. Every rank's restore says so and returns None; the job starts again
    from its own step-0 state and still ends equal to the job without faults."""
    steps = 12
    clean = _sharded(tmp_path, "clean", {"steps": steps}, world_size=4)
    expected = clean.rank(0)["result"]["digest"]
    faults = [{"iteration": 0, "rank": 0, "step": 6, "kind": "kill_pair", "with": 1}]
    faulty = _sharded(tmp_path, "faulty", {"steps": steps, "faults": faults}, world_size=6)
    why = faulty.describe()
    for r in (2, 3, 4, 5):
        result = faulty.rank(r).get("result")
        assert faulty.returncodes[r] == 0 and result == {"step": steps, "digest": expected}, (r, result, why)
    # The two deaths may reach the survivors in one restart or two: every restore after them finds nothing.
    resumed = [it["resumed"] for it in faulty.rank(2)["iterations"]]
    assert len(resumed) >= 2 and resumed[-1] is None and all(r is None for r in resumed), (resumed, why)
    # Shard 1 is lost for good; any other shard is held at some step (its copy may lag a commit
    # behind: the kill can cut an exchange in flight), and is not named.
    assert re.search(r"peer state: shard\(s\) 1 lost with their copies", faulty.job.outputs()), why


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_the_sharded_example_runs_as_documented() -> None:
    """examples/sharded_state.py: after the kill at step 40 the spare gets rank 1's slice from
    rank 0's copy, and every rank resumes at the last step whose copies were complete."""
    out = _run_example("sharded_state.py", steps=50)
    assert re.search(r"iteration 1: 4 ranks at step (39|40)\n", out), out
    assert "done: step 50" in out, out


@pytest.mark.parametrize("nodes", [
    [0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [0, 1, 0, 1, 2, 2], [3, 0, 1, 3, 0, 1, 2, 2],
    [0, 0, 0, 1, 1, 2],  # uneven nodes, the largest not above half
])
def test_every_partner_is_on_another_node_and_every_rank_keeps_one_copy(nodes: list[int]) -> None:
    from inprocess.peer_state import partners

    ring = partners(nodes)
    assert sorted(ring) == list(range(len(nodes)))  # a permutation
    assert all(nodes[r] != nodes[ring[r]] for r in range(len(nodes))), ring


def test_on_one_node_partners_are_neighbours() -> None:
    from inprocess.peer_state import node_key, partners

    assert partners([7, 7, 7, 7]) == [1, 2, 3, 0]
    assert partners([7, 7, 7, 7], distance=2) == [2, 3, 0, 1]
    assert node_key()  # GROUP_RANK, SLURM_NODEID or the host name


def test_bad_input_is_named() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"every=0.*int >= 1"):
        ReplicatedState(every=0, model=model)
    with pytest.raises(TypeError, match=r"ReplicatedState\(step=\.\.\.\): a int has no state_dict"):
        ReplicatedState(model=model, step=3)
    with pytest.raises(ValueError, match="at least one object"):
        ReplicatedState()
    state = ReplicatedState(model=model)
    with pytest.raises(TypeError, match=r"\['values'\]\['loader'\] is a builtins.object.*plain data"):
        state.commit(1, loader=object())
    with pytest.raises(ValueError, match=r"commit\(step=-1\)"):
        state.commit(-1)
    assert inprocess.ReplicatedState is ReplicatedState
    with pytest.raises(ValueError, match=r"restore\(weights=\.\.\.\): expected the names registered before \(model\)"):
        state.restore(weights=model)  # checked before any collective
    with pytest.raises(RuntimeError, match=r"no object registered.*ShardedState\(model=\.\.\., \.\.\.\) or in restore"):
        inprocess.ShardedState()._objects.read()


def test_a_snapshot_interrupted_midway_leaves_the_previous_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception landing inside a snapshot's copies (the restart's interruption of the main
    thread) spoils only the buffer being written: the last complete snapshot stays whole."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    state = ReplicatedState(model=model, rng=False)
    assert state.commit(3, position=30)
    kept = [t.clone() for t in model.state_dict().values()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    copies = {"n": 0}
    real_copy = torch.Tensor.copy_

    def interrupted(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies["n"] += 1
        if copies["n"] == 3:
            raise RuntimeError("interrupted by the restart")
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", interrupted)
    with pytest.raises(RuntimeError, match="interrupted"):
        state.commit(4, position=40)
    monkeypatch.undo()
    assert state.step == 3 and state.values == {"position": 30}
    complete = state._own[0]
    assert complete is not None
    assert all(torch.equal(a, b) for a, b in zip(complete.tensors, kept, strict=True))
    # The next snapshot, uninterrupted, takes the spoiled buffer's place.
    assert state.commit(5, position=50) and state.step == 5


def test_every_n_steps_and_plain_values() -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters())
    state = ReplicatedState(model=model, optimizer=optimizer, every=5)
    assert not state.commit(3) and state.step is None
    assert state.commit(5, position=[1, 2], name="x") and state.step == 5
    assert state.values == {"position": [1, 2], "name": "x"}


def test_a_background_copy_holds_the_state_of_its_commit_not_of_the_next_step() -> None:
    """snapshots="background": the commit copies the optimizer's parameters and state on a thread of its own;
    the next optimizer.step() starts only once that copy ended (its step pre-hook), so that the
    snapshot is the state of the commit, bitwise, though the step comes right after it. 64 MB of
    parameters: the copy takes long enough that a step not held back would change what it copies."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    state = ReplicatedState(model=model, optimizer=optimizer, rng=False, snapshots="background")
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    kept = [t.clone() for t in model.state_dict().values()]
    assert state.commit(1)
    optimizer.step()  # waits for the copy, then subtracts 1 from every parameter
    state.wait_copy()
    snapshot = state._own[0]
    assert snapshot is not None and snapshot.step == 1 and state.step == 1
    assert all(torch.equal(a, b) for a, b in zip(snapshot.tensors, kept, strict=True))
    assert not torch.equal(model.weight.detach(), kept[0])  # the step did happen, after the copy


def test_a_background_copy_that_fails_leaves_the_previous_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that fails on its thread (as an interrupted one would) never passes for complete: the
    previous snapshot stays the one held, and the next commit writes into the failed one's buffer."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ReplicatedState(model=model, optimizer=optimizer, rng=False, snapshots="background")
    assert state.commit(3, position=30)
    state.wait_copy()
    real_copy = torch.Tensor.copy_

    def failing(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("copy failed")
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", failing)
    assert state.commit(4, position=40)
    state.wait_copy()
    monkeypatch.undo()
    assert state.step == 3 and state.nbytes > 0
    failed = state._own[0]
    assert failed is not None and failed.step == -1
    assert state.commit(5) and (state.wait_copy() or True) and state.step == 5
    assert any(b is failed for b in state._own)  # the failed buffer was reused, the 3 one kept until then


def test_a_live_snapshot_refers_to_the_optimizers_tensors_until_the_next_step() -> None:
    """snapshots="live": no copy of the parameters and the Adam state; the snapshot is the state of
    its step until optimizer.step() begins, then withdrawn (this rank would receive from a peer);
    the next commit holds the new step. Buffers and plain values are copied as ever."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    state = ReplicatedState(model=model, optimizer=optimizer, snapshots="live")
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    assert state.commit(1, position=10) and state.step == 1
    snapshot = state._own[0]
    assert snapshot is not None
    referred = {t.data_ptr() for t in snapshot.tensors}
    assert all(p.data_ptr() in referred for p in model.parameters())  # the parameters themselves
    assert all(v.data_ptr() in referred for entry in optimizer.state.values() for v in entry.values())
    assert model[1].running_mean.data_ptr() not in referred  # a buffer: copied (a forward changes it)
    model(torch.randn(8, 4)).sum().backward()
    assert state.step == 1  # forward and backward leave it
    optimizer.step()
    assert state.step is None  # the step withdrew it
    assert state.commit(2, position=20) and state.step == 2 and state.values == {"position": 20}
    with pytest.raises(ValueError, match=r"ShardedState\(snapshots='live'\): expected 'copy' or 'background'"):
        inprocess.ShardedState(snapshots="live")
    with pytest.raises(ValueError, match=r"snapshots='lazy'\): expected one of 'copy', 'background', 'live'"):
        ReplicatedState(model=model, snapshots="lazy")
