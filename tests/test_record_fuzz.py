"""Every record a rank, a monitor or a node agent reads back from the store, fuzzed.

The store is shared and unauthenticated: a record may be truncated (a writer killed mid-way),
corrupted or hostile. Each parser must accept exactly what the protocol writes and refuse the
rest with a clear error (InternalError for a decision or a membership, an "unreadable" record for
a fault line), never run anything, never hang. Hypothesis draws random bytes, truncations of
valid records, and valid records with one field swapped for a value of the wrong type or range.
A test counts what it tried (printed with -s; benchmarks/README.md quotes the counts).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inprocess.control.membership import NONE, Membership
from inprocess.control.records import Decision, FaultRecord
from inprocess.exception import InternalError
from inprocess.state import Mode

pytestmark = pytest.mark.timeout(300)

TRIED: dict[str, int] = {}


def tried(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


def valid_decision(n: int = 6) -> Decision:
    m = Membership.all_active(n)
    m.terminate([2])
    m.deactivate(n - 1)
    # Renumber like an assignment would, so the table stays consistent.
    alive = [r for r in range(n) if m.mode[r] != int(Mode.TERMINATED)]
    for new, r in enumerate(alive):
        m.rank[r] = new
    active = [r for r in alive if m.mode[r] == int(Mode.ACTIVE)]
    for r in range(n):
        m.active_rank[r] = active.index(r) if r in active else NONE
    faults = [FaultRecord(2, 0, "killed", "SIGKILL", "rank process 123 died", "h", 17),
              FaultRecord(1, 0, "after_restart", "RuntimeError", "Connection closed by peer", "h", 18)]
    return Decision(1, m, [2], faults, 2, 0, None, 99, "h", 5)


VALID = valid_decision().to_json().encode()
VALID_FAULT = FaultRecord(3, 4, "exception", "ValueError", "x", "host", 12).to_json()


def parse_decision(raw: bytes) -> None:
    """Parses ``raw`` or raises InternalError; anything else (or a hang) fails the test."""
    start = time.monotonic()
    try:
        d = Decision.from_json(raw)
    except InternalError as e:
        assert "corrupted decision record" in str(e)
    else:
        # Accepted: then it is a decision the protocol could have written, and means what it prints.
        assert Decision.from_json(d.to_json().encode()).to_json() == d.to_json()
        assert 0 <= d.leader < max(d.membership.initial_world_size, 1)
    assert time.monotonic() - start < 2


def test_a_valid_decision_round_trips() -> None:
    d = Decision.from_json(VALID)
    assert d.to_json().encode() == VALID
    assert d.membership == valid_decision().membership


def ends_job_parsed(raw: bytes) -> bool:
    """ends_job's answer read from the whole document."""
    fields = json.loads(raw)
    return fields["abort"] is not None or fields["ws"] <= 0


@pytest.mark.parametrize("abort", [None, "null", 'an "abort": null, quoted', ""])
@pytest.mark.parametrize("active", [True, False])
def test_ends_job_reads_the_head_as_the_whole_document_says(abort: Any, active: bool) -> None:
    d = valid_decision()
    d.abort = abort
    if not active:
        d.membership.mode = [int(Mode.TERMINATED)] * len(d.membership.mode)
    raw = d.to_json().encode()
    assert raw.startswith(b'{"i":1,"n":6,"ws":')  # the head that ends_job reads without parsing
    assert Decision.ends_job(raw) == ends_job_parsed(raw) == (abort is not None or not active)
    # Another writer's layout (fields reordered, spaces) is parsed in full, to the same answer.
    fields = json.loads(raw)
    other = json.dumps(dict(reversed(list(fields.items())))).encode()
    assert not other.startswith(b'{"i":') and Decision.ends_job(other) == ends_job_parsed(raw)
    spaced = json.dumps(fields, indent=1).encode()
    assert Decision.ends_job(spaced) == ends_job_parsed(raw)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_are_never_a_decision(raw: bytes) -> None:
    tried("decision: random bytes")
    parse_decision(raw)


@settings(max_examples=len(VALID) + 1, deadline=None)
@given(st.integers(0, len(VALID) - 1))
def test_every_truncation_of_a_decision_is_refused(cut: int) -> None:
    tried("decision: truncated")
    with pytest.raises(InternalError, match="corrupted decision record"):
        Decision.from_json(VALID[:cut])


# Values of every JSON type, and the protocol's own types out of range.
_WRONG = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.integers(-(2**70), 2**70), st.lists(st.integers(-3, 3), max_size=6), st.just({}),
    st.just([[0, 6, 1, 0, 0]]), st.just("NaN"),
)
_DECISION_FIELDS = sorted(json.loads(VALID))


def _swap(d: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    target: Any = d
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return d


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_decision_with_one_wrong_field_is_refused_or_still_consistent(data: st.DataObject) -> None:
    tried("decision: one field wrong")
    d = json.loads(VALID)
    field = data.draw(st.sampled_from(_DECISION_FIELDS + ["runs.0", "runs.1.2", "faults.0", "faults.1.rank",
                                                          "faults.0.t_ns", "faults.1.message", "terminated.0"]))
    path: list[Any] = [int(p) if p.isdigit() else p for p in field.split(".")]
    bad = _swap(d, path, data.draw(_WRONG))
    parse_decision(json.dumps(bad).encode())


@pytest.mark.parametrize("raw", [
    b'{"i":1,"n":Infinity}', b'{"i":NaN}', b"[" * 100_000 + b"]" * 100_000, b'{"i":1e999}',
    b'{"i":1,"n":4194305,"runs":[[0,4194305,1,0,0]]}',  # more ranks than any job
    VALID.replace(b'"abort":null', b'"abort":["__import__(\'os\').system(\'false\')"]'),
    VALID.replace(b'"leader":0', b'"leader":true'),
    VALID.replace(b'"leader":0', b'"leader":"0"'),
    VALID.replace(b'"leader":0', b'"leader":0.0'),
    VALID.replace(b'"leader":0', b'"leader":6'),
    VALID.replace(b'"terminated":[2]', b'"terminated":[-1]'),
    VALID.replace(b'"i":1', b'"i":-1'),
    b"\x80\x04\x95" + VALID,  # a pickle header: never unpickled
])
def test_named_garbage_is_refused(raw: bytes) -> None:
    tried("decision: named garbage")
    start = time.monotonic()
    with pytest.raises(InternalError, match="corrupted decision record"):
        Decision.from_json(raw)
    assert time.monotonic() - start < 2


# -- membership runs -------------------------------------------------------------------------------

_RUN_VALUES = st.one_of(st.integers(-3, 12), st.just(2**40), st.booleans(), st.none(), st.text(max_size=2))


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(_RUN_VALUES, min_size=0, max_size=6), max_size=6), st.integers(0, 10))
def test_membership_runs_decode_strictly(runs: list[list[Any]], n: int) -> None:
    tried("membership: random runs")
    try:
        m = Membership.decode(runs, n)
    except InternalError:
        return
    assert m.initial_world_size == n
    assert Membership.decode(m.encode(), n) == m  # what was accepted is what it encodes to
    for r in range(n):
        assert m.mode[r] in {int(x) for x in Mode}
        assert m.rank[r] == NONE or 0 <= m.rank[r] < n
        assert m.active_rank[r] == NONE or 0 <= m.active_rank[r] < n


# -- fault records (JSON lines of a faults key) ----------------------------------------------------


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=300), st.integers(0, len(VALID_FAULT)).map(lambda k: VALID_FAULT[:k]),
                 st.builds(lambda field, value: json.dumps({**json.loads(VALID_FAULT), field: value}),
                           st.sampled_from(sorted(json.loads(VALID_FAULT))), _WRONG)))
def test_fault_lines_parse_or_become_unreadable_records(raw: str) -> None:
    tried("fault lines")
    start = time.monotonic()
    records = FaultRecord.parse_lines(raw, 7)
    assert time.monotonic() - start < 2
    for line, record in zip([x for x in raw.splitlines() if x], records, strict=True):
        if record.kind == "unreadable":
            assert record.rank == -1 and record.iteration == 7 and record.message == line[:300]
        else:
            # Accepted: every field has the protocol's type, and it prints back to the same record.
            assert FaultRecord.from_dict(json.loads(record.to_json())) == record
            assert all(isinstance(getattr(record, f), str) for f in ("kind", "type", "message", "host"))
            assert type(record.rank) is int and type(record.t_ns) is int and record.iteration >= 0


def test_a_fault_line_with_an_infinite_number_is_unreadable_not_a_crash() -> None:
    tried("fault lines")
    line = VALID_FAULT.replace('"t_ns":12', '"t_ns":Infinity')
    (record,) = FaultRecord.parse_lines(line, 3)
    assert record.kind == "unreadable"
    (nested,) = FaultRecord.parse_lines("[" * 50_000, 3)
    assert nested.kind == "unreadable"


def test_zz_report_the_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs last in this module (by name): prints how many inputs each parser was given."""
    if not TRIED:
        pytest.skip("nothing to count: the fuzz tests of this module were not run in this session")
    with capsys.disabled():
        print("\nbad inputs tried per parser:", json.dumps(TRIED, sort_keys=True), "total", sum(TRIED.values()))
