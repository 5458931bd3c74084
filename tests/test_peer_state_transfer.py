"""The transfer of a ReplicatedState restore, in a plain gloo job: a holder sends to the first of its
receivers and each passes every chunk on to the next (a chain), holders share the receivers, a
newcomer's model is received in place; every rank ends with the holders' state, bitwise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import WORKERS
from inprocess.launch import free_port


def _restore(world: int, holders: list[int], chunk_bytes: int) -> list[dict]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "transfer_worker.py"), str(r), str(world), port,
                               ",".join(map(str, holders)), str(chunk_bytes)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("holders", [[0], [0, 3]], ids=["one holder, a chain of four", "two holders share them"])
def test_newcomers_get_the_holders_state_bitwise_through_chains(holders: list[int]) -> None:
    ranks = _restore(5, holders, chunk_bytes=1024)  # 1 KiB chunks: the state (15 kB) in many
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
