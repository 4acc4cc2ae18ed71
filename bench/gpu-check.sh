#!/usr/bin/env bash
# GPU check: builds the CUDA backend, runs the GPU tests (ctest -L gpu), then
# the GPU benchmark (decode bandwidth, prefill TFLOP/s) and PyTorch's
# scaled_dot_product_attention on the same prefill shapes. Finishes in a few
# minutes on one H100/H200.
#
#   bench/gpu-check.sh [--quick]
#
# Environment:
#   OUT             when set, the log and the JSON results are written there
#                   (gpu-check.log, gpu_bench.json, sdpa_bench.json,
#                   gpu_check.json); else under the build directory.
#   BUILD_DIR       build directory (default: <repo>/build-gpu).
#   CUDA_ARCHS      CMAKE_CUDA_ARCHITECTURES (default: the local GPU's, else
#                   "80;90").
# Exit status: non-zero when the build, a GPU test or the benchmark fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build-gpu}"
DEST="${OUT:-$BUILD/gpu-check}"
QUICK=""
if [[ "${1:-}" == "--quick" ]]; then QUICK="--quick"; fi
mkdir -p "$DEST"
exec > >(tee "$DEST/gpu-check.log") 2>&1

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
start_time=$(date +%s)

step "machine"
nproc
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv || true

ARCHS="${CUDA_ARCHS:-}"
if [[ -z "$ARCHS" ]]; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
  if [[ "$cap" =~ ^[0-9]+$ ]]; then ARCHS="$cap"; else ARCHS="80;90"; fi
fi

step "configure (CUDA archs $ARCHS)"
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
cmake -S "$ROOT" -B "$BUILD" "${GENERATOR[@]}" -DATTN_CUDA=ON \
  -DATTN_BUILD_BENCH=ON -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" || { echo "configure failed"; exit 1; }

step "build"
cmake --build "$BUILD" --target cuda_backend_test attention_gpu_bench \
  -j "$(nproc)" || { echo "build failed"; exit 1; }

step "GPU tests (ctest -L gpu)"
ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 300
tests_rc=$?

step "GPU benchmark"
"$BUILD/bench/gpu/attention_gpu_bench" $QUICK "--json=$DEST/gpu_bench.json"
bench_rc=$?

step "PyTorch scaled_dot_product_attention"
python3 "$ROOT/bench/gpu/sdpa_bench.py" $QUICK --json "$DEST/sdpa_bench.json"

step "summary"
python3 - "$DEST" "$tests_rc" "$bench_rc" <<'PY'
import json, os, sys
dest, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(name):
    try:
        with open(os.path.join(dest, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
ours, torch = load("gpu_bench.json"), load("sdpa_bench.json")
summary = {"gpu_tests_passed": tests_rc == 0, "benchmark_ok": bench_rc == 0,
           "gpu_bench": ours, "sdpa_bench": torch}
if ours:
    decode = [d for d in ours.get("decode", []) if "kernel_gbps" in d]
    long_ctx = [d for d in decode if d["context"] >= 8192]
    if long_ctx:
        best = max(long_ctx, key=lambda d: d["kernel_gbps"])
        summary["decode_best"] = best
        print(f"decode best: {best['kernel_gbps']:.0f} GB/s "
              f"({best['ratio_to_4800gbps']:.0%} of 4.8 TB/s, "
              f"{best['ratio_to_copy']:.0%} of copy) at context "
              f"{best['context']} batch {best['batch']}")
    theirs = {p["tokens"]: p for p in (torch or {}).get("prefill", [])}
    rows = []
    for p in ours.get("prefill", []):
        row = {"tokens": p["tokens"], "ours_tflops": p["kernel_tflops"]}
        if p["tokens"] in theirs:
            row["torch_tflops"] = theirs[p["tokens"]]["tflops"]
            row["ratio"] = round(p["kernel_tflops"] / row["torch_tflops"], 3)
        rows.append(row)
        print("prefill T=%d: %.1f TFLOP/s%s" % (
            p["tokens"], p["kernel_tflops"],
            "" if "ratio" not in row else
            ", torch %.1f, ratio %.2f" % (row["torch_tflops"], row["ratio"])))
    summary["prefill_vs_torch"] = rows
with open(os.path.join(dest, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
PY

echo
echo "gpu-check: tests rc=$tests_rc, benchmark rc=$bench_rc, $(( $(date +%s) - start_time )) s; results in $DEST"
[[ $tests_rc -eq 0 && $bench_rc -eq 0 ]]
