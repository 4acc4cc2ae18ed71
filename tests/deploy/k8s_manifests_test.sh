#!/bin/bash
# Validates deploy/k8s against the Kubernetes schemas (validate_k8s.mjs).
# Installs the validators pinned in tests/deploy/npm/package-lock.json into
# NPM_DIR with `npm ci`, once per lock file (later runs reuse them).
# Exits 77 (CTest: skipped) only when the npm registry cannot be reached.
#
# Usage: k8s_manifests_test.sh SOURCE_DIR NPM_DIR
set -euo pipefail

SRC=$(cd "${1:?usage: $0 SOURCE_DIR NPM_DIR}" && pwd)
NPM_DIR=${2:?usage: $0 SOURCE_DIR NPM_DIR}
HERE=$SRC/tests/deploy

for tool in node npm; do
  command -v "$tool" >/dev/null || {
    echo "FAIL: $tool is not installed (Debian: apt-get install nodejs npm)" >&2
    exit 1
  }
done

mkdir -p "$NPM_DIR"
STAMP=$NPM_DIR/.installed-lock
# Serialise concurrent runs on the same build tree.
exec 9>"$NPM_DIR/.lock"
flock 9
if [ -d "$NPM_DIR/node_modules" ] && [ -f "$STAMP" ] &&
   cmp -s "$STAMP" "$HERE/npm/package-lock.json"; then
  echo "validators already installed in $NPM_DIR"
else
  cp "$HERE/npm/package.json" "$HERE/npm/package-lock.json" "$NPM_DIR/"
  echo "installing the validators into $NPM_DIR (npm ci)"
  if ! output=$(cd "$NPM_DIR" &&
                npm ci --no-audit --no-fund --loglevel=error 2>&1); then
    echo "$output" >&2
    if ! (cd "$NPM_DIR" && timeout 60 npm ping >/dev/null 2>&1); then
      echo "SKIP: the npm registry is unreachable, cannot install the" \
           "Kubernetes schema validators" >&2
      exit 77
    fi
    echo "FAIL: npm ci failed although the registry answers" >&2
    exit 1
  fi
  cp "$HERE/npm/package-lock.json" "$STAMP"
fi
flock -u 9

exec node "$HERE/validate_k8s.mjs" --k8s "$SRC/deploy/k8s" \
  --node-modules "$NPM_DIR/node_modules"
