#!/usr/bin/env bash
# Issue 30's GPU measurement and the acceptance checks, as one command for a lent GPU machine, in
# under 5 minutes (each step has a time limit; the limits add up to 4 min 55 s with their kill grace):
#
#     bash benchmarks/gpu_session.sh [OUT]     # OUT: benchmarks/results/gpu-<UTC time> by default
#
# From a checkout where torch (a CUDA build) and this package are installed (pip install -e ".[test]").
# It writes into OUT: machine.txt (nvidia-smi, versions), nccl_release.txt and nccl_release.json
# (every mode of benchmarks/nccl_release.py), nccl-logs/ (NCCL's own timestamped log of each case),
# nccl_example.txt (examples/nccl_ddp.py under torchrun with a fault), acceptance/ (tools/gpu_acceptance.py's report.md and report.json) and session.txt (what ran, how
# long, how it ended). Without a GPU it runs what it can (the restart mode on the fakes; the
# acceptance's no-GPU part) and each GPU part says it was skipped and why.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu-$(date -u +%Y%m%dT%H%M%S)}
PY=${PYTHON:-python}
mkdir -p "$OUT"
# The settings docs/gpu.md gives for an in-process restart on GPUs.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=2 TORCH_NCCL_RETHROW_CUDA_ERRORS=0 NCCL_NVLS_ENABLE=0

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND, output to OUT/NAME.txt, one line to session.txt
  local name=$1 limit=$2 started rc
  shift 2
  started=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  echo "$name: exit $rc after $(( $(date +%s) - started )) s (limit $limit s): $*" | tee -a "$OUT/session.txt"
}

{
  date -u
  nvidia-smi || echo "no nvidia-smi"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
"nccl", torch.cuda.nccl.version() if torch.version.cuda else None)'
  git rev-parse HEAD 2>/dev/null
} > "$OUT/machine.txt" 2>&1

# About 2 minutes on one H200 (estimated, not yet run there: one sample per setting of the sweep and
# of the abort paths; one round of 4 restarts for each of the three teardowns, each iteration training
# 1.5 s before its fault). Measured without a GPU (the restart mode on the fakes only): 52 s.
step nccl_release 110 "$PY" benchmarks/nccl_release.py --samples 1 --out "$OUT"
# The NCCL example under torchrun, one rank per GPU, a fault at step 20: the restart in its output, and
# the digest equal on every rank.
GPUS=$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
INPROCESS_FAULTS="exception@rank=$((GPUS - 1)),step=20" EXAMPLE_STEPS=40 \
  step nccl_example 40 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" --max-restarts=0 \
  examples/nccl_ddp.py
# The acceptance's GPU part: the GPU tests (Stage 1 on the real torch and NCCL among them) and the checks
# on real torch, NCCL and driver. Its no-GPU part (the fakes, which skip under a CUDA build of torch) is
# cut to the ABI test to keep the time.
step acceptance 130 "$PY" tools/gpu_acceptance.py --out "$OUT/acceptance" --fakes tests/test_gpu_abi.py
echo "written under $OUT"
