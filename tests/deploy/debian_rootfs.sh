#!/bin/bash
# Makes (or finds cached) a Debian bookworm minbase root filesystem as a tar
# and prints its path. debootstrap from the mirror in this machine's apt
# sources; Debian's own apt sources (release, updates, security) inside.
#
# Usage: debian_rootfs.sh CACHE_DIR [PACKAGE...]
#   PACKAGE...  extra packages, e.g. python3: apt-get installs them into the
#               plain minbase (itself cached, so its other users share it).
# Cache: CACHE_DIR/debian-bookworm-minbase[-PACKAGES]-YYYYMMDD.tar, one per
# day (older ones of the same kind are deleted). Needs root and debootstrap;
# progress goes to stderr.
set -euo pipefail

CACHE=${1:?usage: $0 CACHE_DIR [PACKAGE...]}
shift
log() { echo "[rootfs $(date -u +%H:%M:%S)] $*" >&2; }
fail() { echo "FAIL: $*" >&2; exit 1; }

# Prints "URI SUITE" for every Debian source (one-line and deb822 formats).
apt_sources() {
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$file" ] || continue
    awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                       print $i, $(i + 1) }' "$file"
  done
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -f "$file" ] || continue
    awk 'BEGIN { RS = ""; FS = "\n" }
         { uris = ""; suites = ""; types = ""
           for (i = 1; i <= NF; i++) {
             if ($i ~ /^URIs:/) uris = substr($i, 6)
             if ($i ~ /^Suites:/) suites = substr($i, 8)
             if ($i ~ /^Types:/) types = substr($i, 7) }
           if (types !~ /(^| )deb( |$)/) next
           n = split(uris, u, " "); m = split(suites, s, " ")
           for (a = 1; a <= n; a++) for (b = 1; b <= m; b++) print u[a], s[b] }' "$file"
  done
}

KIND=bookworm-minbase
for package in "$@"; do KIND="$KIND-$package"; done
KEY=$KIND-$(date -u +%Y%m%d)
ROOTFS_TAR=$CACHE/debian-$KEY.tar
mkdir -p "$CACHE"
if [ -f "$ROOTFS_TAR" ]; then
  log "cached $ROOTFS_TAR"
  echo "$ROOTFS_TAR"
  exit 0
fi

work=$(mktemp -d "$CACHE/rootfs.XXXXXX")
trap 'rm -rf --one-file-system "$work"' EXIT
T0=$(date +%s)
if [ "$#" -gt 0 ]; then
  # Extra packages: installed with apt-get into the plain minbase (made or
  # cached first, and shared with its other users), in a private mount
  # namespace with /proc; the host's resolver for the mirror.
  BASE_TAR=$(bash "$0" "$CACHE")
  mkdir "$work/rootfs"
  tar -C "$work/rootfs" -xf "$BASE_TAR"
  cp -L /etc/resolv.conf "$work/rootfs/etc/resolv.conf"
  log "apt-get install $* into the minbase..."
  unshare --mount --fork sh -c '
    mount -t proc proc "$0/proc" &&
    exec chroot "$0" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \
      DEBIAN_FRONTEND=noninteractive sh -c "apt-get update &&
        apt-get install -y --no-install-recommends $*"' \
    "$work/rootfs" "$@" >"$work/apt.log" 2>&1 ||
    { tail -n 30 "$work/apt.log" >&2; fail "apt-get install $* failed"; }
  : >"$work/rootfs/etc/resolv.conf"
else
  MIRROR=$(apt_sources | awk '$2 == "bookworm" { print $1; exit }')
  SECURITY=$(apt_sources | awk '$2 == "bookworm-security" { print $1; exit }')
  [ -n "$MIRROR" ] || fail "no 'bookworm' suite in /etc/apt/sources.list{,.d}"
  log "Debian mirror: $MIRROR (security: ${SECURITY:-none})"
  log "debootstrap --variant=minbase bookworm..."
  debootstrap --variant=minbase bookworm "$work/rootfs" \
    "$MIRROR" >"$work/debootstrap.log" 2>&1 ||
    { tail -n 30 "$work/debootstrap.log" >&2; fail "debootstrap failed"; }
  # The sources of Debian's own images: release, updates and security.
  rm -f "$work/rootfs/etc/apt/sources.list"
  {
    printf 'Types: deb\nURIs: %s\nSuites: bookworm bookworm-updates\n' "$MIRROR"
    printf 'Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n'
    if [ -n "$SECURITY" ]; then
      printf '\nTypes: deb\nURIs: %s\nSuites: bookworm-security\n' "$SECURITY"
      printf 'Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n'
    fi
  } >"$work/rootfs/etc/apt/sources.list.d/debian.sources"
fi
rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/"*.bin \
       "$work/rootfs/var/cache/apt/archives/"*.deb
tar -C "$work/rootfs" --numeric-owner -cf "$work/rootfs.tar" .
mv "$work/rootfs.tar" "$ROOTFS_TAR"
# Keep only today's root filesystem of this kind.
find "$CACHE" -maxdepth 1 -name "debian-$KIND-[0-9]*.tar" \
  ! -name "debian-$KEY.tar" -delete
log "made in $(( $(date +%s) - T0 )) s: $ROOTFS_TAR"
echo "$ROOTFS_TAR"
