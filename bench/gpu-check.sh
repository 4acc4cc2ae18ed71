#!/usr/bin/env bash
# GPU check on a machine that has both a GPU and the build dependencies:
# builds the bundle (scripts/gpu-bundle.sh) and runs its runner here. On a
# bare GPU machine (no -dev packages, no network), build the bundle on a
# development machine instead, copy build/gpu-bundle/ over and run
# run-gpu-check.sh there; see bench/README.md.
#
#   bench/gpu-check.sh [--quick]
#
# Environment: BUILD_DIR (default build), OUT (results; default
# $BUILD_DIR/gpu-check), as for scripts/gpu-bundle.sh and run-gpu-check.sh.
# Exit status: the runner's: 0 passed, 2 no CUDA device, 1 failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
BUILD_DIR="$BUILD" bash "$ROOT/scripts/gpu-bundle.sh" "$BUILD/gpu-bundle"
OUT="${OUT:-$BUILD/gpu-check}" exec "$BUILD/gpu-bundle/run-gpu-check.sh" "$@"
