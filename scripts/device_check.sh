#!/usr/bin/env bash
# The prepared GPU check: a ViT-L bf16 training step (clip-samples/s, peak memory vs the estimate, MFU
# vs the GPU's measured bf16 matmul peak) and a 2-site federation round end to end on the GPU, run
# twice with the hashes compared; one JSON (default reports/device_check.json). About 3-8 minutes
# on one GPU, needing only this repository installed (bash scripts/setup.sh, with a CUDA build of torch).
#
#   bash scripts/device_check.sh                  # on a CUDA machine
#   bash scripts/device_check.sh --dry-run        # every part on the CPU at toy sizes (tests/test_device_check.py)
#   bash scripts/device_check.sh --out FILE       # write the JSON elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1 DO_NOT_TRACK=1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-90}"
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # deterministic cuBLAS, set before torch starts
exec python -m benchmarks.device_check "$@"
