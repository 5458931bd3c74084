"""What one simulator run does: its settings, checked."""

from __future__ import annotations

import dataclasses

HOST = "127.0.0.1"
WATCHED_PEERS = 8  # peers whose heartbeat counters each monitor reads per interval (inprocess.processes.monitor)


@dataclasses.dataclass
class SimConfig:
    procs: int = 2  # client processes
    groups: int = 16  # groups of simulated ranks per client process (one thread, two connections each)
    restarts: int = 5  # restarts per N (one fault each); figures are medians over them
    kind: str = "killed"  # "killed" (monitor reports, rank leaves) or "exception" (rank reports, stays)
    decode: str = "shared"  # "shared" or "every-rank" (see measure.py)
    ranks_per_node: int = 8  # ranks per node agent and board; 0: every rank talks to the store directly
    check_membership: bool = False  # every rank hashes its decoded table (O(N) per rank: small N only)
    settle_s: float = 0.3  # after all ranks armed their waits, before measuring
    steady_s: float = 1.0  # idle window measured before each fault (every trigger parked)
    heartbeat_rounds: int = 3  # rounds of monitor heartbeats measured per N (median)
    heartbeat_interval_s: float = 30.0  # the Wrapper's default heartbeat_interval
    timeout_s: float = 120.0  # every wait and every message from a process
    joiners: int = 0  # restarts in threes: K ranks lost, K joiners admitted, a plain one (control_plane/joins.py)
    joiner_layout: str = "nodes"  # the lost ranks: whole nodes ("nodes") or single ranks far apart ("spread")
    relay: str = "native"  # the node agents' relay: "native" (NativeNodeRelay, the agent's) or "python" (NodeRelay)

    def __post_init__(self) -> None:
        for name in ("procs", "groups", "restarts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer >= 1")
        for name in ("ranks_per_node", "heartbeat_rounds", "joiners"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected an integer >= 0")
        for name in ("settle_s", "steady_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected seconds >= 0")
        for name in ("heartbeat_interval_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected seconds > 0")
        if self.kind not in ("killed", "exception"):
            raise ValueError(f"kind={self.kind!r}: expected 'killed' or 'exception'")
        if self.decode not in ("shared", "every-rank"):
            raise ValueError(f"decode={self.decode!r}: expected 'shared' or 'every-rank'")
        if self.relay not in ("native", "python"):
            raise ValueError(f"relay={self.relay!r}: expected 'native' or 'python'")
        if self.joiner_layout not in ("nodes", "spread"):
            raise ValueError(f"joiner_layout={self.joiner_layout!r}: expected 'nodes' or 'spread'")
        if self.joiners and self.restarts < 2:
            raise ValueError(f"restarts={self.restarts} with joiners={self.joiners}: expected >= 2 (the loss of K "
                             f"ranks, then the restart that admits their joiners)")
        if self.joiners and self.kind != "killed":
            raise ValueError(f"joiners={self.joiners}: joiners take the seats of killed ranks: expected kind 'killed'")

    def check_world_size(self, n: int) -> None:
        """Every restart kills (or faults) a different rank, and one rank must stay."""
        if n < 2 or n <= self.restarts:
            raise ValueError(f"N={n}: expected at least 2 ranks and more ranks than restarts ({self.restarts})")
        lost = self.joiners * ((self.restarts + 2) // 3)
        if self.joiners and n <= self.restarts + lost:
            raise ValueError(f"N={n}: {self.restarts} restarts with {self.joiners} joiners lose {lost} ranks besides "
                             f"the faults: expected more ranks than {self.restarts + lost}")
