#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (ASan + UBSan +
# coverage) in $BUILD_DIR (default build-fuzz) and fuzzes each for
# FUZZ_SECONDS (default 60) seconds, starting from its checked-in corpus
# (tests/fuzz/corpus/<target>). Fails on any crash, leak, sanitizer report,
# timeout or memory blow-up; libFuzzer then writes the input to
# $BUILD_DIR/fuzz-artifacts/<target>/ — add it to the target's corpus as a
# regression input once the bug is fixed. Inputs found to widen coverage go
# to $BUILD_DIR/fuzz-corpus/<target>/ (not the checked-in corpus).
#   ./scripts/fuzz.sh                    every target, 60 s each
#   FUZZ_SECONDS=600 ./scripts/fuzz.sh engine_ops_fuzzer
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build-fuzz}"
FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
JOBS="$(nproc)"
targets=("$@")
if ((${#targets[@]} == 0)); then
  targets=(proto_convert_fuzzer engine_ops_fuzzer parse_budget_fuzzer)
fi

bash scripts/install-deps.sh
if [[ ! -f "${BUILD_DIR}/CMakeCache.txt" ]]; then
  CC=clang CXX=clang++ cmake -S . -B "${BUILD_DIR}" -G Ninja \
    -DATTN_FUZZ=ON -DATTN_CUDA=OFF -DATTN_BUILD_BENCH=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "${BUILD_DIR}" -j"${JOBS}" --target "${targets[@]}"

source scripts/sanitizer-env.sh
for target in "${targets[@]}"; do
  work="${BUILD_DIR}/fuzz-corpus/${target}"
  artifacts="${BUILD_DIR}/fuzz-artifacts/${target}"
  mkdir -p "${work}" "${artifacts}"
  echo "fuzz.sh: ${target} for ${FUZZ_SECONDS} s"
  # New inputs go to the first directory; the checked-in corpus is read.
  "${BUILD_DIR}/tests/fuzz/${target}" "${work}" "tests/fuzz/corpus/${target}" \
    -max_total_time="${FUZZ_SECONDS}" -rss_limit_mb=2048 -timeout=30 \
    -max_len=4096 -print_final_stats=1 -artifact_prefix="${artifacts}/"
done
echo "fuzz.sh: no crash in ${targets[*]}"
