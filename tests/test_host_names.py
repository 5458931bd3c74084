"""No reverse DNS lookup on the store's path (inprocess/control/host_names.py).

The slow resolver is reproduced for real: each scenario runs in a network and
mount namespace of its own (``unshare -rnm``) whose only nameserver is a UDP
socket that drops queries (tests/workers/netns_resolver.py), with /etc/hosts
lacking the IPv4-mapped loopback entry.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch.distributed  # noqa: F401  (loads libtorch: what force_numeric_host_names looks for)

from inprocess import _native
from inprocess.control.host_names import TORCH_LIBRARIES

DRIVER = pathlib.Path(__file__).parent / "workers" / "netns_resolver.py"


def test_redirects_torch_libraries_only():
    try:
        libraries = _native.force_numeric_host_names(list(TORCH_LIBRARIES))
        assert any(pathlib.Path(p).name.startswith("libtorch_cpu") for p in libraries), libraries
        assert all(pathlib.Path(p).name.startswith(TORCH_LIBRARIES) for p in libraries), libraries
        assert _native.force_numeric_host_names(list(TORCH_LIBRARIES)) == libraries  # idempotent
        assert _native.force_numeric_host_names(["libno-such-library"]) == []
    finally:
        restored = _native.restore_host_names()
        restored_again = _native.restore_host_names()
        # tests/conftest.py redirected them for the whole test process: so they stay for the tests after this one.
        redone = _native.force_numeric_host_names(list(TORCH_LIBRARIES))
    assert restored >= 1
    assert restored_again == 0
    assert redone == libraries


def _namespaces_available() -> str:
    """Empty if an unprivileged network+mount namespace can be made here, else why not."""
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["unshare", "-rnm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -rnm failed: {probe.stderr.strip()[:200]}"
    return ""


def in_namespace(scenario: str, workdir: pathlib.Path, drop_every: int, timeout: float) -> dict:
    why = _namespaces_available()
    if why:
        pytest.skip(f"needs a network namespace of the test's own: {why}")
    proc = subprocess.run(["unshare", "-rnm", sys.executable, str(DRIVER), scenario, str(workdir), str(drop_every)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{scenario}: exit {proc.returncode}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_namespace_reproduces_the_stall_with_torch_alone(tmp_path):
    """The control: torch's TCPStore as it is waits the resolver's timeout (2 s) on a dropped query."""
    result = in_namespace("torch_store", tmp_path, drop_every=7, timeout=100)
    if result["queries"] == 0:
        pytest.skip("this machine's name service does not ask the nameserver of resolv.conf (nsswitch)")
    assert "1.0.0.127.in-addr.arpa" in result["names"], result["names"]
    assert result["dropped"] >= 1
    assert max(result["connect_s"]) >= 1.5, result


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_inprocess_store_makes_no_reverse_lookup(tmp_path):
    result = in_namespace("inprocess_store", tmp_path, drop_every=7, timeout=100)
    assert result["queries"] == 0, result["names"]
    assert len(result["connect_s"]) == 13
    assert max(result["connect_s"]) < 1.0, result


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_of_twenty_restarts_under_a_resolver_that_drops_everything(tmp_path):
    result = in_namespace("soak", tmp_path, drop_every=1, timeout=280)
    assert result["returncodes"] == [0, 0, 0, 0], result["output"]
    assert result["queries"] == 0, result["names"]
    for rank, log in enumerate(result["ranks"]):
        assert log is not None, f"rank {rank} wrote no result:\n{result['output']}"
        assert log["result"]["iteration"] == 20, (rank, log["result"])
        assert log["iterations"][-1]["world_size"] == 4
        assert len(log["restarts"]) == 20
        # The trigger's connection, then one per iteration for the function's rendezvous.
        assert len(log["clone_s"]) == 22, log["clone_s"]
        assert max(log["clone_s"]) < 1.0, (rank, log["clone_s"])
