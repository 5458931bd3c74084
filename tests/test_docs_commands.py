"""The runnable blocks of the user's pages (README.md, docs/*.md) run as written, and show what the page says.

A block marked ``<!-- docs: run; expect "..." -->`` (docs/development.md, "Checking the docs") runs
in a fresh directory holding the page's ``file`` blocks and a link to ``examples/``, with this
interpreter's ``bin`` first on PATH (so ``python`` and ``torchrun`` are the ones with the package
installed). Each has a time limit (its ``timeout``), its process group is killed when it runs out,
and every process it started is killed at the end: a command that leaves something running fails."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from test_docs_pages import ROOT, Block, all_blocks, read_blocks
from test_torchrun import reap_marked

MARKER_VAR = "INPROCESS_DOCS_TEST"


def run_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.marker is not None and b.marker.kind == "run"]


def params() -> list[object]:
    out: list[object] = []
    for block in run_blocks():
        assert block.marker is not None
        marks = [pytest.mark.multiprocess, pytest.mark.timeout(block.marker.timeout_s + 60)]
        if block.marker.slow:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(block, id=block.where, marks=marks))
    return out


def bin_dirs(tmp_path: pathlib.Path) -> list[str]:
    """This interpreter's bin directory, and a torchrun there if pip put none beside it."""
    dirs = [str(pathlib.Path(sys.executable).parent)]
    if not (pathlib.Path(sys.executable).parent / "torchrun").exists():
        shim = tmp_path / "bin"
        shim.mkdir()
        (shim / "torchrun").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
        (shim / "torchrun").chmod(0o755)
        dirs.append(str(shim))
    return dirs


def workdir(block: Block, tmp_path: pathlib.Path) -> pathlib.Path:
    """A fresh directory with the page's ``file`` blocks and the repository's examples."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    for other in read_blocks(block.page):
        if other.marker is not None and other.marker.kind == "file":
            (work / other.marker.name).write_text(other.text)
    return work


def run(block: Block, tmp_path: pathlib.Path) -> tuple[int, str]:
    assert block.marker is not None
    work = workdir(block, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INPROCESS_")}
    env[MARKER_VAR] = str(tmp_path)
    env["PATH"] = os.pathsep.join([*bin_dirs(tmp_path), env.get("PATH", "")])
    if block.language == "python":
        script = work / f"block_{block.line}.py"
        script.write_text(block.text)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.text]
    proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=block.marker.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.where}: still running after {block.marker.timeout_s} s:\n{out[-6000:]}")
    finally:
        left = reap_marked(f"{MARKER_VAR}={tmp_path}")
    assert not left, f"{block.where}: processes left running after the block ended (killed now): {left}"
    return proc.returncode, out


@pytest.mark.parametrize("block", params())
def test_the_block_runs_as_written(block: Block, tmp_path: pathlib.Path) -> None:
    assert block.marker is not None
    status, out = run(block, tmp_path)
    assert status == block.marker.exit_status, f"{block.where}: exit status {status}:\n{out[-6000:]}"
    missing = [text for text in block.marker.expect if text not in out]
    assert not missing, f"{block.where}: the output lacks {missing}:\n{out[-6000:]}"
