"""The torch-free TCPStore client against real torch TCPStore servers (both backends).

Most tests run a torch server on 127.0.0.1 (port 0), a torch client and our
client on it, and checks that what one writes the other reads, and that our
client's answers are torch's answers.
"""

from __future__ import annotations

import builtins
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from inprocess.control import protocol
from inprocess.control.tcpstore_client import (
    MAX_KEY_BYTES,
    MAX_KEYS_PER_REQUEST,
    MAX_VALUE_BYTES,
    PIPELINE_BATCH,
    StoreConnectionError,
    StoreTimeoutError,
    TCPStoreClient,
)
from inprocess.control.tcpstore_wire import Value

HOST = "127.0.0.1"
# Generous: torch's server resolves the name of every client it accepts in its
# only thread; where no DNS server answers (this sandbox) that blocks the whole
# server for 5 s now and then, for torch's clients as for ours.
TIMEOUT = timedelta(seconds=30)


@pytest.fixture(params=[True, False], ids=["libuv", "legacy"])
def use_libuv(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture
def server(use_libuv: bool) -> Iterator[dist.TCPStore]:
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=use_libuv, timeout=TIMEOUT)
    yield store
    del store


@pytest.fixture
def theirs(server: dist.TCPStore, use_libuv: bool) -> dist.TCPStore:
    """torch's own client on the server."""
    return dist.TCPStore(HOST, server.port, is_master=False, wait_for_workers=False, use_libuv=use_libuv,
                         timeout=TIMEOUT)


@pytest.fixture
def ours(server: dist.TCPStore) -> Iterator[TCPStoreClient]:
    client = TCPStoreClient(HOST, server.port, timeout=TIMEOUT, connect_timeout=TIMEOUT)
    yield client
    client.close()


def _flush(client: object) -> None:
    """A round trip on ``client``'s connection.

    set, append and multi_set get no reply: until the writer makes a call that
    does, the server may serve another connection's later request first (for
    torch's client as for ours).
    """
    client.check([])  # type: ignore[attr-defined]


def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
        out["t"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# -- no torch -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_module_imports_and_works_without_torch(server: dist.TCPStore) -> None:
    code = (
        "import sys\n"
        "from inprocess.control.tcpstore_client import TCPStoreClient\n"
        f"c = TCPStoreClient('{HOST}', int(sys.argv[1]), timeout=10)\n"
        "c.set('from_child', 'hello')\n"
        "assert c.get('from_parent') == b'parent'\n"
        "assert c.add('child_counter', 2) == 2\n"
        "c.wait(['from_parent'])\n"
        "c.close()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
        "print('ok')\n"
    )
    server.set("from_parent", "parent")
    done = subprocess.run([sys.executable, "-c", code, str(server.port)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert server.get("from_child") == b"hello"


@pytest.mark.timeout(60)
def test_the_client_and_its_wire_module_stand_alone_without_torch(tmp_path) -> None:
    # The four files, copied into a package of their own, work without torch and without inprocess.
    import inprocess.control.store_errors as errors
    import inprocess.control.tcpstore_client as client
    import inprocess.control.tcpstore_connect as connect
    import inprocess.control.tcpstore_wire as wire

    package = tmp_path / "storeclient"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module in (client, connect, wire, errors):
        shutil.copy(module.__file__, package / pathlib.Path(module.__file__).name)
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from storeclient.tcpstore_client import StoreTimeoutError, TCPStoreClient\n"
        "assert issubclass(StoreTimeoutError, TimeoutError)\n"
        "assert 'torch' not in sys.modules and 'inprocess' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr


# -- values cross between the clients ------------------------------------------------


@pytest.mark.timeout(60)
def test_set_get_both_ways(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    every_byte = bytes(range(256))
    ours.set("a", "text")
    ours.set("b", every_byte)
    ours.set("empty", b"")
    ours.set("unicode", "naïve ✓")
    assert theirs.get("a") == b"text"
    assert theirs.get("b") == every_byte
    assert theirs.get("empty") == b""
    assert theirs.get("unicode") == "naïve ✓".encode()
    theirs.set("c", every_byte[::-1])
    theirs.set("d", "from torch")
    assert ours.get("c") == every_byte[::-1]
    assert ours.get("d") == b"from torch"
    ours.set("a", "overwritten")
    _flush(ours)
    assert theirs.get("a") == b"overwritten"


@pytest.mark.timeout(60)
def test_add_matches_torch(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    # Mirror keys: the same sequence through each client gives the same answers.
    for client, prefix in ((ours, "o/"), (theirs, "t/")):
        client.set(prefix + "preset", "40")
    _flush(theirs)
    answers = {}
    for client, prefix in ((ours, "o/"), (theirs, "t/")):
        answers[prefix] = [
            client.add(prefix + "new", 1),
            client.add(prefix + "new", 5),
            client.add(prefix + "new", -10),
            client.add(prefix + "zero", 0),
            client.add(prefix + "preset", 2),
            client.add(prefix + "big", 1 << 62),
            client.add(prefix + "big", -(1 << 62) - 7),
        ]
    assert answers["o/"] == answers["t/"] == [1, 6, -4, 0, 42, 1 << 62, -7]
    for name in ("new", "zero", "preset", "big"):
        assert ours.get("o/" + name) == theirs.get("t/" + name)
    # Interleaved on one key: one counter.
    assert [ours.add("shared", 1), theirs.add("shared", 1), ours.add("shared", 1)] == [1, 2, 3]
    assert theirs.get("shared") == b"3"
    with pytest.raises(ValueError):
        ours.add("x", 1 << 63)


@pytest.mark.timeout(60)
def test_append_matches_torch(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    ours.append("log", "a,")
    _flush(ours)
    theirs.append("log", "b,")
    _flush(theirs)
    ours.append("log", b"c,")
    _flush(ours)
    assert theirs.get("log") == ours.get("log") == b"a,b,c,"
    ours.append("o/empty", "")
    theirs.append("t/empty", "")
    _flush(ours)
    _flush(theirs)
    assert ours.check(["o/empty", "t/empty"]) and theirs.check(["o/empty", "t/empty"])
    assert ours.get("t/empty") == theirs.get("o/empty") == b""


@pytest.mark.timeout(60)
def test_compare_set_matches_torch(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    # (preset value or None for a missing key, expected, desired)
    cases = {
        "missing_empty_expected": (None, "", "new"),
        "missing_nonempty_expected": (None, "x", "new"),
        "match": ("old", "old", "new"),
        "mismatch": ("old", "nope", "new"),
        "empty_value_empty_expected": ("", "", "new"),
        "value_empty_expected": ("old", "", "new"),
        "bytes": (b"\x00\x01", b"\x00\x01", b"\xff"),
    }
    results: dict[str, dict[str, tuple[bytes, bool, bytes]]] = {"o/": {}, "t/": {}}
    for client, prefix in ((ours, "o/"), (theirs, "t/")):
        for name, (preset, expected, desired) in cases.items():
            key = prefix + name
            if preset is not None:
                theirs.set(key, preset)
                _flush(theirs)
            answer = client.compare_set(key, expected, desired)
            exists = theirs.check([key])
            results[prefix][name] = (answer, exists, theirs.get(key) if exists else b"")
    assert results["o/"] == results["t/"]
    assert results["o/"]["missing_empty_expected"] == (b"new", True, b"new")
    assert results["o/"]["missing_nonempty_expected"] == (b"x", False, b"")
    assert results["o/"]["match"] == (b"new", True, b"new")
    assert results["o/"]["mismatch"] == (b"old", True, b"old")
    assert results["o/"]["empty_value_empty_expected"] == (b"new", True, b"new")
    assert results["o/"]["value_empty_expected"] == (b"old", True, b"old")
    # What protocol.py relies on: the first writer wins, everyone reads the winner.
    assert ours.compare_set("event", "", "restart") == b"restart"
    assert theirs.compare_set("event", "", "complete") == b"restart"
    assert ours.compare_set("event", "", "complete") == b"restart"


@pytest.mark.timeout(60)
def test_compare_set_many_answers_as_the_same_compare_sets_one_after_another(
        ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    """Pipelined (PIPELINE_BATCH per round trip), in order: each item sees the items before it,
    and what another client wrote first wins, as for compare_set one by one."""
    n = 2 * PIPELINE_BATCH + 7  # three batches, the last one short
    for i in range(0, n, 3):
        theirs.set(f"m/{i}", "pending")
    theirs.set("m/1", "gone")  # another client resolved this one first
    _flush(theirs)  # set has no reply: served before our requests only once a later call was answered
    items: list[tuple[str, Value, Value]] = [(f"m/{i}", "pending", f"admitted:{i}") for i in range(n)]
    items.append(("m/0", "pending", "again"))  # after its own item: it finds that item's write
    items.append(("m/2", "", "created"))  # a missing key with an empty expected value is created
    answers = ours.compare_set_many(items)
    assert len(answers) == n + 2
    for i in range(n):
        expected = f"admitted:{i}" if i % 3 == 0 else ("gone" if i == 1 else "pending")
        assert answers[i] == expected.encode(), i
    assert answers[n] == b"admitted:0" and answers[n + 1] == b"created"
    assert theirs.get("m/3") == b"admitted:3" and theirs.get("m/1") == b"gone" and not theirs.check(["m/4"])
    assert ours.compare_set_many([]) == []
    assert ours.get("m/2") == b"created"  # the connection is in step after the batches


@pytest.mark.timeout(60)
def test_compare_set_many_reads_large_answers_between_small_ones(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    """A compare_set that fails answers the value held: one far larger than a read chunk, between small
    answers of the same batch, comes back whole and the answers after it stay in step."""
    big = bytes(range(256)) * 1024  # 256 KiB: several reads of the socket
    theirs.set("cs/big", big)
    theirs.set("cs/small", "s")
    _flush(theirs)
    answers = ours.compare_set_many([("cs/a", "", "x"), ("cs/big", "not it", "y"), ("cs/small", "s", "t"),
                                     ("cs/big", "nor this", "z"), ("cs/b", "", "w")])
    assert answers == [b"x", big, b"t", big, b"w"]
    assert ours.get("cs/small") == b"t" and ours.add("cs/n", 2) == 2  # in step afterwards


@pytest.mark.timeout(60)
def test_wait_get_times_out_on_its_own_timeout(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    """wait_get's timeout bounds its wait, the store timeout is left as it was, the connection stays usable."""
    before = ours.timeout
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        ours.wait_get("wg/missing", 0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    assert ours.timeout == before
    thread, out = _in_thread(lambda: ours.wait_get("wg/late", timedelta(seconds=10)))
    time.sleep(0.1)
    theirs.set("wg/late", "here")
    thread.join(5)
    assert out.get("value") == b"here", out
    assert ours.add("wg/n", 1) == 1


@pytest.mark.timeout(60)
def test_check_delete_num_keys(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    assert ours.num_keys() == theirs.num_keys()
    ours.set("x", "1")
    theirs.set("y", "2")
    _flush(ours)
    _flush(theirs)
    assert ours.check(["x", "y"]) and theirs.check(["x", "y"])
    assert not ours.check(["x", "nope"]) and not theirs.check(["x", "nope"])
    assert ours.check([]) == theirs.check([]) == True  # noqa: E712
    assert ours.num_keys() == theirs.num_keys()
    assert ours.delete_key("y") is True  # written by torch
    assert not theirs.check(["y"])
    assert theirs.delete_key("x") is True  # written by us
    assert not ours.check(["x"])
    assert ours.delete_key("x") is False and theirs.delete_key("y") is False
    assert ours.num_keys() == theirs.num_keys()


@pytest.mark.timeout(60)
def test_multi_get_multi_set(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    ours.multi_set(["m1", "m2", "m3"], ["1", b"\x00two", ""])
    assert theirs.multi_get(["m1", "m2", "m3"]) == [b"1", b"\x00two", b""]
    theirs.multi_set(["n1", "n2"], ["a", "b"])
    assert ours.multi_get(["n2", "n1", "m1"]) == [b"b", b"a", b"1"]
    with pytest.raises(ValueError):
        ours.multi_set(["k1", "k2"], ["only one"])


@pytest.mark.timeout(60)
def test_large_values(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    one_mib = os.urandom(1 << 20)
    ours.set("big", one_mib)
    assert theirs.get("big") == one_mib
    theirs.set("big2", one_mib[::-1])
    assert ours.get("big2") == one_mib[::-1]
    assert ours.compare_set("big", one_mib, b"small") == b"small"
    ours.append("big2", one_mib)
    _flush(ours)
    assert theirs.get("big2") == one_mib[::-1] + one_mib
    assert ours.get("big2") == one_mib[::-1] + one_mib
    # Over the libuv server's limits: refused before sending, the connection lives on.
    with pytest.raises(ValueError, match="at most"):
        ours.set("huge", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(ValueError, match="at most"):
        ours.set("k" * MAX_KEY_BYTES, "v")
    ours.set("k" * (MAX_KEY_BYTES - 1), "longest key")
    assert theirs.get("k" * (MAX_KEY_BYTES - 1)) == b"longest key"
    many = [f"many/{i}" for i in range(MAX_KEYS_PER_REQUEST)]
    assert ours.check(many) is False
    with pytest.raises(ValueError, match="at most"):
        ours.check(many + ["one too many"])
    assert ours.ping() >= 0


# -- wait ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_wait_wakes_promptly(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    """A wait is woken by the server when another client sets the key: < 100 ms."""
    delays = []
    for i in range(5):
        key = f"wake/{i}"
        thread, out = _in_thread(lambda key=key: ours.wait([key], timedelta(seconds=10)))
        time.sleep(0.2)  # let the WAIT reach the server
        assert thread.is_alive(), out
        t_set = time.monotonic()
        theirs.set(key, "go")
        thread.join(5)
        assert not thread.is_alive() and "error" not in out, out
        delays.append(out["t"] - t_set)  # type: ignore[operator]
    assert statistics.median(delays) < 0.1, delays
    assert max(delays) < 0.5, delays


_WRITES: dict[str, Callable[[object, str], object]] = {
    "set": lambda c, k: c.set(k, "1"),  # type: ignore[attr-defined]
    "add": lambda c, k: c.add(k, 1),  # type: ignore[attr-defined]
    "append": lambda c, k: c.append(k, "x"),  # type: ignore[attr-defined]
    "compare_set": lambda c, k: c.compare_set(k, "", "x"),  # type: ignore[attr-defined]
    "multi_set": lambda c, k: c.multi_set([k], ["1"]),  # type: ignore[attr-defined]
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", list(_WRITES))
def test_writes_wake_waiters_like_torchs(
    ours: TCPStoreClient, theirs: dist.TCPStore, server: dist.TCPStore, use_libuv: bool, op: str
) -> None:
    """Our writes wake torch's waiters, and torch's writes ours, exactly as torch's writes wake torch's.

    torch 2.13's legacy server does not wake waiters when compare_set creates
    the key (its libuv server does): we check that our client sees the same.
    """
    other = dist.TCPStore(HOST, server.port, is_master=False, wait_for_workers=False, use_libuv=use_libuv,
                          timeout=TIMEOUT)
    expect_wake = use_libuv or op != "compare_set"
    for n, (writer, waiter) in enumerate(((ours, theirs), (theirs, ours), (other, theirs))):
        key = f"wake/{op}/{n}"
        thread, out = _in_thread(lambda waiter=waiter, key=key: waiter.wait([key], timedelta(seconds=10)))
        time.sleep(0.2)
        assert thread.is_alive(), out
        t_set = time.monotonic()
        _WRITES[op](writer, key)
        thread.join(0.1 if expect_wake else 0.5)
        if expect_wake:
            thread.join(5)
            assert not thread.is_alive() and "error" not in out, out
            assert out["t"] - t_set < 0.5, (n, out["t"] - t_set)  # type: ignore[operator]
        else:
            assert thread.is_alive(), f"{op} woke the waiter ({n})"
            writer.set(key, "release")  # type: ignore[attr-defined]
            thread.join(5)
            assert not thread.is_alive() and "error" not in out, out


@pytest.mark.timeout(60)
def test_wait_on_several_keys(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    theirs.set("w/a", "1")
    thread, out = _in_thread(lambda: ours.wait(["w/a", "w/b", "w/c"], timedelta(seconds=10)))
    time.sleep(0.2)
    theirs.set("w/b", "1")
    time.sleep(0.2)
    assert thread.is_alive(), out  # w/c still missing
    theirs.add("w/c", 1)
    thread.join(5)
    assert not thread.is_alive() and "error" not in out, out
    ours.wait(["w/a", "w/b", "w/c"], timedelta(seconds=1))  # all there: returns at once
    ours.wait([], timedelta(seconds=1))


@pytest.mark.timeout(60)
def test_wait_timeout_raises_timeout_error(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        ours.wait(["never"], timedelta(seconds=0.3))
    elapsed = time.monotonic() - start
    assert 0.29 <= elapsed < 2.0, elapsed
    assert isinstance(info.value, builtins.TimeoutError)
    assert protocol.is_timeout(info.value)
    assert f"{HOST}:{ours.port}" in str(info.value)
    # The wait was cancelled on the server: the connection is still in step.
    ours.set("after", "1")
    assert ours.get("after") == b"1"
    theirs.set("never", "now")  # a late set must not leak a stray STOP_WAITING into the next reply
    assert ours.add("n", 7) == 7
    assert ours.get("never") == b"now"
    # Timeout zero: a check that answers for existing keys and times out for missing ones.
    ours.wait(["after", "never"], timedelta(0))
    with pytest.raises(StoreTimeoutError):
        ours.wait(["still-never"], timedelta(0))
    assert ours.check(["after"])


@pytest.mark.timeout(60)
def test_get_waits_then_times_out(server: dist.TCPStore, theirs: dist.TCPStore) -> None:
    client = TCPStoreClient(HOST, server.port, timeout=timedelta(seconds=0.3))
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            client.get("missing")
        assert time.monotonic() - start < 2.0
        thread, out = _in_thread(lambda: client.get("late"))
        time.sleep(0.1)
        theirs.set("late", "value")
        thread.join(5)
        assert out.get("value") == b"value", out
        assert client.multi_get(["late"]) == [b"value"]
        with pytest.raises(StoreTimeoutError):
            client.multi_get(["late", "missing"])
        assert client.add("ok", 1) == 1
    finally:
        client.close()


# -- threads --------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_many_threads_share_one_client(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    n_threads, n_iter = 8, 100
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(n_iter):
                ours.add("threads/counter", 1)
                value = f"{t}:{i}:" + "x" * (t * 1000)
                ours.set(f"threads/{t}", value)
                assert ours.get(f"threads/{t}") == value.encode()
                ours.append("threads/log", f"{t}.")
                if i % 25 == 0:
                    with pytest.raises(StoreTimeoutError):
                        ours.wait([f"threads/none/{t}"], timedelta(seconds=0.01))
                    assert ours.check([f"threads/{t}"])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(100)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors[:3]
    _flush(ours)
    assert theirs.add("threads/counter", 0) == n_threads * n_iter
    log = theirs.get("threads/log").decode().split(".")[:-1]
    assert sorted(log) == sorted(str(t) for t in range(n_threads) for _ in range(n_iter))


# -- failures ---------------------------------------------------------------------------

_SERVER_CODE = (
    "import sys, torch.distributed as d\n"
    "from inprocess.control.host_names import numeric_host_names\n"
    "numeric_host_names()\n"  # as every server of the tests: no reverse DNS lookup per connection (conftest.py)
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv=sys.argv[1] == '1')\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["killed", "exited"])
def test_server_going_away_is_a_clear_error(use_libuv: bool, how: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER_CODE, "1" if use_libuv else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        waiter = TCPStoreClient(HOST, port, timeout=timedelta(seconds=30))
        client = TCPStoreClient(HOST, port, timeout=timedelta(seconds=30))
        client.set("k", "v")
        assert client.get("k") == b"v"
        thread, out = _in_thread(lambda: waiter.wait(["never"], timedelta(seconds=30)))
        time.sleep(0.2)
        start = time.monotonic()
        if how == "killed":
            proc.send_signal(signal.SIGKILL)
        else:
            proc.stdin.close()
        proc.wait(30)
        thread.join(10)
        assert not thread.is_alive(), "a wait outlived the server"
        error = out.get("error")
        assert isinstance(error, StoreConnectionError), out
        assert f"{HOST}:{port}" in str(error)
        assert out["t"] - start < 10  # type: ignore[operator]
        with pytest.raises(StoreConnectionError, match=f"{HOST}:{port}"):
            for _ in range(3):  # a set may still be buffered by the kernel; a reply cannot come
                client.set("k", "v2")
                client.get("k")
        with pytest.raises(StoreConnectionError, match=f"{HOST}:{port}"):
            client.add("k", 1)  # later calls: the connection is closed, with the reason
        with pytest.raises(StoreConnectionError, match=f"{HOST}:{port}"):
            TCPStoreClient(HOST, port, connect_timeout=timedelta(seconds=0.5))
        waiter.close()
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.mark.timeout(60)
def test_connection_refused_names_the_address() -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreConnectionError, match=f"{HOST}:{port}"):
        TCPStoreClient(HOST, port, connect_timeout=timedelta(seconds=0.5))
    assert time.monotonic() - start < 5


@pytest.mark.timeout(60)
def test_a_refusal_fails_at_once_when_the_server_is_known_to_have_served() -> None:
    """retry_refused=False (the monitors and node agents, started after their rank reached the
    server): nobody listening means the server is gone, so the client says so at once instead of
    retrying until connect_timeout; the default retries until then."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreConnectionError, match=r"1 attempt\(s\).*refused"):
        TCPStoreClient(HOST, port, connect_timeout=timedelta(seconds=20), retry_refused=False)
    assert time.monotonic() - start < 2
    start = time.monotonic()
    with pytest.raises(StoreConnectionError, match="refused"):
        TCPStoreClient(HOST, port, connect_timeout=timedelta(seconds=0.5))
    assert time.monotonic() - start >= 0.5


@pytest.mark.timeout(60)
def test_connect_retries_until_the_server_is_up(use_libuv: bool) -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    holder: dict[str, dist.TCPStore] = {}

    def start_late() -> None:
        time.sleep(0.5)
        holder["s"] = dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False, use_libuv=use_libuv)

    thread = threading.Thread(target=start_late, daemon=True)
    thread.start()
    client = TCPStoreClient(HOST, port, connect_timeout=TIMEOUT)
    thread.join(10)
    client.set("up", "1")
    assert holder["s"].get("up") == b"1"
    client.close()


class _FakeServer:
    """Accepts connections; answers the handshake only if told to, then stays silent."""

    def __init__(self, handshake: bool):
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.handshake = handshake
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(10)
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.conns.append(conn)
        if self.handshake:
            conn.settimeout(10)
            hello = b""
            while len(hello) < 10:
                chunk = conn.recv(10 - len(hello))
                if not chunk:
                    return
                hello += chunk
            conn.sendall(hello[6:10])  # echo the ping nonce

    def close(self) -> None:
        self.listener.close()
        self.thread.join(15)
        for conn in self.conns:
            conn.close()


@pytest.mark.timeout(60)
def test_silent_server_does_not_hang_the_client() -> None:
    silent = _FakeServer(handshake=False)
    try:
        start = time.monotonic()
        with pytest.raises(StoreConnectionError, match="handshake"):
            TCPStoreClient(HOST, silent.port, connect_timeout=timedelta(seconds=0.5))
        assert time.monotonic() - start < 5
    finally:
        silent.close()
    mute = _FakeServer(handshake=True)
    try:
        client = TCPStoreClient(HOST, mute.port, timeout=timedelta(seconds=0.3))
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=f"{HOST}:{mute.port}"):
            client.add("k", 1)
        assert time.monotonic() - start < 5
        with pytest.raises(StoreConnectionError, match="closed"):
            client.num_keys()  # the stream is out of step: the connection was closed
    finally:
        mute.close()


@pytest.mark.timeout(60)
def test_request_the_server_cannot_serve(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    """No error replies in the protocol: the server drops the connection, we say so."""
    theirs.set("text", "not a number")
    _flush(theirs)
    start = time.monotonic()
    with pytest.raises(StoreConnectionError, match="closed the connection"):
        ours.add("text", 1)
    assert time.monotonic() - start < 5
    with pytest.raises(StoreConnectionError, match=f"{HOST}:{ours.port}"):
        ours.get("text")


@pytest.mark.timeout(60)
def test_close_wakes_a_blocked_wait(ours: TCPStoreClient) -> None:
    thread, out = _in_thread(lambda: ours.wait(["never"], timedelta(seconds=20)))
    time.sleep(0.2)
    start = time.monotonic()
    ours.close()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(out.get("error"), StoreConnectionError), out
    assert out["t"] - start < 2  # type: ignore[operator]
    assert ours.closed
    with pytest.raises(StoreConnectionError, match="closed"):
        ours.set("k", "v")


@pytest.mark.timeout(60)
def test_clone_is_an_independent_connection(ours: TCPStoreClient, theirs: dist.TCPStore) -> None:
    other = ours.clone()
    try:
        thread, out = _in_thread(lambda: other.wait(["cl"], timedelta(seconds=10)))
        time.sleep(0.1)
        ours.set("cl", "1")  # not blocked by the wait on the clone
        thread.join(5)
        assert "error" not in out and not thread.is_alive(), out
    finally:
        other.close()


@pytest.mark.timeout(60)
def test_restart_protocol_over_our_client(ours: TCPStoreClient, theirs: dist.TCPStore, use_libuv: bool) -> None:
    """protocol.RestartProtocol works with our client and torch's on one store."""
    mine = protocol.RestartProtocol(ours)
    torchs = protocol.RestartProtocol(theirs)
    assert not mine.restart_requested(0)
    if use_libuv:
        thread, out = _in_thread(lambda: torchs.wait_event(0, 10.0))
        time.sleep(0.1)
    # (torch 2.13's legacy server does not wake waiters on compare_set: a
    # waiter started before request_restart would sleep through it, see
    # test_writes_wake_waiters_like_torchs; that is the server, not the client.)
    assert mine.request_restart(0) is True
    if not use_libuv:
        thread, out = _in_thread(lambda: torchs.wait_event(0, 10.0))
    thread.join(5)
    assert out.get("value") == protocol.RESTART, out
    assert torchs.request_restart(0) is True and mine.restart_requested(0)
    record = protocol.FaultRecord(3, 0, "exception", "ValueError", "boom")
    mine.record_fault(record)
    _flush(ours)
    assert torchs.read_faults(0) == [record]
    assert mine.take_seat(0, 0) and torchs.take_seat(0, 1)  # as barrier 0 left them
    assert mine.arrive(1, 0, 2, terminated=False) == (1, 0, False)
    assert torchs.arrive(1, 1, 2, terminated=True) == (1, 1, True)
    assert mine.read_terminated(1, 1) == {1}
    with pytest.raises(builtins.TimeoutError):
        mine.counted.wait_key(mine.key(5, "event"), 0.2, "nothing")
    mine.delete_iteration(0)
    assert not torchs.restart_requested(0)
