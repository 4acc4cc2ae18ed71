#!/usr/bin/env bash
# Configures the build directory ($BUILD_DIR, default build) with Ninja if it
# is not configured yet. ATTN_CUDA stays AUTO: the CUDA backend is built when
# nvcc is found. Extra arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
generator=()
if [[ ! -f "${BUILD_DIR}/CMakeCache.txt" ]]; then
  generator=(-G Ninja)
fi
cmake -S . -B "${BUILD_DIR}" "${generator[@]}" "$@"
