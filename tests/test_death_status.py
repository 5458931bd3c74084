"""A rank's death is described by its real wait status even when its parent reaped it before
its monitor looked (inprocess/processes/monitor.py): a SIGKILLed rank 0 was once summarised as
"exited: RankExited" while the launcher said 137."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from inprocess.processes import process_status

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("how, described", [
    ("kill", ("killed", "SIGKILL")),
    ("exit", ("exited", "exit code 3")),
])
def test_a_rank_reaped_by_its_launcher_first_keeps_its_cause(how: str, described: tuple[str, str]):
    code = "import time; time.sleep(30)" if how == "kill" else "import os; os._exit(3)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        start_time = process_status.start_time(child.pid)
        pidfd = os.pidfd_open(child.pid)
        if how == "kill":
            os.kill(child.pid, signal.SIGKILL)
        child.wait(10)  # the launcher reaps it: /proc/<pid> is gone before the monitor reads it
        assert process_status.zombie_status(child.pid, start_time) is None
        status = process_status.exit_status(child.pid, start_time, pidfd)
        if status is None:
            pytest.skip(f"this kernel ({os.uname().release}) keeps no exit status for a pidfd "
                        "(PIDFD_INFO_EXIT needs Linux 6.15)")
        assert process_status.describe_status(status) == described
        os.close(pidfd)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_an_unreadable_status_says_so():
    assert process_status.reaped_status(-1) is None
    assert process_status.describe_status(None) == ("exited", "RankExited")
