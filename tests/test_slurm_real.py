"""The SLURM recipes (examples/slurm/, docs/slurm.md) under a real SLURM: sbatch, srun, scontrol and
slurmd of Debian's slurm-wlm 22.05, three nodes emulated on this host by tools/slurm_cluster.py.

Opt-in: they run where that cluster answers (``python3 tools/slurm_cluster.py start``, as root; .ci/run
starts it and sets INPROCESS_SLURM_REQUIRED=1, which turns the skip into a failure) and skip with the
reason elsewhere. The stand-in tests (tests/test_slurm_script.py, tests/test_slurm_respawn_task.py) stay
for machines without it.

Each test submits the recipe as a user would, from the repository's root, with the training script a user
starts with (examples/optimal.py), and reads what SLURM and the job say: the job's state and requeue count
(``scontrol show job``), its output file, the ranks' events (INPROCESS_EVENTS_DIR). Faults are real: an
injected SIGKILL, every rank process killed, a node lost as a whole (its slurmd, slurmstepd and every
process of a job on it, stopped and killed together: tools/slurm_cluster.py kill-node). Whatever a test
started is cancelled and reaped, and a node it killed is started again, whether it passed or not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from test_torchrun import reap_marked

ROOT = pathlib.Path(__file__).parent.parent
TRAIN = "examples/slurm/train.sbatch"
APART = "examples/slurm/train_store_apart.sbatch"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED", "REQUEUE_HOLD", "SPECIAL_EXIT"}
# Unanchored: the ranks' lines reach one stream, and one can start where another has not ended its line.
DONE_LINE = re.compile(r"\[optimal\] rank (\d+) done in [\d.]+ s, loss [\d.]+, world (\d+), parameters ([0-9a-f]{12})")

pytestmark = [pytest.mark.multiprocess]


def load_cluster_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("slurm_cluster", ROOT / "tools" / "slurm_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = load_cluster_tool()


def why_no_cluster() -> str | None:
    if shutil.which("sbatch") is None:
        return ("no sbatch on PATH: SLURM's commands are not installed "
                "(python3 tools/slurm_cluster.py start installs them)")
    if not tool.Cluster().running():
        return ("the emulated SLURM cluster does not run: start it with `python3 tools/slurm_cluster.py start` "
                "(root on Debian; it installs slurm-wlm and munge)")
    return None


@pytest.fixture(scope="module")
def cluster() -> Any:
    why = why_no_cluster()
    if why is not None:
        if os.environ.get("INPROCESS_SLURM_REQUIRED"):
            pytest.fail(f"INPROCESS_SLURM_REQUIRED is set, but {why}")
        pytest.skip(why)
    return tool.Cluster()


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s:g}s")


class Jobs:
    """The jobs and steps one test starts, and everything to stop after it."""

    def __init__(self, cluster: Any, tmp_path: pathlib.Path):
        self.cluster = cluster
        self.tmp = tmp_path
        self.ids: list[str] = []
        self.steps: list[subprocess.Popen[str]] = []
        self.killed_nodes: list[str] = []
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "TORCHELASTIC_", "INPROCESS_"))
                    and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "MASTER_ADDR", "MASTER_PORT")}
        self.env.update(
            PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # `python` is this one
            SLURM_CONF=str(cluster.conf), DONE_FILE=str(tmp_path / "done"),
            INPROCESS_EVENTS_DIR=str(tmp_path / "ev"), INPROCESS_SLURM_TEST=str(tmp_path),
        )

    def sbatch(self, script: str, *options: str, args: tuple[str, ...] = (), **env: str) -> str:
        res = subprocess.run(["sbatch", "--parsable", f"--output={self.tmp}/%j.out", *options, script, *args],
                             cwd=ROOT, env=dict(self.env, **env), capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        job = res.stdout.strip().split(";")[0]
        self.ids.append(job)
        return job

    def srun(self, argv: list[str], **env: str) -> subprocess.Popen[str]:
        step = subprocess.Popen(argv, cwd=ROOT, env=dict(self.env, **env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.steps.append(step)
        return step

    def state(self, job: str) -> dict[str, str]:
        res = subprocess.run(["scontrol", "-o", "show", "job", job], env=self.env, capture_output=True, text=True,
                             timeout=30)
        first = res.stdout.splitlines()[0] if res.stdout.strip() else ""
        return dict(item.split("=", 1) for item in first.split() if "=" in item)

    def wait_ended(self, job: str, timeout_s: float) -> dict[str, str]:
        return wait_for(f"job {job} ended ({self.state(job).get('JobState')})",
                        lambda: (s := self.state(job)).get("JobState") in ENDED and s, timeout_s, poll_s=1.0)

    def output(self, job: str) -> str:
        path = self.tmp / f"{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, rank: int) -> list[dict[str, Any]]:
        path = self.tmp / "ev" / f"rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]

    def running(self, ranks: range, iteration: int = 0) -> bool:
        """Every one of ``ranks`` started ``iteration`` (a joiner's first iteration is a later one)."""
        return all(any(e["kind"] == "iteration_start" and e["iteration"] >= iteration for e in self.events(r))
                   for r in ranks)

    def rank_processes(self, job: str) -> list[int]:
        """The ranks' own processes of ``job`` (not their monitors, node agents or store host)."""
        found = []
        for pid in tool.pids_with(f"SLURM_JOB_ID={job}"):
            try:
                cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                comm = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("python") and any(part.endswith(b"optimal.py") for part in cmdline):
                found.append(pid)
        return found

    def kill_node(self, node: str) -> None:
        self.killed_nodes.append(node)
        assert self.cluster.kill_node(node), f"nothing ran on {node}"

    def close(self) -> None:
        if self.ids:
            subprocess.run(["scancel", *self.ids], env=self.env, capture_output=True, timeout=30)
            for job in self.ids:
                wait_for(f"job {job} gone after scancel", lambda j=job: self.state(j).get("JobState") in ENDED, 60)
        for step in self.steps:
            if step.poll() is None:
                step.kill()
            step.communicate(timeout=30)
        left = reap_marked(f"INPROCESS_SLURM_TEST={self.tmp}", grace=20.0)
        for node in self.killed_nodes:
            self.cluster.start_node(node)
        assert not left, f"left running after the test: {left}"


@pytest.fixture
def jobs(cluster: Any, tmp_path: pathlib.Path) -> Iterator[Jobs]:
    j = Jobs(cluster, tmp_path)
    try:
        yield j
    finally:
        j.close()


def done_lines(text: str) -> dict[int, tuple[int, str]]:
    """rank -> (world, parameter digest), from the last line each rank of examples/optimal.py printed."""
    return {int(r): (int(w), d) for r, w, d in DONE_LINE.findall(text)}


@pytest.mark.timeout(240)
def test_a_rank_killed_by_sigkill_is_restarted_in_process_and_the_job_exits_0(jobs: Jobs) -> None:
    job = jobs.sbatch(TRAIN, "--ntasks-per-node=2", args=("--steps", "100"),
                      INPROCESS_FAULTS="sigkill@rank=1,step=30")
    state = jobs.wait_ended(job, 200)
    out = jobs.output(job)
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "0", "0:0"), out[-6000:]
    assert "restart after iteration 0: cause: rank 1 killed: SIGKILL" in out and "excluded: [1]" in out, out[-6000:]
    assert "[optimal] 100 steps done in iteration 1 (1 restarts)" in out, out[-6000:]
    assert "respawn_task: rank 1 killed by SIGKILL; not respawned (RESPAWNS=0)" in out
    assert "job done (srun status 137: ranks excluded on the way)" in out
    assert "Traceback" not in out and "Killed" not in out, out[-6000:]
    lines = done_lines(out)
    assert sorted(lines) == [0, 2, 3] and len({d for _, d in lines.values()}) == 1, out[-6000:]


@pytest.mark.timeout(300)
def test_every_rank_lost_is_a_real_requeue_and_the_next_incarnation_completes(jobs: Jobs) -> None:
    job = jobs.sbatch(TRAIN, "--ntasks-per-node=2", args=("--steps", "300", "--step-time", "0.02"))
    wait_for("4 ranks training", lambda: jobs.running(range(4)), 150)
    ranks = jobs.rank_processes(job)
    assert len(ranks) == 4, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    state = jobs.wait_ended(job, 240)
    out = jobs.output(job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), out[-6000:]
    assert f"incarnation {job}.0:" in out and f"incarnation {job}.1:" in out, out[-6000:]
    assert "no rank finished: requeueing (restart 1 of 3)" in out, out[-6000:]
    assert "[optimal] 300 steps done in iteration 0 (0 restarts)" in out and out.rstrip().endswith("job done")


@pytest.mark.timeout(240)
def test_max_requeues_is_honoured_exactly(jobs: Jobs) -> None:
    # Issue 33, finding 2: the incarnation after the last allowed requeue asked for one more.
    failing = jobs.tmp / "fails.py"
    failing.write_text("import sys\nsys.exit(75)\n")
    job = jobs.sbatch(TRAIN, "--ntasks-per-node=1", SCRIPT=str(failing), MAX_REQUEUES="1")
    state = jobs.wait_ended(job, 200)
    out = jobs.output(job)
    assert (state["JobState"], state["Restarts"]) == ("FAILED", "1"), (state, out[-6000:])
    assert re.findall(r"^incarnation \d+\.(\d+):", out, re.M) == ["0", "1"], out[-6000:]
    assert "requeueing (restart 1 of 1)" in out, out[-6000:]
    assert "step ended with status 75 and no rank finished; no requeue left: 1 of 1 used" in out, out[-6000:]


# Slow (50-120 s here): the same respawn and grow run on every change under inprocess.launch --respawn
# (tests/test_examples_respawn.py); this one adds srun and respawn_task.sh around them.
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_respawn_recipe_respawns_a_killed_rank_which_rejoins_at_a_grow(jobs: Jobs) -> None:
    job = jobs.sbatch(TRAIN, "--ntasks-per-node=2", args=("--steps", "500", "--step-time", "0.05"),
                      RESPAWNS="3", INPROCESS_FAULTS="sigkill@rank=1,step=20")
    state = jobs.wait_ended(job, 220)
    out = jobs.output(job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "0"), out[-6000:]
    assert "respawn_task: respawning rank 1 (attempt 1 of 3) in 1s: killed by SIGKILL" in out, out[-6000:]
    assert re.search(r"^grow after iteration \d+: .*joined \(new processes\): \[1\]", out, re.M), out[-6000:]
    lines = done_lines(out)
    assert sorted(lines) == [0, 1, 2, 3], out[-6000:]
    assert {w for w, _ in lines.values()} == {4} and len({d for _, d in lines.values()}) == 1, lines
    assert out.rstrip().endswith("job done"), out[-3000:]  # every task's last process exited 0
    assert "Traceback" not in out and "socket.cpp" not in out, out[-6000:]


@pytest.mark.timeout(30)
def test_a_steps_node_layout_comes_from_slurms_variables_without_ntasks_per_node(jobs: Jobs) -> None:
    # Issue 33, finding 4: without --ntasks-per-node a step has SLURM_STEP_TASKS_PER_NODE (2,1) only.
    code = ("import os; from inprocess.control.node_link import NodeLayout; l = NodeLayout.from_env(); "
            "print(os.environ['SLURM_PROCID'], l.node, l.local_rank, l.local_world_size, flush=True)")
    step = jobs.srun(["srun", "--nodes=2", "--ntasks=3", "--nodelist=inprocess-node[1-2]", "python", "-c", code])
    out, _ = step.communicate(timeout=25)
    assert step.returncode == 0, out
    seen = sorted(tuple(line.split()) for line in out.splitlines() if line[:1].isdigit())
    assert seen == [("0", "inprocess-node1", "0", "2"), ("1", "inprocess-node1", "1", "2"),
                    ("2", "inprocess-node2", "0", "1")], out


# docs/slurm.md, "A node that failed": the replacement step, for a job of 2 nodes x 2 ranks whose second node
# (ranks 2 and 3) failed; train.py is the training script with its arguments.
REPLACEMENT = ('INPROCESS_JOIN=1 RANK_OFFSET=2 WORLD_SIZE=4 srun --jobid="$SLURM_JOB_ID" --nodes=1 --ntasks=2 '
               '--nodelist="$SPARE_NODE" --kill-on-bad-exit=0 --wait=0 examples/slurm/respawn_task.sh train.py')
# A step of 0.5 s: the training lasts about steps x 0.5 s whatever the machine's load (a step's own work takes
# less), long enough for a node's loss to be seen (heartbeat_timeout, 20 s) and a replacement to come (the
# replacement's srun and imports took 8 s on an idle machine, 28 s at a load of 13).
PACED = ("--steps", "120", "--step-time", "0.5")


@pytest.mark.timeout(420)
def test_a_replacement_node_joins_the_running_job_and_the_world_grows_back(jobs: Jobs) -> None:
    # Issue 33, finding 3: the replacement step's processes were refused (the incarnation held the step id)
    # and took the node of the step's numbering (SLURM_NODEID=0) for theirs.
    job = jobs.sbatch(TRAIN, "--nodes=3", "--ntasks-per-node=2", args=PACED, SPARE_NODES="1")
    wait_for("4 ranks training", lambda: jobs.running(range(4)), 200)
    jobs.kill_node("inprocess-node2")  # ranks 2 and 3, their monitors, the node's agent, slurmd, slurmstepd
    replacement = jobs.srun(["bash", "-c", REPLACEMENT.replace("train.py", "examples/optimal.py " + " ".join(PACED))],
                            SLURM_JOB_ID=job, SPARE_NODE="inprocess-node3", MASTER_ADDR="inprocess-node1",
                            MASTER_PORT=str(20000 + int(job) % 20000))
    state = jobs.wait_ended(job, 360)
    added, _ = replacement.communicate(timeout=60)
    out = jobs.output(job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "0"), out[-6000:] + added[-4000:]
    assert replacement.returncode == 0, added[-6000:]
    assert re.search(r"joined \(new processes\): \[2, 3\]", out), out[-6000:] + added[-4000:]
    lines = {**done_lines(out), **done_lines(added)}
    assert sorted(lines) == [0, 1, 2, 3], out[-6000:] + added[-4000:]
    assert {w for w, _ in lines.values()} == {4} and len({d for _, d in lines.values()}) == 1, lines
    assert "JoinRefused" not in out + added and "Traceback" not in out + added, out[-6000:] + added[-4000:]


@pytest.mark.timeout(420)
def test_the_store_apart_survives_the_loss_of_the_node_of_initial_rank_0(jobs: Jobs) -> None:
    # Issue 33, finding 7: with the store host forked from rank 0, that node's loss ended the job.
    job = jobs.sbatch(APART, "--ntasks-per-node=2", args=("--steps", "80", "--step-time", "0.5"))
    wait_for("4 ranks training", lambda: jobs.running(range(4)), 200)
    jobs.kill_node("inprocess-node2")  # initial ranks 0 and 1: the store runs on node 1, the ranks on 2 and 3
    state = jobs.wait_ended(job, 360)
    out = jobs.output(job)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "0"), out[-6000:]
    assert "serving on port" in out, out[-6000:]  # the store host, on the batch host (inprocess-node1)
    assert re.search(r"^restart after iteration 0: .*excluded: \[0, 1\]; now 2 active of 2", out, re.M), out[-6000:]
    assert "[optimal] 80 steps done in iteration 1 (1 restarts)" in out, out[-6000:]
    lines = done_lines(out)
    assert sorted(lines) == [2, 3] and {w for w, _ in lines.values()} == {2}, out[-6000:]
    # srun's status leaves out the tasks of a node that failed (--no-kill): the step ends with 0.
    assert len({d for _, d in lines.values()}) == 1 and out.rstrip().endswith("job done"), out[-6000:]
