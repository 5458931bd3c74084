"""Where the seats are kept: K consecutive seats to a store key, K agreed once per call.

The seats (:mod:`inprocess.control.seats`) of initial ranks Kg..Kg+K-1 are the
K slots of one key, ``seat/<g>``: their values joined by ``","`` (a seat's
value never holds one), ``""`` for a seat nobody wrote yet; a missing key
holds K unwritten seats. With K = 1 that is a key per seat, as before keys
were shared: each rank that counts itself at the store moves its own seat.
With node agents, K is the number of ranks per node: an agent takes its
node's seats at every barrier with one ``compare_set`` of one key, not one
per rank (at 16,384 ranks, 2,048 requests per barrier instead of 16,384).
That holds where the launcher numbers each node's ranks as one block
(torchrun does); ranks dealt round-robin over the nodes (SLURM's cyclic
distribution) put several agents on each key: counted exactly once still,
with a write retried each time another agent's came first.

K is the job's, not a process's: the first process of the call to touch a
seat writes its proposal to ``seat/per_key`` (compare_set from nothing), and
every process adopts what the key holds. A process that proposes another K
(a monitor, a joiner, a rank whose agent is late) costs the job the
agents' saving, never a seat counted twice.

Each seat keeps the ``compare_set`` it had as a key of its own:
:meth:`SeatTable.compare_set_many` moves a seat from an expected value to a
desired one and answers what the seat holds afterwards (the desired value:
moved, or already there). The key is written with one ``compare_set`` whose
expected value is the key as last seen here, with each seat to move where
its move expects it. When any seat of the key is elsewhere, the store
answers the key's value and the write is made again on it; only the store's
answer for the seat itself refuses its move, so exactly-once counting
(:mod:`inprocess.control.counting_out`) holds as with a key per seat.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..exception import InternalError
from .keys import CallKeys
from .store_ops import CountingStore

SEPARATOR = ","
# The most seats one key holds (a node's ranks; its value stays a few kB).
MAX_PER_KEY = 256
# Rewrites of one key in one call, per seat of the key: each rewrite needs another seat of the key to
# move in between, and a seat moves a few times per barrier (its arrival, a claim, a joiner's
# admission); more means something rewrites it in a loop.
_ATTEMPTS_PER_SEAT = 4
_ATTEMPTS_MIN = 64


def attempts(per_key: int) -> int:
    """How many writes of one key a call makes at most before it gives up (InternalError)."""
    return max(_ATTEMPTS_MIN, _ATTEMPTS_PER_SEAT * per_key)
# Keys per check + multi_get of a read of many seats.
_KEYS_PER_READ = 1024

# compare_set of (key, expected, desired) triples, answering each key's value afterwards.
Send = Callable[[list[tuple[str, str, str]]], Sequence[bytes]]


def key(prefix: str, index: int) -> str:
    """The key of the ``index``-th run of seats of the call whose keys start with ``prefix``."""
    return CallKeys(prefix).seat(index)


def per_key_key(prefix: str) -> str:
    """Where the call's number of seats per key is agreed."""
    return CallKeys(prefix).seats_per_key()


def decode(name: str, value: str, per_key: int) -> list[str]:
    """The ``per_key`` seat values a key's value holds ("" unwritten); InternalError naming it otherwise."""
    if not value:
        return [""] * per_key
    slots = value.split(SEPARATOR)
    if len(slots) != per_key:
        raise InternalError(f"seat key {name} holds {value!r}: expected {per_key} seat values joined by {SEPARATOR!r}")
    return slots


def encode(slots: Sequence[str]) -> str:
    """A key's value (inverse of :func:`decode`): "" when no seat is written, as a missing key."""
    if not any(slots):
        return ""
    for value in slots:
        if SEPARATOR in value:
            raise InternalError(f"seat value {value!r} holds {SEPARATOR!r}, which separates the seats of a key")
    return SEPARATOR.join(slots)


def check_per_key(value: object, what: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_PER_KEY:
        raise InternalError(f"{what} {value!r}: expected an integer in 1..{MAX_PER_KEY}")
    return value


def seeded(prefix: str, per_key: int, values: dict[int, str]) -> dict[str, str]:
    """The keys and values that hold the seats ``values`` (every other seat of their keys
    unwritten) and ``per_key``, for a test or a benchmark that sets many at once with ``multi_set``."""
    keys: dict[int, list[str]] = {}
    for rank, value in values.items():
        keys.setdefault(rank // per_key, [""] * per_key)[rank % per_key] = value
    return {per_key_key(prefix): str(per_key), **{key(prefix, index): encode(slots) for index, slots in keys.items()}}


class SeatTable:
    """The seats of one wrapped call (``prefix``), read and moved through ``counted``.

    ``proposal``: the seats per key this process proposes if it is the call's
    first to touch a seat (None: 1).
    """

    def __init__(self, counted: CountingStore, prefix: str, proposal: int | None = None):
        self.counted = counted
        self.prefix = prefix
        self.proposal = 1 if proposal is None else check_per_key(proposal, "seats per key proposed")
        self._per_key: int | None = None
        # Each key's value as last read or written here: the expected value of its next write.
        self._known: dict[int, str] = {}

    @property
    def per_key(self) -> int:
        """The call's seats per key: one ``compare_set`` the first time a process asks."""
        if self._per_key is None:
            held = self.counted.compare_set(per_key_key(self.prefix), "", str(self.proposal)).decode()
            if not held.isdigit():
                raise InternalError(f"{per_key_key(self.prefix)} holds {held!r}: expected an integer in "
                                    f"1..{MAX_PER_KEY}")
            self._per_key = check_per_key(int(held), per_key_key(self.prefix))
        return self._per_key

    def key(self, index: int) -> str:
        return key(self.prefix, index)

    def key_of(self, initial_rank: int) -> str:
        return self.key(initial_rank // self.per_key)

    def read(self, initial_rank: int) -> str | None:
        """The seat's value, or None when nobody wrote it (the rank never arrived anywhere)."""
        return self.read_many([initial_rank])[initial_rank]

    def read_many(self, ranks: Sequence[int]) -> dict[int, str | None]:
        """The seats of ``ranks`` (None: never written): per 1,024 keys one ``check`` and one
        ``multi_get`` when they all exist, else one read each (a ``multi_get`` waits for a missing key)."""
        keys = self.keys_of(ranks)
        values: list[str | None] = []
        for start in range(0, len(keys), _KEYS_PER_READ):
            chunk = keys[start:start + _KEYS_PER_READ]
            # check + multi_get is three requests: for fewer keys, one read each.
            if len(chunk) > 3 and self.counted.check(chunk):
                values += [v.decode() for v in self.counted.multi_get(chunk)]
            else:
                values += [None if raw is None else raw.decode() for raw in map(self.counted.peek, chunk)]
        return self.learn(ranks, values)

    def keys_of(self, ranks: Sequence[int]) -> list[str]:
        """The keys that hold the seats of ``ranks``, each once: for a caller that reads them with
        other keys (then :meth:`learn`)."""
        per_key = self.per_key
        return [self.key(index) for index in sorted({r // per_key for r in ranks})]

    def learn(self, ranks: Sequence[int], values: Sequence[str | None]) -> dict[int, str | None]:
        """The seats of ``ranks``, given the values of :meth:`keys_of` ``(ranks)`` (None: missing)."""
        per_key = self.per_key
        indexes = sorted({r // per_key for r in ranks})
        self._known.update(zip(indexes, (value or "" for value in values), strict=True))
        out: dict[int, str | None] = {}
        for r in ranks:
            index, slot = divmod(r, per_key)
            out[r] = decode(self.key(index), self._known[index], per_key)[slot] or None
        return out

    def compare_set(self, initial_rank: int, expected: str, desired: str) -> str:
        """Move one seat from ``expected`` to ``desired``; what it holds afterwards ("" unwritten)."""
        return self.compare_set_many([(initial_rank, expected, desired)])[0]

    def compare_set_many(self, moves: Sequence[tuple[int, str, str]], send: Send | None = None) -> list[str]:
        """Move each seat (initial rank, expected, desired); per move what the seat holds afterwards.

        One ``compare_set`` per key touched, all sent together by ``send``
        (default: one after another on this table's connection); a key whose
        value was not as expected is written again on the value the store answered.
        """
        per_key = self.per_key
        if send is None:
            send = self._send_one_by_one
        if len({rank for rank, _, _ in moves}) != len(moves):
            raise InternalError(f"seat moves name a seat twice: {sorted(rank for rank, _, _ in moves)}")
        answers = [""] * len(moves)
        pending: dict[int, list[int]] = {}  # key index -> its moves not answered yet
        for n, (rank, _, _) in enumerate(moves):
            pending.setdefault(rank // per_key, []).append(n)
        answered: set[int] = set()  # keys whose value the store answered in this call
        bound = attempts(per_key)
        for _ in range(bound):
            writes: list[tuple[int, str, str, list[int]]] = []  # (key index, expected, desired, moves made)
            for index, which in pending.items():
                slots = decode(self.key(index), self._known.get(index, ""), per_key)
                if index not in answered:
                    # Only the store's answer refuses a move: the first write expects every seat
                    # where its move expects it, the key's other seats as last seen here.
                    for n in which:
                        slots[moves[n][0] % per_key] = moves[n][1]
                base = encode(slots)
                made = []
                for n in which:
                    rank, expected, desired = moves[n]
                    held = slots[rank % per_key]
                    if held == expected and held != desired:
                        slots[rank % per_key] = desired
                        made.append(n)
                    else:
                        answers[n] = held  # moved already, or refused: what the seat holds
                if made:
                    writes.append((index, base, encode(slots), made))
            if not writes:
                return answers
            values = send([(self.key(index), base, new) for index, base, new, _ in writes])
            pending = {}
            for (index, base, new, made), raw in zip(writes, values, strict=True):
                value = bytes(raw).decode()
                if value == new:
                    self._known[index] = new
                    for n in made:
                        answers[n] = moves[n][2]
                    continue
                # compare_set answers a missing key with the expected value itself.
                self._known[index] = "" if value == base else value
                answered.add(index)
                pending[index] = made
        raise InternalError(f"seat keys {sorted(self.key(i) for i in pending)} kept changing while their seats "
                            f"were moved ({bound} writes)")

    def write(self, values: dict[int, str]) -> None:
        """Set seats whatever they hold (a test's or a benchmark's start), keeping the others of their keys."""
        current = self.read_many(list(values))
        self.compare_set_many([(r, current[r] or "", v) for r, v in values.items() if current[r] != v])

    def _send_one_by_one(self, items: list[tuple[str, str, str]]) -> list[bytes]:
        return [self.counted.compare_set(name, expected, desired) for name, expected, desired in items]
