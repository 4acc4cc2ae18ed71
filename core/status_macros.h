// Small helpers for propagating absl::Status through core without
// exceptions.
#ifndef ATTENTION_CORE_STATUS_MACROS_H_
#define ATTENTION_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTN_CONCAT_INNER_(a, b) a##b
#define ATTN_CONCAT_(a, b) ATTN_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` yields a non-OK status.
#define ATTN_RETURN_IF_ERROR(expr)                     \
  do {                                                 \
    if (::absl::Status attn_status_ = (expr);          \
        !attn_status_.ok()) {                          \
      return attn_status_;                             \
    }                                                  \
  } while (false)

// `ATTN_ASSIGN_OR_RETURN(auto x, MakeX());` assigns the value of a StatusOr
// or returns its error.
#define ATTN_ASSIGN_OR_RETURN(lhs, expr) \
  ATTN_ASSIGN_OR_RETURN_IMPL_(ATTN_CONCAT_(attn_statusor_, __LINE__), lhs, expr)
#define ATTN_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // ATTENTION_CORE_STATUS_MACROS_H_
