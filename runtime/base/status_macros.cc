#include "runtime/base/status_macros.h"

namespace llep::base {

absl::Status ErrnoToStatus(int err, absl::string_view call) {
  std::string msg = absl::StrCat(call, " failed: ", std::strerror(err), " (errno ", err, ")");
  switch (err) {
    case ETIMEDOUT:
      return absl::DeadlineExceededError(msg);
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
      return absl::UnavailableError(msg);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(msg);
    case EINVAL:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace llep::base
