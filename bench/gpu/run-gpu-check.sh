#!/bin/sh
# The GPU check of attention-service, from its bundle (scripts/gpu-bundle.sh
# makes the bundle; this script is copied into it). Needs only the bundle, a
# CUDA driver (>= 580 for the CUDA 13 runtime) and python3 (with PyTorch
# for the comparison with scaled_dot_product_attention).
#
#   ./run-gpu-check.sh [--quick]
#
# Results go to $OUT when set, else ./gpu-check-results: gpu-check.log,
# gpu_check.json (summary), server.log, gpu_bench.json, sdpa_bench.json.
# Exit status: 0 passed on a GPU, 2 no CUDA device, 1 failed. Details:
# run_gpu_check.py next to this script.
here=$(cd "$(dirname "$0")" && pwd)
command -v python3 >/dev/null 2>&1 ||
  { echo "run-gpu-check: python3 is needed" >&2; exit 1; }
exec python3 "$here/run_gpu_check.py" "$@"
