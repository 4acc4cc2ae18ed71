#!/bin/sh
# Prints the Debian/Ubuntu packages that provide the shared libraries the
# given executables load (one name a line, sorted), so that a runtime image
# installs exactly those whatever the distribution calls them (Ubuntu 24.04
# names many libraries with a `t64` suffix, Debian bookworm does not).
#
# Usage: runtime-packages.sh EXECUTABLE...
# Fails when a library is missing or belongs to no package, except the
# NVIDIA driver's libcuda, which the container runtime mounts from the host.
set -eu
[ "$#" -gt 0 ] || { echo "usage: $0 EXECUTABLE..." >&2; exit 2; }
libraries=""
for executable in "$@"; do
  listing=$(ldd "$executable") || {
    echo "runtime-packages.sh: ldd $executable failed" >&2; exit 1; }
  missing=$(printf '%s\n' "$listing" |
            awk '/not found/ && $1 !~ /^libcuda\.so/ { print $1 }')
  if [ -n "$missing" ]; then
    echo "runtime-packages.sh: $executable needs missing libraries:" \
         $missing >&2
    exit 1
  fi
  libraries="$libraries
$(printf '%s\n' "$listing" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }')"
done
packages=""
for library in $(printf '%s\n' "$libraries" | sort -u); do
  real=$(readlink -f "$library")
  # dpkg knows a file by the path its package installed it under, which on
  # merged-/usr systems may differ from the loader's path: try each form.
  package=""
  for candidate in "$library" "$real" "/usr$real" "${real#/usr}"; do
    package=$(dpkg -S "$candidate" 2>/dev/null | head -n 1 | cut -d: -f1) \
      || true
    [ -n "$package" ] && break
  done
  if [ -z "$package" ]; then
    echo "runtime-packages.sh: no package provides $library" >&2
    exit 1
  fi
  packages="$packages $package"
done
printf '%s\n' $packages | sort -u
