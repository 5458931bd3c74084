"""The wire's one schema (python/inprocess/control/keys.py): every store key is built there and listed in
its table; nothing else in the package spells a key, and what the protocol really sends matches the table."""

from __future__ import annotations

import ast
import datetime
import inspect
import pathlib
import re
import threading
from typing import Any

import pytest
import torch.distributed as dist

from inprocess.control import keys
from inprocess.control.joining import Announcement, JoinKeys, admit
from inprocess.control.membership import Membership
from inprocess.control.protocol import FaultRecord, RestartProtocol, done_key, monitor_heartbeat_key
from inprocess.control.recovery_plan import seated
from inprocess.control.store_ops import CountingStore
from inprocess.rank_assignment import ActivateAllRanks, Compose, ShiftRanks, decide

pytestmark = pytest.mark.timeout(60)

PACKAGE = pathlib.Path(keys.__file__).resolve().parent.parent
TABLE = keys.__doc__ or ""


def _table_rows() -> list[tuple[str, str]]:
    """(key, built by) of every row of the module docstring's table."""
    rows = []
    for line in TABLE.splitlines():
        m = re.match(r"^``([^`]+)``\s+``([^`]+)``", line)
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def _builders() -> set[str]:
    """Every public key builder of the schema module: CallKeys' methods, the functions and constants."""
    names = {f"CallKeys.{n}" for n, f in inspect.getmembers(keys.CallKeys, inspect.isfunction)
             if not n.startswith("_")}
    names |= {n for n, f in inspect.getmembers(keys, inspect.isfunction) if f.__module__ == keys.__name__
              and not n.startswith("_") and n != "call_prefix"}  # the prefix, not a key: the docstring's prose
    names |= {n for n, v in vars(keys).items() if n.isupper() and not n.startswith("_") and isinstance(v, str)}
    return names


def test_every_key_builder_is_in_the_table_and_every_row_has_one() -> None:
    listed = {built_by for _, built_by in _table_rows()}
    assert listed == _builders(), (f"missing from the table: {sorted(_builders() - listed)}; "
                                   f"in the table without a builder: {sorted(listed - _builders())}")
    iteration_rows = {k.split("/", 1)[1] for k, b in _table_rows() if b == "CallKeys.iteration"}
    assert iteration_rows == set(keys.ITERATION_KEYS) - {"decision"} | set(keys.GROW_KEYS)
    assert any(k == "<i>/decision" for k, _ in _table_rows())


# A key's parts as the table names them; a string of the package that holds one of them next to a "/" builds
# a key (log messages and help texts hold spaces, keys never do).
_KEY_PART = re.compile(
    r"(^|/)(seat|monitors|joiner|joiners(\.\w+)?|topology|done|user|running|store_host|rank_assignment|event|"
    r"faults|completed|arrivals|ready|terminated|decision(\.\w*)?|lead\.\w*|left|given_up|grow_at|grow_arrivals|"
    r"per_key)(/|$)|^inprocess/")


def _key_like_strings(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                                           ast.Constant):
            docstrings.add(id(body[0].value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            and "/" in node.value and not re.search(r"\s", node.value) and _KEY_PART.search(node.value)]


def test_no_key_is_spelled_outside_the_schema_module() -> None:
    found = {f"{p.relative_to(PACKAGE)}:{line}": text for p in sorted(PACKAGE.rglob("*.py"))
             if p.name != "keys.py" or p.parent.name != "control"
             for line, text in _key_like_strings(p.read_text())}
    assert found == {}, f"store keys built outside inprocess/control/keys.py: {found}"


def test_the_spelling_check_sees_a_key_built_elsewhere() -> None:
    """What the check above would have said of the join keys before the schema (joining.py built them)."""
    assert [text for _, text in _key_like_strings('k = f"{prefix}joiner/{token}/told"\n')] == ["joiner/"]
    assert _key_like_strings('log.info("rank %d left the job/slot")\n') == []  # a message, not a key
    assert _key_like_strings('k = f"{p}{i}/arrivals"\n') == [(1, "/arrivals")]


# -- what the protocol sends, against the table ---------------------------------------------------------------


def _pattern(key: str) -> str:
    text = re.escape(key)
    for hole, rx in (("<i>", r"\d+"), ("<t>", r"\d+"), ("<g>", r"\d+"), ("<r>", r"\d+"), ("<call>", r"\d+"),
                     ("<token>", r"[^/]+"), ("\\.\\.\\.", r".*")):
        text = text.replace(re.escape(hole) if hole.startswith("<") else hole, rx)
    return text


def _matches_the_table(key: str, prefix: str) -> bool:
    for row, _ in _table_rows():
        absolute = row.startswith("inprocess/")
        if re.fullmatch(_pattern(row) if absolute else re.escape(prefix) + _pattern(row), key):
            return True
    return False


def _record_keys(monkeypatch: pytest.MonkeyPatch, seen: set[str]) -> None:
    """Every key the protocol's counted store operations name (control/store_ops.py: all its calls go there)."""
    for name in ("set", "get", "add", "append", "compare_set", "check", "wait", "delete_key", "multi_get",
                 "multi_set", "compare_set_many", "peek", "wait_key", "get_blocking"):
        original = getattr(CountingStore, name)

        def recording(self: Any, first: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if isinstance(first, str):
                seen.add(first)
            else:  # a list of keys, or of (key, expected, desired)
                seen.update(k if isinstance(k, str) else k[0] for k in first)
            return __original(self, first, *args, **kwargs)

        monkeypatch.setattr(CountingStore, name, recording)


def test_what_a_restart_with_a_joiner_sends_is_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Barrier 0 of 4 ranks, a fault, the restart barrier without the faulty rank, a joiner announced for its
    seat and admitted at the next restart's barrier, the job's end: every key the protocol touched matches a
    row of the table (under the call's prefix, in an incarnation)."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
    seen: set[str] = set()
    _record_keys(monkeypatch, seen)
    n, call, incarnation = 4, 3, "slurm.7.0.0"
    ra = Compose(ActivateAllRanks(), ShiftRanks())
    protocols = [RestartProtocol(server.clone(), call, initial_world_size=n, incarnation=incarnation)
                 for _ in range(n)]
    membership: list[Any] = [None]

    def barrier(i: int, ranks: list[int], dead: set[int], expected: int, joins: bool = False) -> None:
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            p = protocols[r]

            def decide_fn(excluded: set[int], faults: list[FaultRecord], leader: int) -> Any:
                previous = membership[0] if membership[0] is not None else Membership.all_active(n)
                joined = []
                if joins:
                    joined = admit(JoinKeys(p.counted, call, incarnation), i, previous, {"f": "x"},
                                   seat_table=p.seat_table, publish_keys=p.topology.publish)
                d = decide(ra, seated(previous, joined), excluded, faults, i, leader)
                d.joined = joined
                return d

            try:
                membership_out = p.barrier(i, r, expected, terminated=r in dead, timeout=15, decide=decide_fn)
                if membership_out is not None:
                    membership[0] = membership_out.membership
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not errors, errors

    barrier(0, list(range(n)), set(), n)
    protocols[2].report_fault(FaultRecord(2, 0, "exception", "RuntimeError", "boom"))
    protocols[0].wait_event(0, 5)
    barrier(1, list(range(n)), {2}, n)
    joiner = RestartProtocol(server.clone(), call, initial_world_size=n, incarnation=incarnation)
    JoinKeys(joiner.counted, call, incarnation).announce(Announcement("host-1-ab", 2, "host", 1, {"f": "x"}, None))
    protocols[1].report_fault(FaultRecord(1, 1, "exception", "RuntimeError", "again"))
    barrier(2, [0, 1, 3], {1}, 3, joins=True)
    assert membership[0].mode[2] != membership[0].mode[1]  # the joiner took seat 2; rank 1 left
    for r in (0, 3):
        protocols[r].leave(2, 2)
    seen.update({done_key(call, incarnation), monitor_heartbeat_key(call, 0, incarnation)})

    prefix = keys.call_prefix(call, incarnation)
    assert len(seen) > 20, sorted(seen)  # the scenario reached the store
    assert {k for k in seen if not _matches_the_table(k, prefix)} == set()
    for part in ("/arrivals", "/decision", "/event", "/faults", "seat/", "joiner/", "joiners"):
        assert any(part in k for k in seen), (part, sorted(seen))
    assert not _matches_the_table(prefix + "2/no_such_key", prefix)  # the match can fail
