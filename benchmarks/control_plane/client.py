"""A client process of the simulator: many simulated ranks, driven over stdin/stdout.

``python -m <package>.client``, started by :class:`~.harness.Session`: JSON
commands on stdin, one JSON answer per command on stdout.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

from .decoding import share_decoding
from .job import SimJob
from .wire import Connections


def _die_with_parent() -> None:
    """SIGKILL this process when the driver dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
    if os.getppid() == 1:
        os._exit(1)


def _command(job: SimJob | None, conns: Connections, cmd: dict[str, Any]) -> tuple[SimJob | None, Any]:
    """Runs one command: (the job from now on, the answer)."""
    what = cmd["cmd"]
    if what == "job":
        job = SimJob(conns, cmd)
        # The simulated ranks' objects live as long as the job: a real rank's collector never walks
        # 8,192 ranks' worth of them. Building them triggered full collections of up to ~0.5 s each;
        # frozen, a later full one (the next job's set-up) took ~25 ms. What the restarts allocate
        # is collected as usual.
        gc.collect()
        gc.freeze()
        return job, job.start()
    if what == "snap":
        return job, {"snap": job.requests() if job else 0}
    if job is None:
        raise RuntimeError(f"command {what!r} before a job")
    if what == "announce":
        return job, job.announce(cmd["restart"])
    if what == "fault":
        return job, job.fault(cmd["restart"])
    if what == "heartbeats":
        return job, job.heartbeat_round()
    if what == "complete":
        job.complete(cmd["iteration"])
        return job, {"completed": cmd["iteration"]}
    if what == "end":
        return None, job.end()
    raise RuntimeError(f"unknown command {what!r}")


def client_main() -> None:
    _die_with_parent()
    out = sys.stdout

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg, separators=(",", ":")) + "\n")
        out.flush()

    try:
        cfg = json.loads(sys.stdin.readline())
        if cfg["decode"] == "shared":
            share_decoding()
        conns = Connections(cfg["port"], cfg["groups"], cfg["timeout_s"], cfg["relay"])
        send({"connections": conns.count})
        job: SimJob | None = None
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            job, answer = _command(job, conns, cmd)
            send(answer)
    except BaseException as e:
        send({"error": f"{type(e).__name__}: {e}"})
    finally:
        out.flush()
        # Group threads may still block in store waits: leave without joining them.
        os._exit(0)


if __name__ == "__main__":
    client_main()
