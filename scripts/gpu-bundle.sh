#!/usr/bin/env bash
# Builds, on this machine, everything the GPU check runs, and copies it into
# one self-contained folder that runs on a bare CUDA machine (no -dev
# packages, no network): run-gpu-check.sh there needs only a CUDA driver and
# python3 (with PyTorch for the comparison).
#
#   scripts/gpu-bundle.sh [DEST]      # default DEST: $BUILD_DIR/gpu-bundle
#
# The bundle:
#   run-gpu-check.sh, run_gpu_check.py   the runner (bench/gpu/)
#   sdpa_bench.py                        PyTorch on the benchmark's shapes
#   bin/   attention-server (CUDA backend), attnctl, attention_gpu_bench
#   tests/ every gpu-labelled test binary
#   lib/   every shared library they need except glibc's own (Abseil,
#          protobuf, gRPC, OpenSSL, ...), found with ldd, stripped;
#          lib/compat/: libstdc++ and libgcc_s, for older systems
#   bundle.json                          commit, build time, GPU code
#
# Binaries come from $BUILD_DIR (default build/; configured with
# scripts/configure.sh when it is not yet) when its GPU code contains sm_90
# SASS (the default archs 80;90 do); otherwise from $BUNDLE_BUILD_DIR
# (default build-gpu-bundle), configured with -DCMAKE_CUDA_ARCHITECTURES=90.
# The GPU code is listed with cuobjdump when the toolkit has it, else with
# scripts/fatbin_archs.py (the same listing, read from the ELF files).
# Fails when a binary lacks sm_90 SASS or the bundle reaches 64 MiB.
# Environment: BUILD_DIR, BUNDLE_BUILD_DIR, JOBS (build jobs, default 2);
# set CCACHE_* / CMAKE_*_COMPILER_LAUNCHER as for any build.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Relative BUILD_DIR and DEST are taken from the current folder; the
# defaults are in the checkout.
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
BUILD=$(absolute "${BUILD_DIR:-$ROOT/build}")
DEST=$(absolute "${1:-$BUILD/gpu-bundle}")
cd "$ROOT"
JOBS=${JOBS:-2}
SM=90
LIMIT_BYTES=$((64 << 20))

log() { echo "[gpu-bundle $(date -u +%H:%M:%S)] $*" >&2; }
fail() { echo "gpu-bundle: $*" >&2; exit 1; }

# Lists "KIND sm_NN" (ELF = SASS, PTX) of one binary's GPU code.
gpu_code() {
  local cuobjdump
  cuobjdump=$(command -v cuobjdump || true)
  [ -n "$cuobjdump" ] || [ ! -x /usr/local/cuda/bin/cuobjdump ] ||
    cuobjdump=/usr/local/cuda/bin/cuobjdump
  if [ -n "$cuobjdump" ]; then
    { "$cuobjdump" --list-elf --list-ptx "$1" 2>/dev/null || true; } |
      sed -n 's/^\(ELF\|PTX\) file.*\.\(sm_[0-9]*[a-z]*\)\..*/\1 \2/p' | sort -u
  else
    { python3 "$ROOT/scripts/fatbin_archs.py" "$1" 2>/dev/null || true; } |
      awk '{ print $2, $3 }'
  fi
}

# The manifest of BUILD_DIR: "ROLE TARGET FILE" lines (tests/gpu_bundle).
manifest() { cat "$1/gpu-bundle-manifest.txt"; }

# Builds the manifest's targets in $1 and prints the binaries that lack
# sm_$SM SASS (GPU code is in everything but attnctl).
build_and_check() {
  local dir=$1 role target file missing=()
  [ -f "$dir/gpu-bundle-manifest.txt" ] ||
    fail "$dir has no gpu-bundle-manifest.txt: the CUDA backend is not built there (nvcc missing, or ATTN_CUDA=OFF)"
  grep -q '^bench ' "$dir/gpu-bundle-manifest.txt" ||
    fail "$dir was configured with ATTN_BUILD_BENCH=OFF; the GPU benchmark is needed"
  log "building in $dir: $(manifest "$dir" | awk '{ printf "%s ", $2 }')"
  # shellcheck disable=SC2046
  cmake --build "$dir" -j "$JOBS" --target $(manifest "$dir" | awk '{ print $2 }') >&2
  while read -r role target file; do
    [ "$role" = tool ] && continue
    gpu_code "$file" | grep -qx "ELF sm_$SM" || missing+=("$target")
  done < <(manifest "$dir")
  echo "${missing[*]}"
}

[ -f "$BUILD/CMakeCache.txt" ] || BUILD_DIR=$BUILD bash scripts/configure.sh >&2
missing=$(build_and_check "$BUILD")
if [ -n "$missing" ]; then
  log "$BUILD has no sm_$SM SASS in: $missing; building for sm_$SM separately"
  BUILD=$(absolute "${BUNDLE_BUILD_DIR:-$ROOT/build-gpu-bundle}")
  generator=()
  [ -f "$BUILD/CMakeCache.txt" ] || ! command -v ninja >/dev/null || generator=(-G Ninja)
  cmake -S "$ROOT" -B "$BUILD" "${generator[@]}" -DATTN_CUDA=ON \
    -DATTN_BUILD_BENCH=ON "-DCMAKE_CUDA_ARCHITECTURES=$SM" >&2
  missing=$(build_and_check "$BUILD")
  [ -z "$missing" ] || fail "no sm_$SM SASS in $missing even when built for it"
fi

# --- assemble ---------------------------------------------------------------
log "assembling $DEST from $BUILD"
# Replaces only an earlier bundle (or an empty folder).
if [ -e "$DEST" ] && [ ! -e "$DEST/bundle.json" ] && [ -n "$(ls -A "$DEST")" ]; then
  fail "$DEST exists and is not a GPU bundle; choose another folder"
fi
rm -rf "$DEST"
mkdir -p "$DEST/bin" "$DEST/tests" "$DEST/lib"
declare -A code=()
while read -r role target file; do
  case "$role" in test) sub=tests ;; *) sub=bin ;; esac
  strip -o "$DEST/$sub/$(basename "$file")" "$file"
  code[$target]=$(gpu_code "$DEST/$sub/$(basename "$file")" | paste -sd, -)
  log "  $sub/$(basename "$file"): ${code[$target]:-no GPU code}"
done < <(manifest "$BUILD")

# Shared libraries: everything ldd resolves except glibc itself (and the
# vDSO). libstdc++ and libgcc_s go to lib/compat/, which the runner uses only
# when the system's own are missing or older than Debian bookworm's
# (bookworm's libstdc++ needs glibc 2.36, the rest of the bundle less).
is_glibc() {
  case "$1" in
    ld-linux*.so*|libc.so*|libm.so*|libmvec.so*|libpthread.so*|libdl.so*| \
    librt.so*|libresolv.so*|libutil.so*|libanl.so*|libnsl.so*| \
    libBrokenLocale.so*|libnss_*|libthread_db.so*|linux-vdso.so*) return 0 ;;
  esac
  return 1
}
for binary in "$DEST"/bin/* "$DEST"/tests/*; do
  ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r soname path; do
  is_glibc "$soname" && continue
  case "$soname" in
    libstdc++.so*|libgcc_s.so*) dir=$DEST/lib/compat ;;
    *) dir=$DEST/lib ;;
  esac
  mkdir -p "$dir"
  strip --strip-unneeded -o "$dir/$soname" "$path"
done
unresolved=$(LD_LIBRARY_PATH="$DEST/lib:$DEST/lib/compat" ldd "$DEST"/bin/* "$DEST"/tests/* |
             grep 'not found' | sort -u || true)
[ -z "$unresolved" ] || fail "unresolved libraries: $unresolved"

cp bench/gpu/run-gpu-check.sh bench/gpu/run_gpu_check.py bench/gpu/sdpa_bench.py "$DEST/"
chmod +x "$DEST/run-gpu-check.sh"

# The newest glibc and libstdc++ symbol versions the bundle needs (the
# target's must be at least that; lib/compat/ brings libstdc++ along).
newest() {
  objdump -T "${@:2}" 2>/dev/null | grep -o "$1_[0-9.]*" | sort -uV | tail -1
}
glibc=$(newest GLIBC "$DEST"/bin/* "$DEST"/tests/* "$DEST"/lib/*.so*)
glibc_compat=$(newest GLIBC "$DEST"/lib/compat/*)
glibcxx=$(newest GLIBCXX "$DEST"/bin/* "$DEST"/tests/* "$DEST"/lib/*.so*)
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$ROOT" diff --quiet HEAD 2>/dev/null || commit="$commit+changes"
for target in "${!code[@]}"; do
  printf '%s\t%s\n' "$target" "${code[$target]}"
done | python3 -c '
import json, sys
commit, built, sm, build, glibc, glibcxx, glibc_compat = sys.argv[1:]
code = dict(line.rstrip("\n").split("\t") for line in sys.stdin)
json.dump({"commit": commit, "built": built, "sm": sm, "build_dir": build,
           "needs": f"{glibc}, {glibcxx} (or {glibc_compat} with lib/compat)",
           "gpu_code": code}, sys.stdout, indent=2)
print()' "$commit" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "sm_$SM" "$BUILD" \
  "$glibc" "$glibcxx" "$glibc_compat" >"$DEST/bundle.json"

bytes=$(du -sb "$DEST" | cut -f1)
log "bundle: $DEST, $(( (bytes + 1048575) >> 20 )) MiB ($bytes bytes), $(find "$DEST/lib" -name '*.so*' | wc -l) libraries; needs $glibc and $glibcxx ($glibc_compat with lib/compat)"
[ "$bytes" -lt "$LIMIT_BYTES" ] || fail "the bundle is $bytes bytes, over 64 MiB"
echo "run on the GPU machine: $DEST/run-gpu-check.sh   (OUT=dir for the results)"
