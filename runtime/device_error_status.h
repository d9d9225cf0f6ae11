// What a caller reads when a GPU kernel recorded an error: the device record (runtime/protocol/device_error.h)
// turned into an absl::Status whose code is the protocol's canonical code for it and whose message says what
// happened and what to do. Host-only, no CUDA, so CI tests every code.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "runtime/protocol/device_error.h"

namespace llep {

/// What the message needs from the buffer that read the record.
struct DeviceErrorContext {
  int rank = 0;
  int num_experts = 0;
  absl::Duration timeout;
  std::string proxy_status;  ///< the proxy's own status, for kDeviceProxyFailed ("" without a proxy)
};

/// The record as a Status (never OK: kDeviceOk and unknown codes are DataLoss, since only a corrupt record holds
/// them when the host looks).
absl::Status DeviceErrorToStatus(const protocol::DeviceErrorRecord& e, const DeviceErrorContext& ctx);

}  // namespace llep
