"""A misspelt INPROCESS_* variable is warned about with the nearest known name (inprocess/environment.py)."""

from __future__ import annotations

import logging
import pathlib
import re

import pytest

from inprocess import environment

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_misspelt_variable_is_named_with_the_one_it_misspells():
    found = environment.unknown({"INPROCESS_FAULT": "sigkill@rank=1,step=3", "INPROCESS_FAULTS_X": "1",
                                 "INPROCESS_EVENT_DIR": "/tmp/e", "INPROCESS_FAULTS": "", "PATH": "/bin"})
    assert found == [("INPROCESS_EVENT_DIR", "INPROCESS_EVENTS_DIR"), ("INPROCESS_FAULT", "INPROCESS_FAULTS"),
                     ("INPROCESS_FAULTS_X", "INPROCESS_FAULTS")]


def test_a_name_far_from_every_known_one_lists_them():
    assert environment.unknown({"INPROCESS_ZZZZZZZZZZZZ": "1"}) == [("INPROCESS_ZZZZZZZZZZZZ", None)]
    lines = environment.warn_unknown({"INPROCESS_ZZZZZZZZZZZZ": "1"})
    assert "the library reads INPROCESS_EVENTS_DIR, INPROCESS_FAULTS" in lines[0]


def test_the_warning_comes_once_per_name(caplog: pytest.LogCaptureFixture):
    env = {"INPROCESS_RESTART_STROM": "off"}
    with caplog.at_level(logging.WARNING, logger="inprocess"):
        first = environment.warn_unknown(env)
        again = environment.warn_unknown(env)
    assert again == [] and len(first) == 1
    assert caplog.messages == [
        "environment variable INPROCESS_RESTART_STROM is set but inprocess does not read it, so it has no effect: "
        "did you mean INPROCESS_RESTART_STORM (the restart storm brake's limits, or off (inprocess.engine.storm))?"]


def test_the_suites_own_variables_are_no_warning():
    assert environment.unknown({"INPROCESS_TEST_OUT": "/tmp", "INPROCESS_BENCH_RUN": "1",
                                "INPROCESS_NVRX_EXAMPLES": "/x"}) == []


def test_every_variable_the_library_source_names_is_listed():
    """The list cannot go stale: a name the library reads (or sets) that is not listed fails here."""
    # This module's and this file's misspellings are examples, not variables.
    # The checkout's source is searched (the package imported may be an installed copy of it).
    skip = {ROOT / "python" / "inprocess" / "environment.py", pathlib.Path(__file__).resolve()}
    names = set()
    for path in (ROOT / "python" / "inprocess").rglob("*.py"):
        if path not in skip:
            names |= set(re.findall(r"\bINPROCESS_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert len(names) >= 8, f"{sorted(names)}: the search is broken"
    assert {n for n in names if not environment.known(n)} == set()
    for path in [*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        if path not in skip:
            names |= set(re.findall(r"\bINPROCESS_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert {n for n in names if not environment.known(n)} == set()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_job_with_a_misspelt_fault_variable_says_so(job):
    res = job({"steps": 3}, world_size=2, env={"INPROCESS_FAULT": "exception@rank=1,step=1"})
    assert res.returncodes == [0, 0], res.describe()
    out = res.describe()
    assert out.count("environment variable INPROCESS_FAULT is set but inprocess does not read it, so it has "
                     "no effect: did you mean INPROCESS_FAULTS") == 2, out  # once per process
