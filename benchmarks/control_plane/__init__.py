"""Control-plane simulator: restarts of N simulated ranks against one TCPStore.

Runs the library's own store protocol
(:class:`inprocess.control.protocol.RestartProtocol`, ``decide`` and the node
agent's :class:`inprocess.processes.node_agent.NodeRelay` over real
:class:`inprocess._native.NodeBoard` boards; imported, not copied) for N
simulated ranks, and reports per N how long the restart's control plane takes
and what it costs the store, in two modes: **node mode** (ranks in nodes of
``ranks_per_node``, each node with a board and an agent relay, as the
wrapper sets them up when the launcher describes several nodes) and **direct
mode** (every rank talks to the store itself). See ``benchmarks/control_plane.md``.

Command line: ``python benchmarks/control_plane_sim.py --help`` (or
``python -m benchmarks.control_plane`` from the repository root). From
Python::

    from benchmarks.control_plane import SimConfig, simulate
    result = simulate(64, SimConfig(restarts=2, ranks_per_node=8))

Modules, by concept: :mod:`.config` (what a run does), :mod:`.harness`
(the server, the client processes, :class:`Session`), :mod:`.client` (a
client process's command loop), :mod:`.job` (the simulated ranks of one
job in one process: setup, faults), :mod:`.joins` (``--joiners``: seats
lost, then taken back by joiners through the real join protocol),
:mod:`.ranks` and :mod:`.nodes` (how
simulated ranks and nodes share threads and connections), :mod:`.wire` (the
store a simulated rank sees, bytes on the wire), :mod:`.decoding`,
:mod:`.measure` (figures and checks), :mod:`.report` (tables, markdown,
plot), :mod:`.__main__` (the command line).
"""

from .config import SimConfig
from .harness import Session, simulate
from .measure import expected_row, pick_faulty

__all__ = ["Session", "SimConfig", "expected_row", "pick_faulty", "simulate"]
