"""The README's "Two commands" are the demo and the test command, and `.ci/run` runs the test
command exactly as the README writes it.

Every other block of the README and of docs/ is checked by tests/test_docs_pages.py (each says
whether it runs) and run by tests/test_docs_commands.py; the demo's command is covered by
tests/test_wheel.py (the install) and tests/test_demo.py (the demo itself)."""

from __future__ import annotations

from test_docs_pages import ROOT, read_blocks

README = ROOT / "README.md"
DEMO_COMMAND = "pip install torch==2.13.0 && pip install . && python examples/demo.py"
# The README's second command: the whole suite. .ci/run runs exactly this line.
TEST_COMMAND = 'pip install torch==2.13.0 && pip install ".[test,test-gpu-abi]" && python -m pytest'


def section_lines(title: str) -> range:
    """The README's lines (1-based) under ``## title``, up to the next heading of that level."""
    lines = README.read_text().splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return range(start + 1, end + 1)


def two_commands() -> list[str]:
    inside = section_lines("Two commands")
    return [b.text.strip() for b in read_blocks(README) if b.line in inside and b.language == "bash"]


def test_the_two_commands_are_the_demo_and_the_suite() -> None:
    assert two_commands() == [DEMO_COMMAND, TEST_COMMAND]


# What .ci/run adds around the README's test command: the emulated SLURM cluster of tools/slurm_cluster.py
# (tests/test_slurm_real.py), started before the suite, stopped on every exit, and required by the suite.
CI_SLURM = [
    "python3 tools/slurm_cluster.py start",
    "trap 'python3 tools/slurm_cluster.py stop' EXIT",
    "export INPROCESS_SLURM_REQUIRED=1",
]


def test_ci_runs_the_readmes_test_command() -> None:
    """.ci/run runs the README's test command and nothing else (no install of its own, no system edit)
    but the SLURM cluster that tests/test_slurm_real.py runs its jobs on."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', *CI_SLURM, TEST_COMMAND], commands
    assert TEST_COMMAND in two_commands()

