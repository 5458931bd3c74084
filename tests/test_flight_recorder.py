"""The flight-recorder dump (inprocess.gpu.flight_recorder) against fakes of
torch's ``_dump_nccl_trace`` binding, and its files read back by torch's own
analyser (``torch.distributed.flight_recorder.components.loader``)."""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import time

import pytest

from fakes.gpu_fakes import run_python
from inprocess.abort import AbortTorchDistributed
from inprocess.gpu import flight_recorder

SLACK_S = 0.25


class FakeC10d:
    """torch's ``_dump_nccl_trace`` binding (``torch/csrc/distributed/c10d/init.cpp``, pytorch/pytorch@00814e6e):
    three optional keyword arguments, defaults includeCollectives=True,
    includeStackTraces=True, onlyActive=False; returns the pickled dump."""

    def __init__(self, rank: int = 0, hang_s: float = 0.0, fail: bool = False):
        self.rank, self.hang_s, self.fail = rank, hang_s, fail
        self.calls: list = []

    def _dump_nccl_trace(self, includeCollectives: bool | None = None, includeStackTraces: bool | None = None,
                         onlyActive: bool | None = None) -> bytes:
        self.calls.append((includeCollectives, includeStackTraces, onlyActive))
        time.sleep(self.hang_s)  # a wait without the GIL (the flight recorder's lock)
        if self.fail:
            raise RuntimeError("flight recorder disabled")
        # The keys torch's loader reads (loader.py, read_dump).
        return pickle.dumps({"version": "2.10", "pg_config": {"0": {"name": "0", "ranks": "[0, 1]"}},
                             "entries": [{"record_id": 0, "state": "started", "rank": self.rank}]})


def test_dump_asks_for_no_stack_traces_and_only_active_entries(tmp_path: os.PathLike[str]) -> None:
    fake = FakeC10d()
    path = os.path.join(str(tmp_path), "rank_0")
    assert flight_recorder.dump(path, 5.0, fake)
    assert fake.calls == [(True, False, True)]
    with open(path, "rb") as f:
        assert pickle.loads(f.read())["entries"][0]["state"] == "started"
    assert os.listdir(str(tmp_path)) == ["rank_0"]  # no temporary file left beside it


@pytest.mark.timeout(60)
def test_a_dump_that_needs_the_gil_does_not_hang_the_abort(tmp_path: os.PathLike[str]) -> None:
    # The binding keeps the GIL for the whole dump (init.cpp: no
    # gil_scoped_release); with stack traces (its default) the symbolisation
    # can wait for a thread that waits for the GIL. The fake holds the GIL
    # and never returns when asked for stack traces: a ctypes.PyDLL call does
    # not release the GIL. Nothing in that process can then run Python again,
    # the deadline's thread included, so it runs in a child with a limit.
    path = os.path.join(str(tmp_path), "rank_3")
    code = (
        "import ctypes, time\n"
        "from inprocess.gpu import flight_recorder\n"
        "class C10d:\n"
        "    def _dump_nccl_trace(self, includeCollectives=None, includeStackTraces=None, onlyActive=None):\n"
        "        if includeStackTraces is None or includeStackTraces:\n"
        "            ctypes.PyDLL(None).sleep(3600)  # holds the GIL\n"
        "        return b'dump'\n"
        "started = time.monotonic()\n"
        f"print(flight_recorder.dump({path!r}, 2.0, C10d()), round(time.monotonic() - started, 2))\n"
    )
    try:
        result = run_python(code, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the flight-recorder dump held the GIL for ever: the process could not run Python again")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "True", result.stdout
    with open(path, "rb") as f:
        assert f.read() == b"dump"


@pytest.mark.timeout(30)
def test_a_dump_that_waits_without_the_gil_is_abandoned(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(str(tmp_path), "rank_1")
    started = time.monotonic()
    assert not flight_recorder.dump(path, 0.2, FakeC10d(hang_s=10))
    assert time.monotonic() - started < 0.2 + SLACK_S and not os.path.exists(path)
    assert not flight_recorder.dump(path, 1.0, FakeC10d(fail=True))
    assert not flight_recorder.dump(path, 1.0, object())  # a torch without a flight recorder


@pytest.mark.timeout(60)
def test_torchs_analyser_reads_the_files_of_every_rank(tmp_path: os.PathLike[str]) -> None:
    loader = pytest.importorskip("torch.distributed.flight_recorder.components.loader")
    template = os.path.join(str(tmp_path), "fr", "iter_{iteration}", "rank_{rank}")
    for rank in (0, 1, 10):
        assert flight_recorder.dump(flight_recorder.trace_path(template, rank, 2), 5.0, FakeC10d(rank))
    details: dict[str, dict[str, object]]
    # The analyser is given one iteration's folder (read_dir infers the
    # prefix from the files of the folder it starts in).
    folder = os.path.join(str(tmp_path), "fr", "iter_2")
    details, version = loader.read_dir(argparse.Namespace(trace_dir=folder, prefix=None))
    assert version == "2.10"
    assert sorted((name, d["rank"]) for name, d in details.items()) == [("rank_0", 0), ("rank_1", 1), ("rank_10", 10)]


def test_names_the_analyser_cannot_read_are_refused() -> None:
    # loader.read_dump: rank = int(basename[len(prefix):]); "fr_0.bin" gives
    # int("0.bin"), a ValueError, and every file of a folder needs one prefix.
    loader = pytest.importorskip("torch.distributed.flight_recorder.components.loader")
    with pytest.raises(ValueError):
        loader.read_dump("fr_", "fr_0.bin")
    for template in ("fr_{rank}.bin", "fr_{rank}_{iteration}", "it{iteration}_rank{rank}", "x{iteration}{rank}"):
        with pytest.raises(ValueError, match="must end with {rank}"):
            flight_recorder.trace_path(template, 0, 0)
        with pytest.raises(ValueError, match="must end with {rank}"):
            AbortTorchDistributed(torch_fr_trace_path=template)
    with pytest.raises(ValueError, match="only {rank} and {iteration} may be filled in \\('host'\\)"):
        flight_recorder.trace_path("fr/{host}/rank_{rank}", 0, 0)
    assert flight_recorder.trace_path("fr/iter_{iteration}/rank_{rank}", 3, 7) == "fr/iter_7/rank_3"
    assert flight_recorder.trace_path("/tmp/fr_{rank}", 3, 7) == "/tmp/fr_3"


@pytest.mark.timeout(90)
def test_the_abort_dumps_on_the_ranks_device(tmp_path: os.PathLike[str]) -> None:
    """Issue 30, item 4 (F6): the dump runs on a thread of its own, which never had a device; it
    reads the collectives' CUDA events, and on a thread without a device the CUDA runtime makes a
    context on GPU 0. The abort hook makes the rank's device (3, its group's bound device) current
    on the dump's thread first, and no context appears anywhere (tests/fakes/fake_cuda_contexts.c)."""
    from fakes.gpu_fakes import build_fakes, skip_where_torch_is_a_cuda_build
    from test_nccl_release import run_case

    skip_where_torch_is_a_cuda_build()
    out = run_case(build_fakes(), """
        import torch._C._distributed_c10d as c10d_native
        from inprocess import abort as abort_hook
        from inprocess.state import FrozenState
        pg = FakeProcessGroupNCCL(fakes, device=3, bound=True)
        abort_hook.nccl_backends = lambda torch, dist: [pg]
        seen = []

        def dump_trace(**arguments):  # torch's binding, on the dump's thread
            seen.append(cuda.fake_cuda_thread_device())
            return b"trace"

        c10d_native._dump_nccl_trace = dump_trace
        hook = abort_hook.AbortTorchDistributed(torch_fr_trace_path=os.environ["FR_PATH"])
        on_trigger_thread(lambda: hook(FrozenState(rank=0, world_size=1, initial_rank=0, initial_world_size=1)))
        written = os.path.exists(os.environ["FR_PATH"].replace("{rank}", "0"))
        print(json.dumps({"seen": seen, "created": created(), "written": written}))
    """, FR_PATH=os.path.join(str(tmp_path), "fr_{rank}"))
    assert out["seen"] == [3] and out["written"], out
    assert set(out["created"].values()) == {0}, out
