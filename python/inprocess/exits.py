"""How a rank's process ends when the job cannot keep it (design principle 9): the exit
statuses the launcher sees, and the way out that runs no Python exit machinery.

=====  ============================================================================
75     :data:`EXIT_CODE_UNRELEASABLE`: the abort could not release the main thread
       (it stayed inside the function), or an NCCL abort was abandoned at its deadline
76     :data:`EXIT_CODE_CONTEXT_LOST`: the rank's CUDA context is lost (a sticky error);
       no restart in this process can repair it (:mod:`inprocess.gpu.errors`)
=====  ============================================================================

The rank is counted out of the job first, so that the others go on without it;
the launcher (``inprocess.launch --respawn``, SLURM, torchrun) may start a new
process that joins the job.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

EXIT_CODE_UNRELEASABLE = 75
EXIT_CODE_CONTEXT_LOST = 76


def exit_now(code: int) -> NoReturn:
    """Flush standard output and error, then ``os._exit(code)``: no finaliser and no
    logging shutdown, either of which could wait on a thread that is stuck."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not keep the process alive
            pass
    os._exit(code)
