#!/usr/bin/env bash
# Installs the Debian bookworm packages attention-service builds with.
# Idempotent: installs only what is missing; uses sudo only when not root.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libgtest-dev libbenchmark-dev python3-numpy
  # SHA-256 of bearer tokens; the security tests make certificates with the
  # openssl command.
  libssl-dev openssl
  # The fuzz targets (scripts/fuzz.sh): clang, libFuzzer and the sanitizer
  # runtimes, FuzzedDataProvider.h.
  clang libclang-rt-14-dev
  # Tests of deploy/: promtool + a real Prometheus, the image build.
  prometheus buildah debootstrap iproute2 python3
)
# The Kubernetes manifest test validates with npm packages; Debian's nodejs
# and npm are used only where no Node.js is installed already.
if ! command -v npm >/dev/null 2>&1; then
  PACKAGES+=(nodejs npm)
fi

missing=()
for package in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "${package}" 2>/dev/null |
      grep -q "install ok installed"; then
    missing+=("${package}")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all packages present"
  exit 0
fi

sudo=()
if [[ "$(id -u)" -ne 0 ]]; then
  sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends "${missing[@]}"
