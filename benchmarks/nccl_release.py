"""Where the time of an NCCL release goes on a real GPU, and how much of it a restart waits for.

    python benchmarks/nccl_release.py --out benchmarks/results/nccl   # every mode, about 3 minutes on 1 GPU
    python benchmarks/nccl_release.py --modes restart,sweep           # some modes
    python benchmarks/nccl_release.py --smoke                         # one sample each; no GPU: the fakes' part

NCCL stops a communicator's kernels when its abort is called, but the call returns only once the
communicator's proxy threads have exited, and they read the abort flag only before each 500 ms poll
(NCCL 2.29.7 ``src/proxy.cc`` lines 1663 and 1835). Modes, each in fresh processes:

- ``steps`` (one rank, two groups): the library's steps one by one, revoke included;
- ``aborts`` (one rank, four groups): torch's serial path (each group's ``abort()`` after the other,
  as ``destroy_process_group``'s shutdowns) beside the library's concurrent one;
- ``sweep`` (one rank): the teardown after 0.025 to 1.25 s since the group's init, revoke on and off:
  it lands on a poll boundary;
- ``poll_cap`` (one rank): the sweep's first delay with ``benchmarks/poll_cap.c`` preloaded, which
  caps the proxy's 500 ms ``poll`` at 5 ms: the cause, shown;
- ``multi_rank``: every rank releases at the same instant (revoke on and off), one rank per GPU, or
  two ranks on one GPU where NCCL 2.30+ allows it (``NCCL_MULTI_RANK_GPU_ENABLE=1``);
- ``restart``: a wrapped job restarting, rounds alternating the teardown inside the abort
  (``AbortTorchDistributed(overlap_teardown=False)``, before), beside the rest of the restart
  (the default, Stage 1) and beside the next iteration too (``overlap_next_iteration=True``,
  Stage 2, whose first restart waits to measure the memory the teardown frees): the abort phase,
  the teardown, the gate's wait and the critical path (the restart trigger woke -> the function
  called again). Without a GPU it runs on the fakes of ``tests/fakes`` (a fake NCCL whose abort
  takes 1 s, communicators of 1 GiB on a 16 GiB device): a model of the schedule, not NCCL.

``--out DIR`` writes ``nccl_release.json`` and NCCL's own log of each case (``NCCL_DEBUG=INFO``,
timestamped to the microsecond) there; without it nothing is written. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import reaping  # benchmarks/reaping.py: this script's folder is first on the path

HERE = pathlib.Path(__file__).resolve().parent
CASES = HERE / "nccl_release_cases.py"
MODES = ("steps", "aborts", "sweep", "poll_cap", "multi_rank", "restart")
STAGES = {"inside": "inside the abort", "stage1": "beside (Stage 1)", "stage2": "beside next (Stage 2)"}
DELAYS = (0.025, 0.25, 0.5, 0.75, 1.0, 1.25)
CASE_TIMEOUT_S = 240
NCCL_LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,PROXY", "NCCL_DEBUG_TIMESTAMP_LEVELS": "ALL",
                "NCCL_DEBUG_TIMESTAMP_FORMAT": "[%T.%6f] "}


class Skipped(Exception):
    """A mode this machine cannot run; the message says why."""


def run_case(name: str, arguments: dict[str, Any], env: dict[str, str] | None = None,
             log: pathlib.Path | None = None) -> dict[str, Any]:
    full = dict(os.environ, **(env or {}))
    if log is not None:
        full.update(NCCL_LOG_ENV, NCCL_DEBUG_FILE=str(log) + ".%p")
    done = subprocess.run([sys.executable, str(CASES), name, json.dumps(arguments)], capture_output=True,
                          text=True, timeout=CASE_TIMEOUT_S, env=full, start_new_session=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"case {name} ended {done.returncode}: {done.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def run_job(arguments: dict[str, Any], ranks: int, env: dict[str, str], log: pathlib.Path | None) -> list[Any]:
    """``case_restart`` or ``case_multi_rank`` as a job of `ranks` processes (one report per rank)."""
    from inprocess.launch import LocalJob

    job_env = dict(env)
    if log is not None:
        job_env.update(NCCL_LOG_ENV, NCCL_DEBUG_FILE=str(log) + ".%p")
    with LocalJob([str(CASES), arguments.pop("case"), json.dumps(arguments)], ranks, env=job_env) as job:
        job.wait(CASE_TIMEOUT_S)
    if any(rp.returncode != 0 for rp in job.ranks):
        raise RuntimeError(f"job ended {[rp.returncode for rp in job.ranks]}:\n{job.outputs()[-3000:]}")
    return [json.loads(rp.output.strip().splitlines()[-1]) for rp in job.ranks]


def build_poll_cap(folder: pathlib.Path) -> pathlib.Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise Skipped("no C compiler to build benchmarks/poll_cap.c")
    out = folder / "poll_cap.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(HERE / "poll_cap.c"), "-ldl"], check=True,
                   capture_output=True, timeout=60)
    return out


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.version.cuda is not None else 0


def nccl_version() -> tuple[int, ...]:
    import torch

    return tuple(torch.cuda.nccl.version())


# -- the modes ----------------------------------------------------------------------------------


def mode_steps(ctx: Context) -> dict[str, Any]:
    ctx.need_gpu()
    return run_case("steps", {}, log=ctx.log("steps"))


def mode_aborts(ctx: Context) -> dict[str, Any]:
    ctx.need_gpu()
    return run_case("aborts", {"groups": 4, "samples": ctx.samples}, log=ctx.log("aborts"))


def mode_sweep(ctx: Context) -> dict[str, Any]:
    ctx.need_gpu()
    delays = DELAYS[:2] if ctx.smoke else DELAYS
    return run_case("sweep", {"delays": list(delays), "revokes": [False, True], "samples": ctx.samples},
                    log=ctx.log("sweep"))


def mode_poll_cap(ctx: Context) -> dict[str, Any]:
    shim = build_poll_cap(ctx.scratch)  # built first: on a machine without a GPU, it still shows it builds
    if ctx.gpus == 0:
        raise Skipped("needs an NVIDIA GPU and a CUDA build of torch (benchmarks/poll_cap.c built)")
    arguments = {"delays": [DELAYS[0]], "revokes": [False], "samples": ctx.samples}
    return {"without": run_case("sweep", arguments), "with 5 ms poll cap": run_case(
        "sweep", arguments, env={"LD_PRELOAD": str(shim), "POLL_CAP_MS": "5"}, log=ctx.log("poll_cap"))}


def mode_multi_rank(ctx: Context) -> dict[str, Any]:
    ctx.need_gpu()
    n, env = ctx.gpus, {}
    if n < 2:
        version = nccl_version()
        if version < (2, 30):
            raise Skipped(f"needs 2 GPUs, or NCCL 2.30 or later for two ranks on one GPU (torch's NCCL is "
                          f"{'.'.join(map(str, version))})")
        n, env = 2, {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    arguments = {"case": "multi_rank", "gpus": ctx.gpus, "revokes": [False, True], "samples": ctx.samples}
    return {"ranks": n, "per_rank": run_job(arguments, n, env, ctx.log("multi_rank"))}


def mode_restart(ctx: Context) -> dict[str, Any]:
    # A fault at once in every iteration is a storm: the brake (inprocess/engine/storm.py) would back
    # off from the third restart on, and the rows would time its back-off instead.
    env: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
                           "NCCL_NVLS_ENABLE": "0", "INPROCESS_RESTART_STORM": "off"}
    ranks, fakes = max(ctx.gpus, 1), ctx.gpus == 0
    if fakes:
        env.update(ctx.fake_env())
    rounds: list[Any] = []
    for _ in range(1 if ctx.samples == 1 else 2):  # each way in turn; two rounds unless one sample is asked for
        for stage in STAGES:
            arguments = {"case": "restart", "fakes": fakes, "stage": stage, "restarts": 2 if ctx.smoke else 4,
                         "finalize_ms": ctx.finalize_ms, "run_ms": ctx.run_ms}
            # Stage 2 makes NCCL calls beside the old communicators' aborts on purpose: the fake counts them.
            strict = {"FAKE_NCCL_ALONE_DURING_ABORT": "0"} if fakes and stage == "stage2" else {}
            rounds.append(run_job(arguments, ranks, {**env, **strict}, None if fakes else ctx.log(f"restart-{stage}")))
    return {"ranks": ranks, "fakes": fakes, "finalize_ms": ctx.finalize_ms, "run_ms": ctx.run_ms, "rounds": rounds}


class Context:
    def __init__(self, args: argparse.Namespace, scratch: pathlib.Path):
        self.smoke = args.smoke
        self.samples = 1 if args.smoke else args.samples
        self.out: pathlib.Path | None = pathlib.Path(args.out) if args.out else None
        self.scratch = scratch
        self.gpus = gpus()
        self.finalize_ms = args.finalize_ms
        self.run_ms = args.run_ms

    def need_gpu(self) -> None:
        if self.gpus == 0:
            raise Skipped("needs an NVIDIA GPU and a CUDA build of torch")

    def log(self, name: str) -> pathlib.Path | None:
        if self.out is None:
            return None
        (self.out / "nccl-logs").mkdir(parents=True, exist_ok=True)
        return self.out / "nccl-logs" / name

    def fake_env(self) -> dict[str, str]:
        """The fake NCCL (tests/fakes), whose abort takes 1 s (NCCL's proxy poll, modelled)."""
        sys.path.insert(0, str(HERE.parent / "tests"))
        try:
            from fakes.gpu_fakes import build_fakes

            fakes = build_fakes()
        except BaseException as e:  # pytest's skip when there is no C compiler
            raise Skipped(f"no GPU, and the fakes could not be built: {e}") from None
        return {"FAKE_PATHS": json.dumps(fakes.paths), "INPROCESS_LIBNCCL": fakes["nccl"], "FAKE_NCCL_MODE": "ok",
                "FAKE_NCCL_TEARDOWN_MS": "1000", "FAKE_NCCL_ALONE_DURING_ABORT": "1",
                "FAKE_NCCL_COMM_BYTES": str(1 << 30), "FAKE_CUDA_MEMORY_BYTES": str(16 << 30)}


RUNNERS = {"steps": mode_steps, "aborts": mode_aborts, "sweep": mode_sweep, "poll_cap": mode_poll_cap,
           "multi_rank": mode_multi_rank, "restart": mode_restart}


# -- the report ---------------------------------------------------------------------------------


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{statistics.median(ordered):8.1f} {ordered[-1]:8.1f}"


def print_restart(result: dict[str, Any]) -> None:
    print(f"\nrestart ({result['ranks']} rank(s){', fakes: a model, NCCL abort = 1 s' if result['fakes'] else ''}, "
          f"finalize {result['finalize_ms']} ms, {result['run_ms']} ms of training before each fault)   "
          "median / max ms over every rank and restart")
    columns = ("abort", "finalize", "health_check", "barrier", "teardown_ms", "gate_ms", "decided_to_call",
               "critical_path")
    print(f"  {'NCCL teardown':22s}" + "".join(f"{c.removesuffix('_ms'):>18s}" for c in columns))
    by_stage: dict[str, list[dict[str, Any]]] = {stage: [] for stage in STAGES}
    for job in result["rounds"]:
        for rank in job:
            by_stage[rank["stage"]].extend(rank["restarts"])
    measuring = [r for r in by_stage["stage2"] if not r.get("beside_next")]
    by_stage["stage2"] = [r for r in by_stage["stage2"] if r.get("beside_next")]
    for stage, records in by_stage.items():
        print(f"  {STAGES[stage]:22s}" + "".join(f"{_stats([r[c] for r in records if c in r]):>18s}" for c in columns))
    print(f"  (Stage 2: {len(measuring)} restart(s) waited to measure the memory the teardown frees, left out above)")
    before = [r["critical_path"] for r in by_stage["inside"]]
    for stage in ("stage1", "stage2"):
        after = [r["critical_path"] for r in by_stage[stage]]
        if before and after:
            print(f"  critical path {STAGES[stage]} / inside the abort (medians): "
                  f"{statistics.median(after) / statistics.median(before):.2f}")


def _sample_rows(prefix: str, value: Any) -> list[str]:
    """Every list of samples under `value` (nested dicts and lists of per-rank dicts), one row each."""
    if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
        return [f"  {prefix:52s} {_stats([float(v) for v in value]):>18s}"]
    if isinstance(value, list):
        return [row for i, v in enumerate(value) for row in _sample_rows(f"{prefix} [{i}]", v)]
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _sample_rows(f"{prefix} {k}".strip(), v)]
    return []


def print_report(results: dict[str, Any]) -> None:
    for mode, result in results.items():
        if "skipped" in result:
            print(f"{mode:12s} skipped: {result['skipped']}")
        elif mode == "restart":
            print_restart(result)
        elif mode == "steps":
            for name, value in result.items():
                print(f"{mode:12s} {name:40s} {value if isinstance(value, str) else f'{value:9.1f} ms'}")
        else:
            print(f"\n{mode}   ms, median / max")
            print("\n".join(_sample_rows("", result)))


def main() -> int:
    reaping.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--samples", type=int, default=3, help="samples per setting (default 3)")
    parser.add_argument("--finalize-ms", type=int, default=200,
                        help="the restart mode's finalize hook sleeps this long (a user's finalize; default 200)")
    parser.add_argument("--run-ms", type=int, default=1500,
                        help="the restart mode's iterations train this long before their fault (default 1500)")
    parser.add_argument("--out", default=None, help="folder for nccl_release.json and NCCL's logs")
    parser.add_argument("--smoke", action="store_true", help="one sample, fewer delays and restarts")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.samples < 1 or args.finalize_ms < 0 or args.run_ms < 0:
        parser.error(f"--modes={args.modes!r} --samples={args.samples} --finalize-ms={args.finalize_ms} "
                     f"--run-ms={args.run_ms}: expected modes of {MODES}, samples >= 1, finalize-ms >= 0, run-ms >= 0")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nccl-release-") as scratch:
        ctx = Context(args, pathlib.Path(scratch))
        for mode in modes:
            try:
                results[mode] = RUNNERS[mode](ctx)
            except Skipped as e:
                results[mode] = {"skipped": str(e)}
    import torch

    print(f"torch {torch.__version__}, {ctx.gpus} GPU(s)"
          + (f", NCCL {'.'.join(map(str, nccl_version()))}, {torch.cuda.get_device_name(0)}" if ctx.gpus else ""))
    print_report(results)
    line = json.dumps({"benchmark": "nccl_release", "torch": torch.__version__, "gpus": ctx.gpus, **results},
                      separators=(",", ":"))
    print(line, flush=True)
    if ctx.out is not None:
        ctx.out.mkdir(parents=True, exist_ok=True)
        (ctx.out / "nccl_release.json").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
