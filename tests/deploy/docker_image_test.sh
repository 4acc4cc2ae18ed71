#!/bin/bash
# Builds the CPU image (the repository's Dockerfile) without a Docker daemon
# and runs it:
#   1. a Debian bookworm root filesystem made by debootstrap (minbase) from
#      the mirror in this machine's apt sources, cached per day under
#      $ATTN_IMAGE_CACHE (default /var/cache/attention-service) by
#      debian_rootfs.sh;
#   2. imported as docker.io/library/debian:bookworm and :bookworm-slim, so
#      that the Dockerfile's FROM lines resolve without a registry;
#   3. `buildah bud` of the Dockerfile (the build stage compiles the server
#      inside the image, the slow part);
#   4. the image's own ENTRYPOINT and CMD started in a private network
#      namespace (so its default ports 50051/9464 cannot clash with anything
#      on the host), then its HEALTHCHECK command, `attnctl info`
#      (GetServerInfo), the non-root user, the runtime libraries and the
#      absence of build tools are checked, and SIGTERM must stop it with 0.
# Needs root (debootstrap, chroot). Installs buildah, debootstrap and
# iproute2 with apt-get when they are missing. Prints the time each phase
# took.
#
# Usage: docker_image_test.sh SOURCE_DIR
set -euo pipefail

SRC=$(cd "${1:?usage: $0 SOURCE_DIR}" && pwd)
CACHE=${ATTN_IMAGE_CACHE:-/var/cache/attention-service}
IMAGE=localhost/attention-service:ctest
BUILDAH=(buildah --storage-driver=vfs)

log() { echo "[docker-test $(date -u +%H:%M:%S)] $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
phase_start() { PHASE_NAME=$1; PHASE_T0=$(date +%s); log "$1..."; }
phase_end() { log "$PHASE_NAME took $(( $(date +%s) - PHASE_T0 )) s"; }

# Skipped (ctest's SKIP_RETURN_CODE) for a non-root user: debootstrap and
# the chroot builds need root; CI runs as root.
if [ "$(id -u)" != 0 ]; then
  echo "SKIP: needs root (debootstrap, chroot builds); CI runs as root"
  exit 77
fi

# --- tools -----------------------------------------------------------------
missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v ip >/dev/null || missing+=(iproute2)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null ||
    { apt-get update >/dev/null &&
      apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; } ||
    fail "cannot install ${missing[*]} with apt-get"
fi

# --- 1. base root filesystem, cached per day (debian_rootfs.sh) -----------
T_ALL=$(date +%s)
phase_start "base rootfs (debootstrap --variant=minbase bookworm, cached per day)"
ROOTFS_TAR=$(bash "$SRC/tests/deploy/debian_rootfs.sh" "$CACHE")
KEY=$(basename "$ROOTFS_TAR" .tar)
KEY=${KEY#debian-}
phase_end

# --- 2. import as debian:bookworm and debian:bookworm-slim -----------------
image_key() {
  "${BUILDAH[@]}" inspect --type image \
    --format '{{index .ImageAnnotations "org.attention-service.rootfs"}}' \
    "$1" 2>/dev/null || true
}
if [ "$(image_key docker.io/library/debian:bookworm)" = "$KEY" ] &&
   [ "$(image_key docker.io/library/debian:bookworm-slim)" = "$KEY" ]; then
  log "base images: already imported ($KEY)"
else
  phase_start "importing the base images"
  ctr=$("${BUILDAH[@]}" from scratch)
  mnt=$("${BUILDAH[@]}" mount "$ctr")
  tar -C "$mnt" --numeric-owner -xf "$ROOTFS_TAR"
  "${BUILDAH[@]}" umount "$ctr" >/dev/null
  "${BUILDAH[@]}" config --annotation "org.attention-service.rootfs=$KEY" \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash "$ctr"
  "${BUILDAH[@]}" commit --rm -q "$ctr" docker.io/library/debian:bookworm >/dev/null
  # -slim: as Debian's own, documentation and locales are not installed.
  ctr=$("${BUILDAH[@]}" from --pull=never docker.io/library/debian:bookworm)
  mnt=$("${BUILDAH[@]}" mount "$ctr")
  cat >"$mnt/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
EOF
  find "$mnt/usr/share/doc" -mindepth 1 ! -name copyright ! -type d -delete
  rm -rf "$mnt/usr/share/man/"* "$mnt/usr/share/info/"* "$mnt/usr/share/groff/"*
  "${BUILDAH[@]}" umount "$ctr" >/dev/null
  "${BUILDAH[@]}" commit --rm -q "$ctr" docker.io/library/debian:bookworm-slim >/dev/null
  phase_end
fi

# --- 3. build the image ----------------------------------------------------
phase_start "buildah bud (Dockerfile, build stage compiles the server)"
T_BUILD=$(date +%s)
"${BUILDAH[@]}" bud --pull=never --isolation=chroot --format docker \
  --layers -f "$SRC/Dockerfile" -t "$IMAGE" "$SRC" >"$CACHE/last-build.log" 2>&1 ||
  { tail -n 60 "$CACHE/last-build.log" >&2; fail "image build failed (log: $CACHE/last-build.log)"; }
BUILD_SECONDS=$(( $(date +%s) - T_BUILD ))
phase_end

# --layers keeps every step's image so that a rebuild reuses the package
# installation; drop the untagged images this build did not use (earlier
# builds' steps), or vfs storage grows by gigabytes per run.
current=$(sed -n 's/^--> \(Using cache \)\{0,1\}\([0-9a-f]\{11,\}\).*/\2/p' \
          "$CACHE/last-build.log" | cut -c1-11 | sort -u)
stale=0
while IFS='|' read -r id name; do
  [ "$name" = "<none>" ] || continue
  grep -qx "${id:0:11}" <<<"$current" && continue
  "${BUILDAH[@]}" rmi "$id" >/dev/null 2>&1 && stale=$((stale + 1))
done < <("${BUILDAH[@]}" images -a --noheading --format '{{.ID}}|{{.Name}}')
log "removed $stale stale build images"

# --- 4. run it -------------------------------------------------------------
# The image's Docker configuration, one field a line (buildah's --format
# templates have no json function in Debian's buildah 1.28).
"${BUILDAH[@]}" inspect --type image "$IMAGE" >"$CACHE/last-inspect.json"
image_config() {
  python3 - "$CACHE/last-inspect.json" "$1" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))["Docker"]["config"]
value = config.get(sys.argv[2])
if isinstance(value, dict) and sys.argv[2] == "Healthcheck":
    value = value.get("Test")
if isinstance(value, dict):
    value = sorted(value)
print(" ".join(value) if isinstance(value, list) else (value or ""))
PY
}
USER_ID=$(image_config User)
ENTRYPOINT=$(image_config Entrypoint)
CMD=$(image_config Cmd)
HEALTHCHECK=$(image_config Healthcheck)
PORTS=$(image_config ExposedPorts)
log "image: user=$USER_ID entrypoint=[$ENTRYPOINT] cmd=[$CMD]"
log "image: healthcheck=[$HEALTHCHECK] exposed=[$PORTS]"
case "$USER_ID" in ""|0|0:*|root|root:*) fail "image runs as root (USER '$USER_ID')";; esac
for port in 50051 9464; do
  grep -qw "$port/tcp" <<<"$PORTS" || fail "port $port is not EXPOSEd"
done
# No element of these arrays contains spaces.
read -r -a SERVER_ARGV <<<"$ENTRYPOINT $CMD"
read -r -a HEALTH_ARGV <<<"$HEALTHCHECK"
[ "${HEALTH_ARGV[0]:-}" = CMD ] || fail "HEALTHCHECK is not an exec-form CMD: $HEALTHCHECK"
HEALTH_ARGV=("${HEALTH_ARGV[@]:1}")
[ "${HEALTH_ARGV[0]}" = attnctl ] && [ "${HEALTH_ARGV[1]}" = health ] ||
  fail "HEALTHCHECK does not use 'attnctl health': $HEALTHCHECK"

phase_start "running the image"
ctr=$("${BUILDAH[@]}" from --pull=never -q "$IMAGE")
descendants() {
  local child
  for child in $(pgrep -P "$1" || true); do echo "$child"; descendants "$child"; done
}
cleanup() {
  # A failure after the start leaves no server behind.
  if [ -n "${SERVER_PID:-}" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -KILL $(descendants "$SERVER_PID") "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  # unshare --fork ignores SIGTERM itself: end the namespace's process.
  [ -n "${NETNS_CHILD:-}" ] && kill "$NETNS_CHILD" 2>/dev/null || true
  [ -n "${NETNS_DIR:-}" ] && rm -rf "$NETNS_DIR"
  "${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT
run_in() { "${BUILDAH[@]}" run --isolation=chroot "$ctr" -- "$@"; }

mnt=$("${BUILDAH[@]}" mount "$ctr")
for tool in gcc g++ cc cmake ninja; do
  [ ! -e "$mnt/usr/bin/$tool" ] || fail "runtime image contains the build tool $tool"
done
"${BUILDAH[@]}" umount "$ctr" >/dev/null
for binary in attention-server attnctl; do
  libs=$(run_in ldd "/usr/local/bin/$binary")
  if grep -q 'not found' <<<"$libs"; then
    echo "$libs" >&2
    fail "$binary misses runtime libraries in the image"
  fi
done
[ "$(run_in id -u)" != 0 ] || fail "buildah run gives uid 0: USER is not applied"

# A private network namespace with only loopback: the image's default ports
# are free there. The server runs as the image's ENTRYPOINT + CMD.
NETNS_DIR=$(mktemp -d)
unshare --net --fork --kill-child sh -c 'ip link set lo up && exec sleep 600' &
NETNS_PID=$!
for _ in $(seq 50); do
  child=$(pgrep -P "$NETNS_PID" sleep || true)
  [ -n "$child" ] && break
  sleep 0.1
done
[ -n "${child:-}" ] || fail "could not create a network namespace"
NETNS_CHILD=$child
in_netns() { nsenter --net="/proc/$child/ns/net" "$@"; }
in_netns "${BUILDAH[@]}" run --isolation=chroot "$ctr" -- "${SERVER_ARGV[@]}" \
  >"$NETNS_DIR/server.log" 2>&1 &
SERVER_PID=$!

healthy=0
for _ in $(seq 120); do
  if in_netns "${BUILDAH[@]}" run --isolation=chroot "$ctr" -- "${HEALTH_ARGV[@]}" \
       >"$NETNS_DIR/health.log" 2>&1; then
    healthy=1
    break
  fi
  kill -0 "$SERVER_PID" 2>/dev/null ||
    { cat "$NETNS_DIR/server.log" >&2; fail "the server exited at start-up"; }
  sleep 0.5
done
[ "$healthy" = 1 ] ||
  { cat "$NETNS_DIR/server.log" "$NETNS_DIR/health.log" >&2; fail "HEALTHCHECK never passed"; }
log "HEALTHCHECK passed: ${HEALTH_ARGV[*]}"

target=$(printf '%s\n' "${HEALTH_ARGV[@]}" | sed -n 's/^--target=//p')
info=$(in_netns "${BUILDAH[@]}" run --isolation=chroot "$ctr" -- \
       attnctl info ${target:+--target=$target}) ||
  fail "attnctl info (GetServerInfo) failed"
echo "$info"
grep -qi 'cpu' <<<"$info" || fail "GetServerInfo does not report the cpu backend"

# SIGTERM reaches the server through buildah run; it must drain and exit 0.
# The server is a descendant of our `buildah run` (never another process of
# the same name on this machine).
server=""
for pid in $(descendants "$SERVER_PID"); do
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = attention-serve ] && server=$pid
done
[ -n "$server" ] || fail "cannot find the server process under buildah run"
kill -TERM "$server"
status=0
wait "$SERVER_PID" || status=$?
cat "$NETNS_DIR/server.log"
[ "$status" = 0 ] || fail "the server exited with $status after SIGTERM"
phase_end

log "build of the image: ${BUILD_SECONDS} s; whole test: $(( $(date +%s) - T_ALL )) s"
echo "docker image test passed"
