// Status propagation macros. Debian 12's abseil (20220623) has no ABSL_RETURN_IF_ERROR, so llep defines its own.
// Layer: runtime/base. Every host module returns absl::Status / absl::StatusOr and uses these.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace llep::base {

/// Returns `s` with `context` prepended ("context: message"), keeping the code: NCCL-style breadcrumbs.
inline absl::Status Annotate(const absl::Status& s, absl::string_view context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

/// The Status code of an errno value (ETIMEDOUT -> DeadlineExceeded, connection errors -> Unavailable, ...).
absl::StatusCode ErrnoCode(int err);
/// Maps a negative errno-style return (`rc < 0`, value -errno) to a Status naming the failed call.
absl::Status ErrnoToStatus(int err, absl::string_view call);

}  // namespace llep::base

#define LLEP_STATUS_CONCAT_INNER_(a, b) a##b
#define LLEP_STATUS_CONCAT_(a, b) LLEP_STATUS_CONCAT_INNER_(a, b)

#define LLEP_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status llep_status_ = (expr);        \
    if (!llep_status_.ok()) return llep_status_; \
  } while (0)

#define LLEP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define LLEP_ASSIGN_OR_RETURN(lhs, expr) \
  LLEP_ASSIGN_OR_RETURN_IMPL_(LLEP_STATUS_CONCAT_(llep_statusor_, __LINE__), lhs, expr)

/// For POSIX calls returning -1 and setting errno.
#define LLEP_ERRNO_RETURN_IF_ERROR(expr, call)                         \
  do {                                                                 \
    if ((expr) < 0) return ::llep::base::ErrnoToStatus(errno, (call)); \
  } while (0)
