"""Every shell command of README.md is accounted for: run here as written (the cheap
ones), or named with the test that checks it. A command added to the README without an
entry below fails ``test_every_readme_command_is_accounted_for``.

Run as written, with two substitutions: ``python`` is this interpreter (the one with the
package installed), and ``torchrun`` is ``python -m torch.distributed.run`` (the same
program; a ``torchrun`` on PATH may belong to another interpreter); ``/tmp/ev`` is a
directory of the test's own."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from test_torchrun import reap_marked

ROOT = pathlib.Path(__file__).parent.parent
README = ROOT / "README.md"

SMOKE = "tests/test_benchmarks_smoke.py runs it with --smoke"
# The README's second command ("Two commands"): the whole suite.
TEST_COMMAND = 'pip install torch==2.13.0 && pip install ".[test,test-gpu-abi]" && python -m pytest'
# README command -> the test that checks it (not run here: an install, the suite, or long).
CHECKED_ELSEWHERE = {
    'pip install torch==2.13.0 && pip install . && python examples/demo.py':
        "tests/test_wheel.py builds and installs the wheel; tests/test_demo.py runs the demo",
    TEST_COMMAND: "the suite itself; .ci/run runs exactly it (test_ci_runs_the_readmes_test_command)",
    "pip wheel --no-deps -w dist .": "tests/test_wheel.py builds the wheel so (into a directory of its own)",
    "auditwheel repair dist/inprocess-*-linux_x86_64.whl -w dist": "tests/test_wheel.py repairs it so",
    'pip install "matplotlib>=3.5"': "an install (the timeline extra)",
    'pip install torch==2.13.0 "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.18" ninja':
        "the development install, checked by hand in a fresh venv (report of the launchers branch)",
    'pip install --no-build-isolation -e ".[test]"': "the same",
    "python -m pytest tests/test_examples.py": "tests/test_examples.py",
    "python benchmarks/restart_latency.py --faults 10": SMOKE,
    "python benchmarks/fault_latency.py --faults 5": SMOKE,
    "python benchmarks/overhead.py": SMOKE,
    "python benchmarks/memory.py": SMOKE,
    "python benchmarks/control_plane_sim.py": SMOKE,
    "python benchmarks/example_restarts.py --faults 20": SMOKE,
    "cmake -S . -B build/bench -DINPROCESS_BUILD_BENCH=ON -Dpybind11_DIR=$(python -m pybind11 --cmakedir) "
    "&& cmake --build build/bench --target inprocess_microbench && ./build/bench/inprocess_microbench":
        "a C++ build of minutes; built and run by hand (report of the launchers branch)",
    "export TORCH_NCCL_ASYNC_ERROR_HANDLING=2": "a setting; tests/test_gpu_settings.py checks the warning about it",
    "export TORCH_NCCL_RETHROW_CUDA_ERRORS=0": "a setting; tests/test_gpu_settings.py shows exit 76 with it",
    "export TORCH_NCCL_NONBLOCKING_TIMEOUT=20": "a setting; tests/test_gpu_settings.py checks the warning about it",
    "python -m inprocess.gpu.acceptance --out acceptance/": "tests/test_gpu_acceptance.py runs its no-GPU mode",
    "python -m inprocess.launch --nproc 4 --respawn 3 train.py":
        "train.py stands for the user's script; tests/test_launch_respawn.py runs --respawn with stand-in ranks",
    "srun --kill-on-bad-exit=0 --wait=0 examples/slurm/respawn_task.sh train.py":
        "no SLURM here; tests/test_slurm_respawn_task.py runs respawn_task.sh as srun runs a task",
    'INPROCESS_JOIN=1 RANK_OFFSET=4 WORLD_SIZE=8 srun --jobid="$SLURM_JOB_ID" --nodes=1 --ntasks=4 '
    '--nodelist="$SPARE_NODE" --kill-on-bad-exit=0 --wait=0 examples/slurm/respawn_task.sh train.py':
        "no SLURM here; tests/test_slurm_respawn_task.py runs a replacement node's task (RANK_OFFSET, "
        "WORLD_SIZE, INPROCESS_JOIN) as srun would",
    "torchrun --standalone --nproc-per-node 4 --max-restarts 3 train.py":
        "train.py stands for the user's script; tests/test_torchrun_worker_death.py runs torchrun so "
        "(--max-restarts 1) and asserts what it does when a worker dies",
    'INPROCESS_FAULTS="sigkill@rank=2,step=30;exception@rank=1,after=5s,iteration=1" '
    "python -m inprocess.launch --nproc 4 train.py": "train.py stands for the user's script; "
                                                     "tests/test_examples.py runs such plans on the examples",
}
# README command -> what its output must show.
RUN_HERE = {
    'INPROCESS_FAULTS="exception@rank=2,after=1s" python -m inprocess.launch --nproc 4 examples/minimal.py':
        "cause: rank 2 exception: InjectedException",
    'INPROCESS_FAULTS="sigkill@rank=1,step=50" python -m inprocess.launch --nproc 4 examples/spares.py':
        "initial rank 3 takes over as active rank 2",
    'INPROCESS_FAULTS="exception@rank=3,step=50" torchrun --standalone --nproc-per-node 4 examples/optimal.py':
        "200 steps done in iteration 1 (1 restarts)",
    "INPROCESS_EVENTS_DIR=/tmp/ev python examples/demo.py": "[demo] finished 100 steps",
    "python -m inprocess.timeline /tmp/ev --png": "restart",
}


def readme_commands() -> list[str]:
    """The lines of the README's ```bash blocks, continuations joined, comments dropped."""
    commands, block, pending = [], False, ""
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block:
            continue
        line = re.sub(r"\s+# .*$", "", line)  # a comment: "  # ..." (no "# " inside the commands)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].strip() + " "
            continue
        command = (pending + line.strip()).strip()
        pending = ""
        if command:
            commands.append(command)
    return commands


def test_every_readme_command_is_accounted_for() -> None:
    commands = readme_commands()
    assert len(commands) >= 15, commands
    unknown = [c for c in commands if c not in CHECKED_ELSEWHERE and c not in RUN_HERE]
    assert not unknown, f"README commands with no entry in this test: {unknown}"
    gone = [c for c in [*CHECKED_ELSEWHERE, *RUN_HERE] if c not in commands]
    assert not gone, f"entries for commands the README no longer has: {gone}"


def test_ci_runs_the_readmes_test_command() -> None:
    """.ci/run runs the README's test command and nothing else (no install of its own, no system edit)."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', TEST_COMMAND], commands
    assert TEST_COMMAND in readme_commands()


def run_as_written(command: str, tmp_path: pathlib.Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    command = command.replace("/tmp/ev", str(tmp_path / "ev"))
    command = re.sub(r"\btorchrun\b", "python -m torch.distributed.run", command)
    env = dict(os.environ, INPROCESS_README_TEST=str(tmp_path))
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    try:
        return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        left = reap_marked(f"INPROCESS_README_TEST={tmp_path}")
        assert not left, left


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", [c for c in RUN_HERE if "/tmp/ev" not in c])
def test_the_command_runs_as_written(command: str, tmp_path: pathlib.Path) -> None:
    res = run_as_written(command, tmp_path)
    out = res.stdout + res.stderr
    assert RUN_HERE[command] in out, out[-6000:]
    # Every command finishes: a rank killed on purpose is excluded by a restart the others recover
    # from, and the launcher says so and exits 0 (python -m inprocess.launch --strict: the rank's 137).
    assert res.returncode == 0, (res.returncode, out[-6000:])
    if "sigkill@" in command:
        assert "killed by SIGKILL, excluded by a restart; exit status 0" in out, out[-6000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_timeline_of_the_demo_is_drawn_as_written(tmp_path: pathlib.Path) -> None:
    demo, timeline = [c for c in RUN_HERE if "/tmp/ev" in c]
    res = run_as_written(demo, tmp_path, timeout=200)
    assert res.returncode == 0 and RUN_HERE[demo] in res.stdout + res.stderr, (res.stdout + res.stderr)[-6000:]
    if importlib.util.find_spec("matplotlib") is None:
        # The README installs it first; without it --png must say so, and the trace is still written.
        res = run_as_written(timeline, tmp_path)
        assert res.returncode != 0 and "matplotlib" in res.stdout + res.stderr, res.stdout + res.stderr
        res = run_as_written(timeline.replace(" --png", ""), tmp_path)
    else:
        res = run_as_written(timeline, tmp_path)
        assert (tmp_path / "ev" / "timeline.png").exists()
    assert res.returncode == 0, res.stdout + res.stderr
    assert RUN_HERE[timeline] in res.stdout
    assert (tmp_path / "ev" / "timeline.trace.json").exists()
