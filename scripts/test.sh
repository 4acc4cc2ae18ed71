#!/usr/bin/env bash
# Set up and run every test: installs the packages if missing, configures and
# builds everything in $BUILD_DIR (default build), then runs ctest.
#   ./scripts/test.sh                 all tests
#   ./scripts/test.sh -L integration  extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"
JOBS="$(nproc)"

bash scripts/install-deps.sh
BUILD_DIR="${BUILD_DIR}" bash scripts/configure.sh
cmake --build "${BUILD_DIR}" -j"${JOBS}"
cd "${BUILD_DIR}"
ctest --output-on-failure -j"${JOBS}" "$@"
