"""Runs an example script as ``__main__`` and records, per iteration of its wrapped
call, when this rank's first optimizer step ended (CLOCK_MONOTONIC), without a
change to the example: a global optimizer step hook of torch.

    python benchmarks/example_timing.py OUT_DIR examples/minimal.py [args...]

Writes ``OUT_DIR/steps<RANK>.json`` ({"iteration": first step's t_ns}) at exit.
Used by ``benchmarks/example_restarts.py``.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
from typing import Any


def main() -> None:
    out_dir, script, *args = sys.argv[1:]
    first_step_ns: dict[int, int] = {}

    from torch.optim.optimizer import register_optimizer_step_post_hook

    import inprocess

    def after_step(optimizer: Any, hook_args: Any, hook_kwargs: Any) -> None:
        call = inprocess.current_call()
        if call is not None and call.iteration not in first_step_ns:
            first_step_ns[call.iteration] = time.monotonic_ns()

    register_optimizer_step_post_hook(after_step)

    def write() -> None:
        path = os.path.join(out_dir, f"steps{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump({str(k): v for k, v in first_step_ns.items()}, f)

    atexit.register(write)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
