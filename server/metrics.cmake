# attention_metrics: the server's Prometheus metrics and /metrics endpoint
# (metrics.h). Included from server/CMakeLists.txt.
add_library(attention_metrics ${CMAKE_CURRENT_LIST_DIR}/metrics.cc)
target_link_libraries(attention_metrics
  PUBLIC prometheus-cpp::core prometheus-cpp::pull gRPC::grpc++
         absl::status absl::statusor absl::strings absl::synchronization
         absl::time absl::span)
