#!/bin/bash
# The GPU check bundle, proved without a GPU (CTest label gpu-bundle):
#   1. scripts/gpu-bundle.sh builds it from this build directory (sm_90
#      SASS checked there) and keeps it under 64 MiB;
#   2. a Debian bookworm minbase root filesystem with python3 only
#      (tests/deploy/debian_rootfs.sh, cached per day under
#      $ATTN_IMAGE_CACHE, default /var/cache/attention-service) gets the
#      bundle in /opt/gpu-bundle; it has none of the build dependencies
#      (no gRPC, protobuf, Abseil, GoogleTest, compiler);
#   3. inside it (chroot in a private mount and PID namespace), ldd finds
#      every library of every bundled binary, and finds them missing
#      without the bundle's lib/;
#   4. run-gpu-check.sh there ends with exit 2 "no CUDA device" and a JSON
#      summary saying so: libraries resolved, the GPU tests all skipped,
#      --backend=cuda refused with UNAVAILABLE, --backend=auto served on the
#      CPU (attnctl demo, max difference 0); at most 8 result files;
#   5. with a stand-in libcuda.so.1 too old for the CUDA 13 runtime, the GPU
#      tests fail (a device exists but cannot be used) and the runner exits
#      1 with a summary saying "failed".
# Needs root (debootstrap, chroot, unshare); exits 77 (skipped) otherwise.
# Prints the time of each phase and of the runner.
#
# Usage: gpu_bundle_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail

SRC=$(cd "${1:?usage: $0 SOURCE_DIR BUILD_DIR}" && pwd)
BUILD=$(cd "${2:?usage: $0 SOURCE_DIR BUILD_DIR}" && pwd)
CACHE=${ATTN_IMAGE_CACHE:-/var/cache/attention-service}
BUNDLE=$BUILD/gpu-bundle
WORK=$BUILD/gpu-bundle-test

log() { echo "[gpu-bundle-test $(date -u +%H:%M:%S)] $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
T0=$(date +%s)
lap() { log "$1 took $(( $(date +%s) - T0 )) s"; T0=$(date +%s); }

if [ "$(id -u)" != 0 ]; then
  echo "skipped: needs root (debootstrap, chroot); CI runs as root"
  exit 77
fi
command -v debootstrap >/dev/null || {
  log "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >/dev/null ||
    { apt-get update >/dev/null &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >/dev/null; } ||
    fail "cannot install debootstrap"
}

# --- 1. the bundle -----------------------------------------------------------
BUILD_DIR=$BUILD bash "$SRC/scripts/gpu-bundle.sh" "$BUNDLE"
lap "the bundle"
bytes=$(du -sb "$BUNDLE" | cut -f1)
[ "$bytes" -lt $((64 << 20)) ] || fail "bundle is $bytes bytes"
[ -x "$BUNDLE/run-gpu-check.sh" ] || fail "no run-gpu-check.sh in the bundle"
ls "$BUNDLE/tests/"* >/dev/null 2>&1 || fail "no GPU test binary in the bundle"
for binary in attention-server attnctl attention_gpu_bench; do
  [ -x "$BUNDLE/bin/$binary" ] || fail "no bin/$binary in the bundle"
done
python3 - "$BUNDLE/bundle.json" <<'PY' || fail "bundle.json: GPU code without sm_90 SASS"
import json, sys
code = json.load(open(sys.argv[1]))["gpu_code"]
print("GPU code:", code)
bad = [t for t, c in code.items() if t != "attnctl" and "ELF sm_90" not in c]
sys.exit(1 if bad or not code else 0)
PY

# --- 2. the bare root filesystem ----------------------------------------------
ROOTFS_TAR=$(bash "$SRC/tests/deploy/debian_rootfs.sh" "$CACHE" python3)
! grep -q " $WORK/" /proc/self/mounts || fail "a mount under $WORK is left"
rm -rf --one-file-system "$WORK"
mkdir -p "$WORK/rootfs" "$WORK/out"
tar -C "$WORK/rootfs" -xf "$ROOTFS_TAR"
ROOT=$WORK/rootfs
cp -a "$BUNDLE" "$ROOT/opt/gpu-bundle"
mkdir -p "$ROOT/out"
lap "the root filesystem"
[ -x "$ROOT/usr/bin/python3" ] || fail "the root filesystem has no python3"
for absent in 'libgrpc*' 'libprotobuf*' 'libabsl*' 'libgtest*' 'libcares*'; do
  found=$(find "$ROOT/usr/lib" "$ROOT/lib" -name "$absent" 2>/dev/null | head -1)
  [ -z "$found" ] || fail "the root filesystem is not bare: ${found#"$ROOT"}"
done
for tool in cc gcc g++ cmake nvcc nvidia-smi; do
  [ ! -e "$ROOT/usr/bin/$tool" ] || fail "the root filesystem has $tool"
done

# Runs a command in the root filesystem: private mount and PID namespaces,
# /proc and /dev mounted, the results folder at /out.
in_rootfs() {
  unshare --mount --pid --fork --kill-child sh -c '
    root=$1; out=$2; shift 2
    mount --rbind /dev "$root/dev" &&
    mount -t proc proc "$root/proc" &&
    mount --bind "$out" "$root/out" &&
    exec chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
      HOME=/root "$@"' sh "$ROOT" "$WORK/out" "$@"
}

# --- 3. libraries ---------------------------------------------------------------
binaries=$(cd "$ROOT" && ls opt/gpu-bundle/bin/* opt/gpu-bundle/tests/*)
for binary in $binaries; do
  libs=$(in_rootfs env LD_LIBRARY_PATH=/opt/gpu-bundle/lib ldd "/$binary")
  if grep -q 'not found' <<<"$libs"; then
    echo "$libs" >&2
    fail "/$binary misses libraries in the bare root filesystem"
  fi
  echo "/$binary: $(grep -c '=>' <<<"$libs") libraries, none missing"
done
without=$(in_rootfs ldd /opt/gpu-bundle/bin/attention-server | grep -c 'not found' || true)
[ "$without" -gt 0 ] ||
  fail "attention-server resolves without the bundle's lib/: the root filesystem is not bare"
log "without the bundle's lib/, attention-server misses $without libraries (as it should)"
lap "ldd in the root filesystem"

# --- 4. the runner ---------------------------------------------------------------
status=0
in_rootfs env OUT=/out timeout 330 /opt/gpu-bundle/run-gpu-check.sh || status=$?
RUNNER_SECONDS=$(( $(date +%s) - T0 ))
lap "run-gpu-check.sh in the root filesystem"
[ "$status" = 2 ] || fail "run-gpu-check.sh exited $status, expected 2 (no CUDA device)"
files=$(find "$WORK/out" -type f | wc -l)
ls -l "$WORK/out"
[ "$files" -le 8 ] || fail "$files result files, at most 8"
grep -q "no CUDA device" "$WORK/out/gpu-check.log" || fail "the log does not say 'no CUDA device'"
python3 - "$WORK/out/gpu_check.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    return ok
tests = s["gpu_tests"]
cuda, auto = s["server"]["cuda"], s["server"]["auto"]
checks = [
    check(s["result"] == "no_cuda_device", f"result {s['result']}"),
    check(not s["device"]["present"], "no device found"),
    check(s["libraries"]["ok"], f"libraries {s['libraries']}"),
    check(bool(tests) and all(t["rc"] == 0 and t["tests"] > 0 and
                              t["failed"] == 0 for t in tests),
          "GPU test binaries ran: " + ", ".join(
              f"{t['binary']} {t['passed']} passed {t['skipped']} skipped"
              for t in tests)),
    check(all(t["skipped"] > 0 for t in tests), "GPU tests skipped"),
    check(cuda["refused_clearly"], f"--backend=cuda refused: {cuda.get('error')}"),
    check(auto.get("backend") == "cpu" and auto.get("ok"),
          f"--backend=auto: {auto.get('backend')} ({auto.get('reason')})"),
    check("no CUDA device" in auto.get("reason", ""), "auto says why"),
    check(auto["demos"][0]["max_abs_difference"] == 0.0,
          f"demo float32 max difference {auto['demos'][0]['max_abs_difference']}"),
    check(not s["problems"], f"problems {s['problems']}"),
    check(s["seconds"] < 300, f"runner {s['seconds']} s"),
]
sys.exit(0 if all(checks) else 1)
PY
# --- 5. a driver too old for the runtime: the GPU tests fail, not skip ---------
# A stand-in libcuda.so.1 reporting CUDA 12.4 (tests/core/cuda/
# fake_old_driver.c) where the driver would be: the runner must fail.
cmake --build "$BUILD" --target fake_old_cuda_driver >/dev/null
cp "$BUILD/tests/core/cuda/fake_old_driver/libcuda.so.1" "$ROOT/usr/lib/x86_64-linux-gnu/"
rm -rf "${WORK:?}/out/"*
status=0
in_rootfs env OUT=/out timeout 330 /opt/gpu-bundle/run-gpu-check.sh >"$WORK/old-driver.log" 2>&1 ||
  status=$?
[ "$status" = 1 ] || { cat "$WORK/old-driver.log"; fail "with a driver too old the runner exited $status, expected 1"; }
grep -q "a CUDA device exists but the backend cannot use it: .*driver is too old" \
  "$WORK/out/gpu-check.log" || { cat "$WORK/old-driver.log"; fail "the GPU tests did not fail on the old driver"; }
grep -q '"result": "failed"' "$WORK/out/gpu_check.json" || fail "the summary does not say failed"
log "with a driver too old for the runtime the GPU tests fail and so does the runner"
lap "the runner with an old driver"

log "bundle $(( (bytes + 1048575) >> 20 )) MiB; runner in the bare root filesystem: ${RUNNER_SECONDS} s"
# The namespaces' mounts ended with them; never delete through a mount.
! grep -q " $WORK/" /proc/self/mounts || fail "a mount under $WORK is left"
rm -rf --one-file-system "$WORK"
echo "gpu bundle test passed"
