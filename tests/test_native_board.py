"""The node board: one shared-memory region per node between the node agent
and its ranks. Words, waits on shared futexes, the decision seqlock, and the
same board seen from another process.

Waits that must time out use short timeouts; waits that must be woken use
long ones and assert how soon they returned. Every child process is killed
(if need be) and reaped, however its test ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from inprocess import _native

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the board sleeps on Linux futexes")

MIB = 1 << 20
# A woken waiter returns within this; a futex wake-up takes microseconds, the
# rest is room for a loaded machine.
WOKEN_WITHIN_S = 1.0
MAX_INDEX = (1 << 62) - 2

@pytest.fixture
def board() -> Iterator[_native.NodeBoard]:
    b = _native.NodeBoard.create(4, 4096)
    yield b
    b.unmap()


@contextlib.contextmanager
def child_process(code: str, *args: str, pass_fds: Sequence[int] = ()) -> Iterator[subprocess.Popen]:
    """A Python child that gets `pass_fds`; killed if still running and
    always reaped, however the test ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=tuple(pass_fds),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def read_line(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"child exited early (rc={proc.poll()})"
    return line.strip()


def memfd_with(data: bytes) -> int:
    fd = os.memfd_create("not-a-board")
    os.write(fd, data)
    return fd


class InThread:
    """Runs `fn` in a thread; records its result and when it returned."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.returned_at = 0.0
        self.done = threading.Event()

        def run() -> None:
            self.result = fn()
            self.returned_at = time.monotonic()
            self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 10.0) -> object:
        assert self.done.wait(timeout), "the waiter never returned"
        self.thread.join(timeout)
        return self.result


# ---------------------------------------------------------------------------
# Creation and attachment


@pytest.mark.timeout(30)
def test_create_attach_roundtrip(board: _native.NodeBoard) -> None:
    assert (board.slots, board.decision_capacity, board.agent_pid) == (4, 4096, os.getpid())
    assert not board.closed
    assert board.event() == -1
    assert board.arrival_seq() == 0
    assert board.read_decision() is None
    assert all(board.slot_arrival(s) is None for s in range(4))

    view = _native.NodeBoard.attach(board.fd)
    try:
        assert view.fd != board.fd  # its own duplicate
        assert (view.slots, view.decision_capacity, view.agent_pid) == (4, 4096, os.getpid())
        board.post_event(1, False)
        view.arrive(2, 0, 7)
        assert view.event() == 2
        assert board.slot_arrival(2) == (0, 7)
    finally:
        view.unmap()
    assert view.fd == -1
    assert board.event() == 2  # the creator's view is untouched


@pytest.mark.timeout(30)
def test_attach_keeps_a_duplicate(board: _native.NodeBoard) -> None:
    mine = os.dup(board.fd)
    view = _native.NodeBoard.attach(mine)
    os.close(mine)  # the caller's descriptor is the caller's to close
    board.unmap()  # and the creator may go first
    view.post_event(3, True)
    assert view.wait_event(3, 0) == 1
    view.unmap()


@pytest.mark.timeout(30)
def test_unmapped_board_refuses(board: _native.NodeBoard) -> None:
    board.unmap()
    board.unmap()  # idempotent
    assert board.fd == -1
    assert board.slots == 4  # a property of the board, kept
    for call in (board.event, lambda: board.post_event(0, False), lambda: board.wait_event(0, 1.0), board.arrival_seq):
        with pytest.raises(RuntimeError, match="unmapped"):
            call()


@pytest.mark.parametrize(
    "slots, capacity, match",
    [
        (0, 4096, r"slots 0 out of range \[1, 65536\]"),
        (-1, 4096, r"slots -1 out of range \[1, 65536\]"),
        (65537, 4096, r"slots 65537 out of range \[1, 65536\]"),
        (4, 1023, r"decision_capacity 1023 out of range \[1024, 67108864\]"),
        (4, 64 * MIB + 1, r"decision_capacity 67108865 out of range \[1024, 67108864\]"),
    ],
)
@pytest.mark.timeout(30)
def test_create_validates(slots: int, capacity: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _native.NodeBoard.create(slots, capacity)


@pytest.mark.timeout(30)
def test_create_limits_are_inclusive() -> None:
    for slots, capacity in ((1, 1024), (65536, 64 * MIB)):
        b = _native.NodeBoard.create(slots, capacity)
        assert (b.slots, b.decision_capacity) == (slots, capacity)
        b.arrive(slots - 1, 0, 3)
        b.post_decision(0, b"z" * capacity)
        assert b.read_decision() == (0, b"z" * capacity)
        b.unmap()


@pytest.mark.timeout(30)
def test_attach_rejects_what_is_no_board(board: _native.NodeBoard) -> None:
    header = os.pread(board.fd, 4096, 0)
    size = os.fstat(board.fd).st_size

    fds = []
    try:
        fds.append(memfd_with(b""))
        with pytest.raises(ValueError, match="size 0, smaller than"):
            _native.NodeBoard.attach(fds[-1])

        fds.append(memfd_with(b"\0" * size))
        with pytest.raises(ValueError, match="bad magic"):
            _native.NodeBoard.attach(fds[-1])

        version = int.from_bytes(header[8:12], sys.byteorder)
        wrong_version = header[:8] + (version + 1).to_bytes(4, sys.byteorder) + header[12:]
        fds.append(memfd_with(wrong_version + b"\0" * (size - len(header))))
        with pytest.raises(ValueError, match=f"version {version + 1}, expected {version}"):
            _native.NodeBoard.attach(fds[-1])

        fds.append(memfd_with(header + b"\0" * (size - len(header) + 8)))
        with pytest.raises(ValueError, match=f"size {size + 8}, expected {size} for 4 slots and 4096"):
            _native.NodeBoard.attach(fds[-1])

        page = _native.HeartbeatPage.create()
        try:
            with pytest.raises(ValueError, match="bad magic"):
                _native.NodeBoard.attach(page.fd)
        finally:
            page.close()
    finally:
        for fd in fds:
            os.close(fd)

    with tempfile.TemporaryFile() as f:
        f.write(header + b"\0" * (size - len(header)))
        f.flush()
        # A copy in a regular file is a board of its own: attach only checks the format.
        view = _native.NodeBoard.attach(f.fileno())
        assert view.slots == 4
        view.unmap()

    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="is not a node board"):
            _native.NodeBoard.attach(r)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(OSError):
        _native.NodeBoard.attach(1 << 20)  # no such descriptor


@pytest.mark.timeout(30)
def test_indices_are_validated(board: _native.NodeBoard) -> None:
    for slot in (-1, 4, 1 << 40):
        for call, args in (
            (board.arrive, (slot, 0, 3)),
            (board.slot_arrival, (slot,)),
            (board.set_leader, (slot, 0)),
            (board.wait_outcome, (slot, 0, 0)),
        ):
            with pytest.raises(IndexError, match=rf"slot {slot} out of range \[0, 4\)"):
                call(*args)
    for bad in (-1, MAX_INDEX + 1):
        for name, call, args in (
            ("iteration", board.post_event, (bad, False)),
            ("iteration", board.wait_event, (bad, 0)),
            ("barrier", board.set_leader, (0, bad)),
            ("barrier", board.post_decision, (bad, b"")),
            ("barrier", board.wait_outcome, (0, bad, 0)),
        ):
            with pytest.raises(ValueError, match=rf"{name} {bad} out of range \[0, {MAX_INDEX}\]"):
                call(*args)
    for seq in (-1, 1 << 32):
        with pytest.raises(ValueError, match=rf"seen_seq {seq} out of range \[0, 4294967295\]"):
            board.wait_arrivals(seq, 0)
    with pytest.raises(ValueError, match="nan"):
        board.wait_event(0, float("nan"))
    # The largest index encodes without overflow.
    board.post_event(MAX_INDEX, True)
    assert board.wait_event(MAX_INDEX, 0) == 1
    max_arrival = (1 << 38) - 1  # an arrival packs the barrier with a 24-bit expected count
    board.arrive(3, max_arrival, (1 << 24) - 1)
    assert board.slot_arrival(3) == (max_arrival, (1 << 24) - 1)
    for barrier, expected, name, bound in (
        (-1, 1, "barrier", f"\\[0, {max_arrival}\\]"), (max_arrival + 1, 1, "barrier", f"\\[0, {max_arrival}\\]"),
        (0, 0, "expected", f"\\[1, {(1 << 24) - 1}\\]"), (0, 1 << 24, "expected", f"\\[1, {(1 << 24) - 1}\\]"),
    ):
        value = barrier if name == "barrier" else expected
        with pytest.raises(ValueError, match=rf"{name} {value} out of range {bound}"):
            board.arrive(3, barrier, expected)


def test_forwarded_and_leads_words() -> None:
    board = _native.NodeBoard.create(4, 1024)
    assert board.forwarded(1) == -1 and board.leads(1) == -1
    board.mark_forwarded(1, 0)
    board.set_leader(1, 4)
    assert board.forwarded(1) == 0 and board.leads(1) == 4
    board.mark_forwarded(1, 5)
    assert board.forwarded(1) == 5 and board.forwarded(0) == -1
    with pytest.raises(IndexError, match=r"slot 4 out of range \[0, 4\)"):
        board.forwarded(4)


# ---------------------------------------------------------------------------
# The event


@pytest.mark.timeout(30)
def test_event_never_goes_back(board: _native.NodeBoard) -> None:
    board.post_event(3, False)
    assert board.event() == 6
    board.post_event(2, True)  # older: ignored
    assert board.event() == 6
    board.post_event(3, True)
    assert board.event() == 7
    board.post_event(3, False)  # a restart of an iteration known complete: ignored
    assert board.event() == 7


@pytest.mark.timeout(30)
def test_wait_event_results(board: _native.NodeBoard) -> None:
    assert board.wait_event(0, 0) == -1  # nothing posted
    board.post_event(0, False)
    assert board.wait_event(0, 0) == 0  # restart
    board.post_event(0, True)
    assert board.wait_event(0, 0) == 1  # complete
    board.post_event(2, False)
    assert board.wait_event(0, 0) == 0  # a later iteration exists: 0 restarted
    assert board.wait_event(1, 0) == 0
    assert board.wait_event(2, 0) == 0

    start = time.monotonic()
    assert board.wait_event(3, 0.1) == -1
    assert time.monotonic() - start >= 0.1
    assert board.wait_event(3, -5) == -1  # a negative timeout checks once

    board.close()
    assert board.closed
    start = time.monotonic()
    assert board.wait_event(3, 10) == -2
    assert board.wait_event(0, 10) == -2  # closure wins over a posted event
    assert time.monotonic() - start < WOKEN_WITHIN_S


# ---------------------------------------------------------------------------
# Arrivals


@pytest.mark.timeout(30)
def test_arrivals(board: _native.NodeBoard) -> None:
    assert board.slot_arrival(1) is None
    assert board.wait_arrivals(0, 0.05) == -1
    board.arrive(1, 0, 3)
    assert board.slot_arrival(1) == (0, 3)
    assert board.arrival_seq() == 1
    assert board.wait_arrivals(0, 10) == 1  # already moved: at once
    board.arrive(1, 5, 7)
    board.arrive(0, 5, 3)
    assert board.slot_arrival(1) == (5, 7)
    assert board.slot_arrival(0) == (5, 3)
    assert board.slot_arrival(2) is None
    seq = board.arrival_seq()
    assert seq == 3
    assert board.wait_arrivals(seq, 0.05) == -1
    assert board.wait_arrivals(1, 0) == 3

    board.close()
    assert board.arrival_seq() != seq  # close bumps the word to wake waiters
    assert board.wait_arrivals(board.arrival_seq(), 10) == -2
    assert board.wait_arrivals(seq, 10) == -2  # closure wins over a moved sequence


@pytest.mark.timeout(30)
def test_an_arrival_carries_the_seat_the_agent_takes(board: _native.NodeBoard) -> None:
    board.arrive(1, 4, 9, 16383, 2)
    assert board.slot_arrival(1) == (4, 9) and board.slot_seat(1) == (16383, 2)
    board.arrive(1, 5, 9)  # the rank took its seat itself
    assert board.slot_seat(1) is None and board.slot_seat(0) is None
    largest = (1 << 31) - 2, (1 << 30) - 1
    board.arrive(2, 0, 1, *largest)
    assert board.slot_seat(2) == largest
    ranks, lives = rf"\[-1, {largest[0]}\]", rf"\[0, {largest[1]}\]"
    for rank, life, message in (
        (-2, 0, f"initial_rank -2 out of range {ranks}"),
        (largest[0] + 1, 0, f"initial_rank {largest[0] + 1} out of range {ranks}"),
        (0, -1, f"life -1 out of range {lives}"), (0, largest[1] + 1, f"life {largest[1] + 1} out of range {lives}"),
    ):
        with pytest.raises(ValueError, match=message):
            board.arrive(3, 0, 1, rank, life)


@pytest.mark.timeout(30)
def test_a_refused_seat_is_the_slot_outcome_before_a_decision(board: _native.NodeBoard) -> None:
    waiter: list[int] = []
    thread = threading.Thread(target=lambda: waiter.append(board.wait_outcome(1, 2, 10)))
    thread.start()
    board.refuse_seat(1, 2)  # wakes the waiter
    thread.join(10)
    assert waiter == [3]
    assert board.leads(1) == -1  # a refusal names no leader
    assert board.wait_outcome(1, 3, 0.02) == -1  # it names one barrier
    board.post_decision(2, b"x")
    assert board.wait_outcome(1, 2, 0) == 3  # checked before the decision
    assert board.wait_outcome(0, 2, 0) == 2
    board.set_leader(1, 3)
    assert board.wait_outcome(1, 3, 0) == 1 and board.leads(1) == 3


# ---------------------------------------------------------------------------
# Leaders and decisions


@pytest.mark.timeout(30)
def test_leader_and_outcome(board: _native.NodeBoard) -> None:
    assert board.wait_outcome(0, 0, 0.05) == -1
    board.set_leader(2, 3)
    assert board.wait_outcome(2, 3, 0) == 1
    assert board.wait_outcome(2, 2, 0.02) == -1  # the role names one barrier
    assert board.wait_outcome(2, 4, 0.02) == -1
    assert board.wait_outcome(1, 3, 0.02) == -1  # and one slot

    board.post_decision(3, b"x")
    assert board.wait_outcome(1, 3, 0) == 2
    assert board.wait_outcome(1, 2, 0) == 2  # a later barrier's decision settles an older one
    assert board.wait_outcome(1, 4, 0.02) == -1
    assert board.wait_outcome(2, 3, 0) == 1  # the role is checked before the decision

    board.close()
    assert board.wait_outcome(2, 3, 10) == -2
    assert board.wait_outcome(1, 4, 10) == -2


@pytest.mark.timeout(30)
def test_decision_roundtrip(board: _native.NodeBoard) -> None:
    view = _native.NodeBoard.attach(board.fd)
    try:
        assert view.read_decision() is None
        board.post_decision(0, b"")
        assert view.read_decision() == (0, b"")
        full = bytes(range(256)) * 16
        assert len(full) == board.decision_capacity
        board.post_decision(1, full)
        assert view.read_decision() == (1, full)
        board.post_decision(2, full + b"!")
        assert view.read_decision() == (2, None)  # overflow: read it from the store
        for n in range(1, 20):  # every tail length of the last word
            data = bytes(range(100, 100 + n))
            board.post_decision(10 + n, data)
            assert view.read_decision() == (10 + n, data)
        board.post_decision(5, b"older")  # the latest post, whatever its barrier
        assert view.read_decision() == (5, b"older")
        board.post_decision(6, b"\0" * 9)
        assert view.read_decision() == (6, b"\0" * 9)
    finally:
        view.unmap()


@pytest.mark.timeout(30)
def test_agent_pid(board: _native.NodeBoard) -> None:
    assert board.agent_pid == os.getpid()


# ---------------------------------------------------------------------------
# Waking, the GIL and signals


def poster(board: _native.NodeBoard, kind: str) -> Callable[[], None]:
    return {
        "event": lambda: board.post_event(0, True),
        "arrival": lambda: board.arrive(0, 0, 3),
        "leader": lambda: board.set_leader(1, 0),
        "decision": lambda: board.post_decision(0, b"go"),
        "close": board.close,
    }[kind]


def waiter(board: _native.NodeBoard, kind: str) -> Callable[[], object]:
    return {
        "event": lambda: board.wait_event(0, 30),
        "arrival": lambda: board.wait_arrivals(0, 30),
        "leader": lambda: board.wait_outcome(1, 0, 30),
        "decision": lambda: board.wait_outcome(1, 0, 30),
    }[kind]


@pytest.mark.parametrize(
    "kind, expected",
    [("event", 1), ("arrival", 1), ("leader", 1), ("decision", 2)],
)
@pytest.mark.timeout(30)
def test_waiter_woken_and_gil_released(board: _native.NodeBoard, kind: str, expected: int) -> None:
    w = InThread(waiter(board, kind))
    time.sleep(0.05)  # let it reach the futex
    # The waiter holds no GIL: this thread runs Python meanwhile.
    spins = 0
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        spins += 1
    assert not w.done.is_set()
    assert spins > 1000
    posted = time.monotonic()
    poster(board, kind)()
    assert w.join() == expected
    assert w.returned_at - posted < WOKEN_WITHIN_S


@pytest.mark.parametrize("kind", ["event", "arrival", "leader"])
@pytest.mark.timeout(30)
def test_close_wakes_every_waiter(board: _native.NodeBoard, kind: str) -> None:
    w = InThread(waiter(board, kind))
    time.sleep(0.05)
    closed = time.monotonic()
    board.close()
    assert w.join() == -2
    assert w.returned_at - closed < WOKEN_WITHIN_S


@pytest.mark.timeout(30)
def test_unrelated_posts_do_not_end_a_wait(board: _native.NodeBoard) -> None:
    w = InThread(lambda: board.wait_event(1, 0.3))
    time.sleep(0.05)
    board.post_event(0, False)  # wakes it; iteration 0 is not what it waits for
    board.set_leader(0, 0)
    board.post_decision(0, b"")
    assert w.join() == -1


@pytest.mark.timeout(30)
def test_unmap_during_a_wait(board: _native.NodeBoard) -> None:
    w = InThread(lambda: board.wait_event(0, 0.3))
    time.sleep(0.05)
    board.unmap()  # the waiter keeps the memory mapped until it returns
    assert w.join() == -1


@pytest.mark.timeout(30)
def test_signal_handler_runs_during_a_wait(board: _native.NodeBoard) -> None:
    class Interrupted(Exception):
        pass

    seen = []

    def record(signum: int, frame: object) -> None:
        seen.append(signum)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    # Sent to the main thread: the one whose futex the signal must interrupt.
    main = threading.main_thread().ident
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        # A handler that returns: the wait goes on to its result.
        signal.signal(signal.SIGUSR1, record)
        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1)).start()
        threading.Timer(0.3, board.post_event, (0, True)).start()
        assert board.wait_event(0, 30) == 1
        assert seen == [signal.SIGUSR1]

        # A handler that raises: the wait ends with its exception, promptly.
        signal.signal(signal.SIGUSR1, interrupt)
        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1)).start()
        start = time.monotonic()
        with pytest.raises(Interrupted):
            board.wait_event(1, 30)
        assert time.monotonic() - start < WOKEN_WITHIN_S
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ---------------------------------------------------------------------------
# Across processes


CHILD_WAITS = """
import sys
from inprocess import _native
board = _native.NodeBoard.attach(int(sys.argv[1]))
print("ready", board.agent_pid, flush=True)
print(board.wait_event(0, 30), flush=True)
print(board.wait_outcome(1, 0, 30), flush=True)
print(board.wait_outcome(2, 0, 30), flush=True)
board.arrive(1, 0, 7)
print(board.wait_event(1, 30), flush=True)
"""


@pytest.mark.timeout(60)
def test_cross_process_waits(board: _native.NodeBoard) -> None:
    with child_process(CHILD_WAITS, str(board.fd), pass_fds=[board.fd]) as child:
        assert read_line(child) == f"ready {os.getpid()}"
        time.sleep(0.05)
        board.post_event(0, True)
        assert read_line(child) == "1"

        time.sleep(0.05)
        board.set_leader(1, 0)
        assert read_line(child) == "1"

        seq = board.arrival_seq()
        time.sleep(0.05)
        board.post_decision(0, b"plan")
        assert read_line(child) == "2"

        # The child's arrival wakes a waiter here.
        assert board.wait_arrivals(seq, 30) == seq + 1
        assert board.slot_arrival(1) == (0, 7)

        time.sleep(0.05)
        board.close()
        assert read_line(child) == "-2"
        assert child.wait(timeout=10) == 0


CHILD_WRITER = """
import sys, time
from inprocess import _native
board = _native.NodeBoard.attach(int(sys.argv[1]))
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
barrier = 0
while time.monotonic() < end:
    barrier += 1
    board.post_decision(barrier, bytes([barrier % 256]) * (barrier % 1000 + 1))
board.post_event(0, True)
print(barrier, flush=True)
"""


@pytest.mark.timeout(60)
def test_seqlock_snapshots_are_consistent() -> None:
    # The writer is another process: threads of one process would take turns
    # holding the GIL and never overlap a post with a read.
    board = _native.NodeBoard.create(2, 1024)
    try:
        with child_process(CHILD_WRITER, str(board.fd), "1.5", pass_fds=[board.fd]) as child:
            assert read_line(child) == "ready"
            reads = 0
            barriers = set()
            last = 0
            while board.event() < 0 and child.poll() is None:
                snapshot = board.read_decision()
                if snapshot is None:
                    continue
                barrier, data = snapshot
                assert data == bytes([barrier % 256]) * (barrier % 1000 + 1), f"torn snapshot of barrier {barrier}"
                assert barrier >= last  # decisions come in order
                last = barrier
                barriers.add(barrier)
                reads += 1
            posted = int(read_line(child))
            assert child.wait(timeout=10) == 0
            assert board.read_decision() == (posted, bytes([posted % 256]) * (posted % 1000 + 1))
            # The reader really raced the writer: it saw many different
            # decisions (on a loaded 2-core machine, one per time slice).
            assert len(barriers) > 20, (reads, len(barriers), posted)
    finally:
        board.unmap()


CHILD_PING_PONG = """
import sys
from inprocess import _native
board = _native.NodeBoard.attach(int(sys.argv[1]))
for i in range(int(sys.argv[2])):
    result = board.wait_event(i, 10)
    if result != 0:
        print("iteration", i, "got", result, flush=True)
        break
    board.arrive(0, i, 3)
else:
    print("done", flush=True)
"""


@pytest.mark.timeout(60)
def test_ping_pong_loses_no_wake_up(board: _native.NodeBoard) -> None:
    # Every round sleeps on both sides; a lost wake-up would stall a round
    # until its 10 s timeout instead of microseconds.
    rounds = 2000
    start = time.monotonic()
    with child_process(CHILD_PING_PONG, str(board.fd), str(rounds), pass_fds=[board.fd]) as child:
        for i in range(rounds):
            seq = board.arrival_seq()
            board.post_event(i, False)
            while board.slot_arrival(0) != (i, 3):
                seq = board.wait_arrivals(seq, 10)
                assert seq >= 0, f"round {i}: no arrival ({seq})"
        assert read_line(child) == "done"
        assert child.wait(timeout=10) == 0
    assert time.monotonic() - start < 10
