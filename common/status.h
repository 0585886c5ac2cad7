// Status helpers shared by every component.
//
// Debian's Abseil (20220623) predates absl's own return-if-error macros, so
// the project defines them once here. Use them everywhere; never throw across
// a module boundary.
#ifndef INFINIGEN_COMMON_STATUS_H_
#define INFINIGEN_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define IG_STATUS_CONCAT_INNER_(a, b) a##b
#define IG_STATUS_CONCAT_(a, b) IG_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define IG_RETURN_IF_ERROR(expr)                      \
  do {                                                \
    ::absl::Status ig_status_ = (expr);               \
    if (!ig_status_.ok()) return ig_status_;          \
  } while (0)

// `IG_ASSIGN_OR_RETURN(auto x, StatusOrExpr());` assigns the value or returns
// the error.
#define IG_ASSIGN_OR_RETURN(lhs, expr) \
  IG_ASSIGN_OR_RETURN_IMPL_(IG_STATUS_CONCAT_(ig_statusor_, __LINE__), lhs, expr)

#define IG_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                              \
  if (!statusor.ok()) return statusor.status();        \
  lhs = std::move(statusor).value()

#endif  // INFINIGEN_COMMON_STATUS_H_
