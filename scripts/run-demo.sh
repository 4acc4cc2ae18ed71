#!/usr/bin/env bash
# Set up and run the demo: installs the packages if missing, builds
# attention-server and attnctl, starts the server (GPU when one is usable,
# else CPU: --backend=auto), runs attnctl info, demo and plan, then stops the
# server with SIGTERM.
#   PORT=50051 ./scripts/run-demo.sh   fixed port (default: a free one)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${BUILD_DIR:-build}"

bash scripts/install-deps.sh
BUILD_DIR="${BUILD_DIR}" bash scripts/configure.sh
cmake --build "${BUILD_DIR}" -j"$(nproc)" --target attention-server attnctl

server="${BUILD_DIR}/server/attention-server"
attnctl="${BUILD_DIR}/client/attnctl"
port_file="$(mktemp)"
rm -f "${port_file}"

# Loopback only: the demo server has neither TLS nor tokens.
"${server}" --listen_address=127.0.0.1 --port="${PORT:-0}" \
  --port_file="${port_file}" --backend=auto \
  --kv_cache_bytes=$((256 << 20)) --metrics_port=-1 &
server_pid=$!
stop_server() {
  if kill -0 "${server_pid}" 2>/dev/null; then
    kill -TERM "${server_pid}"
    wait "${server_pid}" || true
  fi
  rm -f "${port_file}"
}
trap stop_server EXIT

for _ in $(seq 600); do
  [[ -s "${port_file}" ]] && break
  if ! kill -0 "${server_pid}" 2>/dev/null; then
    echo "run-demo: attention-server exited during start-up" >&2
    exit 1
  fi
  sleep 0.1
done
if [[ ! -s "${port_file}" ]]; then
  echo "run-demo: attention-server did not start within 60 s" >&2
  exit 1
fi
target="127.0.0.1:$(cat "${port_file}")"

run() {
  echo
  echo "\$ attnctl $*"
  "${attnctl}" "$@"
}
run health --target="${target}"
run info --target="${target}"
run demo --target="${target}"
run plan --preset=gpt-oss-120b

echo
echo "stopping attention-server (SIGTERM)"
kill -TERM "${server_pid}"
status=0
wait "${server_pid}" || status=$?
trap - EXIT
rm -f "${port_file}"
if [[ "${status}" -ne 0 ]]; then
  echo "run-demo: attention-server exited with ${status}" >&2
  exit 1
fi
echo "attention-server exited cleanly"
