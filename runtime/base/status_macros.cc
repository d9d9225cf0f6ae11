#include "runtime/base/status_macros.h"

namespace llep::base {

absl::StatusCode ErrnoCode(int err) {
  switch (err) {
    case ETIMEDOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
      return absl::StatusCode::kUnavailable;
    case ENOMEM:
    case ENOSPC:
      return absl::StatusCode::kResourceExhausted;
    case EINVAL:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status ErrnoToStatus(int err, absl::string_view call) {
  return absl::Status(ErrnoCode(err), absl::StrCat(call, " failed: ", std::strerror(err), " (errno ", err, ")"));
}

}  // namespace llep::base
