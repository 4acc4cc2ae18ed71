# metrics_test: ServerMetrics (server/metrics.h). Included from
# tests/server/CMakeLists.txt.
attn_add_test(metrics_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/metrics_test.cc
  LIBS attention_metrics attention_test_http_get absl::strings absl::time)
