# Sanitizer and fuzzing builds.
#   ATTN_SANITIZE=ON  AddressSanitizer + UndefinedBehaviorSanitizer on every
#                     target (any UB report aborts). CI builds the tests and
#                     the server this way in build-asan (scripts/sanitize.sh).
#   ATTN_FUZZ=ON      libFuzzer targets of tests/fuzz (clang only). Implies
#                     ATTN_SANITIZE and adds coverage instrumentation
#                     (-fsanitize=fuzzer-no-link) to every target; the fuzz
#                     executables link -fsanitize=fuzzer (tests/fuzz).
# Without ATTN_FUZZ the fuzz targets are still built, as plain executables
# that replay their corpora (a ctest test each).
option(ATTN_SANITIZE "Build with -fsanitize=address,undefined" OFF)
option(ATTN_FUZZ "Build the libFuzzer targets (clang)" OFF)

if(ATTN_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ATTN_FUZZ=ON needs clang (CC=clang CXX=clang++)")
  endif()
  set(ATTN_SANITIZE ON)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX,C>:-fsanitize=fuzzer-no-link>)
endif()

if(ATTN_SANITIZE)
  set(_attn_sanitize_flags -fsanitize=address,undefined
      -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX,C>:${_attn_sanitize_flags}>")
  add_link_options(-fsanitize=address,undefined)
  message(STATUS "attention-service: ASan + UBSan build")
endif()
