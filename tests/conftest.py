"""Shared helpers: run a multi-process job of tests/workers/*.py and read what every rank saw."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time
import warnings
from typing import Any

import pytest
import torch.distributed  # noqa: F401  (loads libtorch, whose getnameinfo numeric_host_names redirects)

from inprocess.control.host_names import numeric_host_names
from inprocess.launch import LocalJob

WORKERS = pathlib.Path(__file__).parent / "workers"


def pytest_configure(config: pytest.Config) -> None:
    """The test process's own stores make no reverse DNS lookup, as the library's do.

    Tests open raw ``torch.distributed.TCPStore`` servers and clients in this process; torch names
    each connection with ``getnameinfo()`` of ``::ffff:127.0.0.1``, which no /etc/hosts lists by
    default, so every connection asked the network's resolver, and a dropped query stalled the
    test (and, on a legacy server, every client of it) for the resolver's timeout: 5 s. Which test
    met the dropped query depended on how many lookups the modules before it had made. The
    library's own redirect (inprocess/control/host_names.py) is applied here once, before any test.
    """
    if not numeric_host_names():
        warnings.warn("torch's getnameinfo was not redirected in the test process: its stores make reverse DNS "
                      "lookups, and a slow resolver can stall the timed tests", stacklevel=1)
    _take_back_sigint()


def _take_back_sigint() -> None:
    """SIGINT as a terminal gives it, for this process and every process the tests start.

    A suite started in the background of a non-interactive shell (``cmd &``, as a CI script or
    ``nohup`` may) inherits SIGINT ignored, and an ignored signal stays ignored across fork and
    exec: the jobs that the tests stop with SIGINT (a scheduler's signal, a Ctrl-C to a
    benchmark) would never see it. A handler, unlike SIG_IGN, is reset to the default at exec.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class JobResult:
    def __init__(self, job: LocalJob, out_dir: pathlib.Path):
        self.job = job
        self.returncodes = [rp.returncode for rp in job.ranks]
        self.logs: list[dict[str, Any] | None] = []
        for rank in range(job.world_size):
            path = out_dir / f"rank{rank}.json"
            self.logs.append(json.loads(path.read_text()) if path.exists() else None)

    def describe(self) -> str:
        return self.job.outputs()[-20000:]

    def rank(self, r: int) -> dict[str, Any]:
        log = self.logs[r]
        assert log is not None, f"rank {r} wrote no result (rc={self.returncodes[r]}):\n{self.describe()}"
        return log


def assert_excluded(res: JobResult, excluded: int, fault_kinds: set[str]) -> dict[str, Any]:
    """``excluded`` left the job in iteration 0; every other rank finished
    iteration 1 with one rank fewer. Returns the first restart's record."""
    others = [r for r in range(res.job.world_size) if r != excluded]
    for r in others:
        log = res.rank(r)
        assert res.returncodes[r] == 0, f"rank {r}:\n{res.describe()}"
        assert log["result"]["iteration"] == 1
        assert log["iterations"][-1]["world_size"] == res.job.world_size - 1
    restart = res.rank(others[0])["restarts"][0]
    assert restart["terminated"] == [excluded], restart
    kinds = {f["kind"] for f in restart["faults"] if f["rank"] == excluded}
    assert kinds and kinds <= fault_kinds, restart
    return restart


def run_job(
    tmp_path: pathlib.Path,
    plan: dict[str, Any],
    world_size: int = 4,
    timeout: float = 90.0,
    worker: str = "ddp_worker.py",
    env: dict[str, str] | None = None,
    ranks_per_node: int | None = None,
) -> JobResult:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    job_env = {
        "INPROCESS_TEST_OUT": str(out),
        "INPROCESS_TEST_PLAN": json.dumps(plan),
        "INPROCESS_TEST_DUMP_AFTER": str(max(5.0, timeout - 10)),
        "INPROCESS_TEST_LOG": os.environ.get("INPROCESS_TEST_LOG", "INFO"),
    }
    job_env.update(env or {})
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with LocalJob([str(WORKERS / worker)], world_size, env=job_env, ranks_per_node=ranks_per_node) as job:
        job.wait(timeout)
        # Every rank has exited: what they started (monitors, the store host)
        # must go by itself, before the harness kills the process groups.
        left = leftover_processes({rp.popen.pid for rp in job.ranks}, grace=10.0)
        assert not left, f"processes of the job still running after every rank exited: {left}\n{job.outputs()[-5000:]}"
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not (shm_after - shm_before), f"shared memory left in /dev/shm: {sorted(shm_after - shm_before)}"
    return JobResult(job, out)


def leftover_processes(pgids: set[int], grace: float) -> list[str]:
    """Live (non-zombie) processes in the given process groups, after waiting up to ``grace`` s."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    raw = f.read()
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            fields = raw[raw.rfind(")") + 2:].split()
            if fields[0] != "Z" and int(fields[2]) in pgids:
                found.append(f"pid {name}: {cmd}")
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


@pytest.fixture
def job(tmp_path: pathlib.Path):  # type: ignore[no-untyped-def]
    def run(plan: dict[str, Any], **kwargs: Any) -> JobResult:
        return run_job(tmp_path, plan, **kwargs)

    return run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that runs a job through the ``job`` fixture starts processes: marked so, wherever it is."""
    for item in items:
        if "job" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)
