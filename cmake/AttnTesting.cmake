# attn_add_test(NAME SOURCES src... LIBS lib... [LABELS label...]
#               [RUN_SERIAL])
# One GoogleTest executable; each TEST becomes a CTest test (RUN_SERIAL:
# none runs alongside another test). Targets labelled gpu are collected in
# the global property ATTN_GPU_TEST_TARGETS.
function(attn_add_test name)
  cmake_parse_arguments(ARG "RUN_SERIAL" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest_main
                        GTest::gmock)
  set(labels ${ARG_LABELS})
  if(NOT labels)
    set(labels unit)
  endif()
  if("gpu" IN_LIST labels)
    # The GPU check bundle (scripts/gpu-bundle.sh) ships every such test.
    set_property(GLOBAL APPEND PROPERTY ATTN_GPU_TEST_TARGETS ${name})
  endif()
  set(serial FALSE)
  if(ARG_RUN_SERIAL)
    set(serial TRUE)
  endif()
  gtest_discover_tests(${name} PROPERTIES LABELS "${labels}"
                       RUN_SERIAL ${serial} DISCOVERY_TIMEOUT 60)
endfunction()
