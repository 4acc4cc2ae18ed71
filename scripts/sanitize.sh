#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer suite: configures $BUILD_DIR
# (default build-asan) with ATTN_SANITIZE=ON, the CPU backend only and no
# benchmarks, builds it and runs the `unit` and `integration` tests. Any
# sanitizer report fails the test that produced it, server processes the
# tests spawn included (they inherit the options below).
#   ./scripts/sanitize.sh              all unit + integration tests
#   ./scripts/sanitize.sh -R Engine    extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build-asan}"
JOBS="$(nproc)"

bash scripts/install-deps.sh
BUILD_DIR="${BUILD_DIR}" bash scripts/configure.sh \
  -DATTN_SANITIZE=ON -DATTN_CUDA=OFF -DATTN_BUILD_BENCH=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "${BUILD_DIR}" -j"${JOBS}"

# abort_on_error: a report kills the process with SIGABRT, so even a child
# whose exit code a test ignores is seen dying. Leak reports are filtered
# only by tests/sanitizers/lsan.supp (Debian's prebuilt libraries).
source scripts/sanitizer-env.sh
cd "${BUILD_DIR}"
ctest --output-on-failure -j"${JOBS}" -L '^(unit|integration)$' "$@"
