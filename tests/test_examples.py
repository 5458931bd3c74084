"""The examples of ``examples/`` run as the README shows them, on CPU/gloo, with faults
injected through ``INPROCESS_FAULTS`` (the examples themselves hold no fault code)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from conftest import leftover_processes
from inprocess.launch import LocalJob
from test_torchrun import reap_marked

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def run_example(argv: list[str], faults: str, world_size: int = 4, port: int | None = None,
                timeout: float = 120.0) -> list[tuple[int, str]]:
    env = {"INPROCESS_FAULTS": faults} if faults else {}
    with LocalJob(argv, world_size, env=env, port=port) as job:
        ranks = job.wait(timeout)
        assert not leftover_processes({r.popen.pid for r in ranks}, grace=10.0), job.outputs()[-5000:]
    return [(r.returncode or 0, r.output) for r in ranks]


def test_minimal_wraps_main_as_it_is_and_restarts_it_from_the_beginning() -> None:
    # 400 steps take about 3 s here: the fault at 0.5 s always comes before the end (100 steps once
    # finished in 0.8 s on an idle machine, before a fault at 1 s).
    ranks = run_example([str(EXAMPLES / "minimal.py"), "--steps", "400"],
                        "exception@rank=2,after=0.5s")
    codes = [rc for rc, _ in ranks]
    everything = "\n".join(out for _, out in ranks)
    assert codes == [0, 0, 0, 0], everything[-8000:]
    # One restart, summarised once (WARNING, lowest active rank), and the run finished from the start.
    summaries = [line for line in everything.splitlines() if "restart after iteration 0: cause:" in line]
    assert len(summaries) == 1 and "excluded: none; now 4 active of 4" in summaries[0], everything[-8000:]
    assert "[minimal] 400 steps in" in ranks[0][1], ranks[0][1]


def test_minimal_summary_names_the_injected_exception_as_the_cause() -> None:
    ranks = run_example([str(EXAMPLES / "minimal.py"), "--steps", "400"], "exception@rank=2,after=0.5s")
    everything = "\n".join(out for _, out in ranks)
    summaries = [line for line in everything.splitlines() if "restart after iteration 0: cause:" in line]
    # In about 1 run in 4 the exception, raised as ProcessGroupGloo(...) returns, destroys the new group and
    # rank 1's first collective requests the restart before the exception is out of main() (restart_record).
    cause = re.compile(r"cause: rank 2 exception( \(out after the restart began\))?: InjectedException")
    assert len(summaries) == 1 and cause.search(summaries[0]), everything[-8000:]


def test_optimal_resumes_from_its_checkpoint_after_an_exception_and_a_sigkill() -> None:
    ranks = run_example([str(EXAMPLES / "optimal.py"), "--steps", "300"],
                        "exception@rank=2,step=60;sigkill@rank=1,step=150,iteration=1")
    codes = [rc for rc, _ in ranks]
    everything = "\n".join(out for _, out in ranks)
    assert codes == [0, -signal.SIGKILL, 0, 0], everything[-8000:]
    assert "[optimal] 300 steps done in iteration 2 (2 restarts)" in ranks[0][1], everything[-8000:]
    # Resumed from the checkpoint, not from step 0 (one step back where a restart caught a rank before its commit).
    assert re.search(r"iteration 1: 4 ranks resume at step (59|60)\b", ranks[0][1]), ranks[0][1]
    assert re.search(r"iteration 2: 3 ranks resume at step (149|150)\b", ranks[0][1]), ranks[0][1]
    for rank in (0, 2, 3):
        assert re.search(r"\[optimal\] rank \d done in", ranks[rank][1]), ranks[rank][1]


@pytest.mark.parametrize("faults", ["sigkill@rank=1,step=40", ""], ids=["a_rank_killed", "no_fault"])
def test_a_spare_takes_over_from_a_killed_rank(faults: str) -> None:
    ranks = run_example([str(EXAMPLES / "spares.py"), "--steps", "80"], faults)
    everything = "\n".join(out for _, out in ranks)
    if faults:
        assert [rc for rc, _ in ranks] == [0, -signal.SIGKILL, 0, 0], everything[-8000:]
        assert "spares activated: [3]" in everything
        assert "initial rank 3 takes over as active rank 2 in iteration 1" in ranks[3][1], everything[-8000:]
        assert "80 steps done on 3 active ranks in iteration 1" in everything
    else:
        assert [rc for rc, _ in ranks] == [0, 0, 0, 0], everything[-8000:]
        assert "initial rank 3: spare, never activated" in ranks[3][1], everything[-8000:]
        assert "80 steps done on 3 active ranks in iteration 0" in everything


def under_torchrun(tmp_path: pathlib.Path, example: str, nproc: int, env: dict[str, str], *args: str,
                   max_restarts: int = 0, timeout: float = 120) -> str:
    """An example under torchrun (standalone), in `tmp_path`; its output, once it ended with 0 and
    left nothing running."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, INPROCESS_EXAMPLE_TEST=str(tmp_path), **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", str(EXAMPLES / example), *args]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=tmp_path)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        left = reap_marked(f"INPROCESS_EXAMPLE_TEST={tmp_path}")
    assert proc.returncode == 0, out[-8000:]
    assert not left, left
    return out


def test_optimal_under_torchrun_restarts_in_process(tmp_path: pathlib.Path) -> None:
    faults = {"INPROCESS_FAULTS": "exception@rank=3,step=50", "LOGLEVEL": "INFO"}
    out = under_torchrun(tmp_path, "optimal.py", 4, faults, "--steps", "150", max_restarts=1)
    assert "[optimal] 150 steps done in iteration 1 (1 restarts)" in out, out[-8000:]
    assert "will restart worker group" not in out


@pytest.mark.timeout(240)
def test_the_nccl_example_resumes_from_memory_and_ends_as_the_job_without_the_fault(tmp_path: pathlib.Path) -> None:
    """The GPU example's recovery, on the CPU under torchrun: rank 1 fails at step 20, both ranks
    restart in-process from step 20 (ReplicatedState, no checkpoint), and every rank ends with the
    parameters of the run without a fault, bitwise."""
    clean = under_torchrun(tmp_path / "clean", "nccl_ddp.py", 2, {"INPROCESS_FAULTS": "", "EXAMPLE_STEPS": "40"})
    faulty = under_torchrun(tmp_path / "faulty", "nccl_ddp.py", 2,
                            {"INPROCESS_FAULTS": "exception@rank=1,step=20", "EXAMPLE_STEPS": "40"})
    digests = {out: {line.rsplit("digest ", 1)[1] for line in out.splitlines() if "steps done" in line}
               for out in (clean, faulty)}
    assert len(digests[clean]) == 1 and digests[clean] == digests[faulty], (clean[-4000:], faulty[-4000:])
    assert "40 steps done in iteration 0 on 2 ranks" in clean, clean[-4000:]
    for rank in (0, 1):
        resumed = f"initial rank {rank}: iteration 1, rank {rank} of 2 on cpu (gloo), from step 20"
        assert resumed in faulty, faulty[-4000:]
        assert f"initial rank {rank}: 40 steps done in iteration 1 on 2 ranks" in faulty, faulty[-4000:]
    assert "will restart worker group" not in faulty  # in-process, not torchrun's restart
