"""What a seat holds: the last barrier its rank was counted at, by whom, in which life.

A seat (one of the slots of ``seat/<g>``, :mod:`inprocess.control.seat_table`) counts one
process exactly once per barrier. A seat outlives its process: once the
process is counted out, a process that joins the running job
(:mod:`inprocess.control.joining`) may be admitted into the same seat. Each
such admission starts a new *life* of the seat, and the life is part of every
value the seat holds, so that a late claim made for the process of an earlier
life (a slow monitor declaring it lost) can never count the new one out.

Values, as written by compare_set only:

==================  ==========================================================
``b``               counted healthy at barrier b, life 0 (the job's first
                    processes: these values are the ones every seat held
                    before joins existed)
``b@L``             counted healthy at barrier b, life L > 0
``tb:who``          counted out at barrier b by ``who``, life 0
``tb:who@L``        counted out at barrier b by ``who``, life L > 0
==================  ==========================================================

A joined process's seat is set to ``b@L`` by the leader that admits it at
barrier b: the process takes part in iteration b and takes its seat at
barrier b+1 like everyone. This module imports no torch.
"""

from __future__ import annotations

import dataclasses

from ..exception import InternalError


@dataclasses.dataclass(frozen=True)
class Seat:
    """A seat's value, parsed."""

    barrier: int
    life: int = 0
    out_by: str | None = None  # who counted the process out; None: counted healthy

    @property
    def counted_out(self) -> bool:
        return self.out_by is not None

    def encode(self) -> str:
        text = str(self.barrier) if self.out_by is None else f"t{self.barrier}:{self.out_by}"
        return text if self.life == 0 else f"{text}@{self.life}"


def healthy(barrier: int, life: int = 0) -> str:
    # Seat(barrier, life).encode(), without the object: a node agent writes one per rank and barrier.
    return str(barrier) if life == 0 else f"{barrier}@{life}"


def counted_out(barrier: int, who: str, life: int = 0) -> str:
    return Seat(barrier, life, who).encode()


def before_barrier(barrier: int, life: int = 0) -> str:
    """What the seat of a member of life ``life`` holds before it arrives at ``barrier``:
    "" before barrier 0 (nobody wrote it; life 0 only)."""
    if barrier == 0 and life == 0:
        return ""
    return healthy(barrier - 1, life)


def parse(value: str) -> Seat:
    """A seat's value as this module writes it (InternalError naming it otherwise)."""
    text, life = value, 0
    if "@" in value:
        text, _, life_text = value.rpartition("@")
        if not life_text.isdigit() or int(life_text) <= 0:
            raise InternalError(f"seat value {value!r}: life {life_text!r} is not a positive integer")
        life = int(life_text)
    try:
        if text.startswith("t"):
            barrier_text, _, who = text[1:].partition(":")
            if not who:
                raise ValueError("no claimant")
            return Seat(int(barrier_text), life, who)
        return Seat(int(text), life)
    except ValueError:
        raise InternalError(f"seat value {value!r}: expected 'b', 't<b>:<who>', either with '@<life>'") from None


class SeatTaken(Exception):
    """This rank was counted out of the job by another process (its monitor, or
    a peer's monitor that declared it lost): it must leave without counting."""
