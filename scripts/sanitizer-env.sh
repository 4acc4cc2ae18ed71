# Sourced by scripts/sanitize.sh and scripts/fuzz.sh: sanitizer options that
# make every report fatal, for the test processes and every process they
# spawn (the variables are inherited).
_attn_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ASAN_OPTIONS="halt_on_error=1:abort_on_error=1:detect_leaks=1:strict_string_checks=1"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
export LSAN_OPTIONS="suppressions=${_attn_root}/tests/sanitizers/lsan.supp:print_suppressions=0"
unset _attn_root
