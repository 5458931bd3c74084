"""The transfer of a ReplicatedState restore, in a plain gloo job: a holder sends to the first of its
receivers and each passes every chunk on to the next (a chain), holders share the receivers, a
newcomer's model is received in place; every rank ends with the holders' state, bitwise.

Each runs twice: gloo's own path (every receive posted at once, every send non-blocking), and the
NCCL path's staged one over gloo with CPU staging (every chunk through one of two buffers, every
point to point in a batch_isend_irecv)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import WORKERS
from inprocess.launch import free_port


def _run(world: int, holders: list[int], chunk_bytes: int, *extra: str) -> tuple[list[int], list[dict]]:
    """The ranks of a transfer_worker job (`extra`: its optional arguments): their exit statuses,
    and the last JSON line of each that printed one (None for one that did not)."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "transfer_worker.py"), str(r), str(world), port,
                               ",".join(map(str, holders)), str(chunk_bytes), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lines = [out.strip().splitlines() for out, _ in outs]
    results = [json.loads(found[-1]) if found else None for found in lines]
    assert all(r is not None or p.returncode != 0 for r, p in zip(results, procs, strict=True)), outs
    return [p.returncode for p in procs], [r if r is not None else {"stderr": err[-3000:]}
                                            for r, (_, err) in zip(results, outs, strict=True)]


def _restore(world: int, holders: list[int], chunk_bytes: int, staging: str | None) -> list[dict]:
    codes, ranks = _run(world, holders, chunk_bytes, *([staging] if staging else []))
    assert codes == [0] * world, ranks
    return ranks


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("holders, staging", [
    ([0], None), ([0, 3], None), ([0], "cpu"),
    pytest.param([0, 3], "cpu", marks=pytest.mark.slow)],  # the staged chain of four covers its steps
    ids=["one holder, a chain of four", "two holders share them", "staged, a chain of four",
         "staged, two holders share them"])
def test_newcomers_get_the_holders_state_bitwise_through_chains(holders: list[int], staging: str | None) -> None:
    ranks = _restore(5, holders, chunk_bytes=1024, staging=staging)  # 1 KiB chunks: the state (15 kB) in many
    newcomers = [r for r in range(5) if r not in holders]
    assert len({r["digest"] for r in ranks}) == 1, ranks
    assert all(r["step"] == 2 and r["receivers"] == newcomers for r in ranks), ranks
    for r in newcomers:  # the model received into its own parameters; the rest adopted
        assert ranks[r]["nbytes"] > 0 and ranks[r]["sent"] == 0 and ranks[r]["in_place"], ranks[r]
    # each holder sends once, to the head of its share (routes: holder i the i-th, (i+h)-th, ... newcomer)
    senders = [r for r in holders if ranks[r]["sent"] > 0]
    assert senders == holders[:len(newcomers)], ranks
    shares = {h: newcomers[i::len(holders)] for i, h in enumerate(holders)}
    assert all(ranks[r]["source"] == h for h, share in shares.items() for r in share), (shares, ranks)
    # the staged path batches every point to point (it posts nothing else: test_peer_state_staged.py)
    staged = [i for i, r in enumerate(ranks) if r["staged"]["batches"]]
    assert staged == ([] if staging is None else sorted(senders + newcomers)), ranks


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_staged_source_killed_mid_transfer_fails_every_receivers_restore() -> None:
    """The staged path over gloo: holder 1 sends to the chain 0 -> 2 and SIGKILLs itself before its
    fourth send (1 KiB chunks of a 15 kB state). Rank 0's receive fails once the dead source's
    connection closes, its restore raises and it leaves; rank 2's receive from rank 0 then fails
    too: every receiver's restore raises, none hangs (the Wrapper would restart; another holder
    sends: test_peer_state.py's test of a source that dies, staged).

    On NCCL it goes otherwise: a receive from a dead peer does not fail; its kernel waits until
    the restart's abort of the group (or torch's watchdog timeout) releases it."""
    codes, ranks = _run(3, [1], 1024, "cpu", "3")
    assert codes[1] == -9, ranks
    assert codes[0] == codes[2] == 0, ranks
    for r in (0, 2):  # gloo: "Connection reset by peer" / "Connection closed by peer"
        assert "step" not in ranks[r] and "Connection" in ranks[r].get("exception", ""), ranks
    assert ranks[0]["staged"]["batches"] >= 3, ranks  # it received the three chunks sent, then lost the source
