#!/bin/sh
# Checks that the objects compiled with ISA flags (*_avx2.cc.o,
# *_avx512.cc.o) define, with external linkage, only their entry points
# (attention::cpu::Avx2Kernels() and the like) and symbols of their own ISA
# namespace. Any other such symbol (an inline function of a shared header,
# a template instantiated there) is a weak definition the linker may pick
# for the whole program: code built for AVX-512 would then run on machines
# without it. Without optimization (a Debug build) nothing is inlined, so
# this is where such a symbol shows first. The compiler's own data
# (DW.ref.__gxx_personality_v0, for unwinding) is no code and may stand.
#
# Usage: isa_objects_test.sh NM OBJECTS...   (OBJECTS: paths, or CMake lists
# of paths separated by ';')
set -eu
nm_tool=$1
shift
checked=0
failed=0
objects=$(printf '%s\n' "$@" | tr ';' '\n')
old_ifs=${IFS}
IFS='
'
for object in ${objects}; do
  IFS=${old_ifs}
  case "${object}" in
    *_avx2.cc.o | *_avx2.cc.obj) isa=avx2 ;;
    *_avx512.cc.o | *_avx512.cc.obj) isa=avx512 ;;
    *) continue ;;
  esac
  checked=$((checked + 1))
  # Upper-case types have external linkage (u: unique global, V/W: weak).
  stray=$("${nm_tool}" -C --defined-only "${object}" |
    awk '$2 ~ /^[A-Zu]$/ { $1 = ""; $2 = ""; sub(/^  /, ""); print }' |
    grep -v -e "^\([^(]* \)\?attention::cpu::${isa}_kernels::" \
      -e "^DW\.ref\." \
      -e "^attention::cpu::Avx${isa#avx}\(Kernels\|IndexScores\)()\$" || true)
  if [ -n "${stray}" ]; then
    echo "FAIL ${object}: symbols outside the ${isa} namespace:" >&2
    echo "${stray}" >&2
    failed=1
  fi
done
if [ "${checked}" -eq 0 ]; then
  echo "SKIP: no ISA objects (not an x86-64 build)"
  exit 77
fi
[ "${failed}" -eq 0 ] && echo "OK: ${checked} ISA objects define only their own symbols"
exit "${failed}"
