// The record a GPU kernel leaves when it finds an error, and what each code means to the caller.
// Layer: runtime/protocol. Written by the kernels (kernels/cuda/ll_device_common.cuh RecordError) into mapped,
// pinned host memory; read by the host without synchronising (runtime/gpu_buffer.cc), which turns it into an
// absl::Status with runtime/device_error_status.h. This header cannot name abseil (protocol rule), so the status
// code of each error is given here as its canonical number (absl::StatusCode, google.rpc.Code use the same), and
// the message, which needs the buffer's context, is written there.
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"

namespace llep::protocol {

/// Error codes the kernels record (DeviceErrorRecord::code). 0 = no error.
enum DeviceErrorCode : uint32_t {
  kDeviceOk = 0,
  kDeviceBadExpertId = 1,       ///< topk_idx outside [-1, num_experts) or repeated: detail = the id; treated as -1
  kDeviceBadLayoutRange = 2,    ///< combine handle's layout_range inconsistent: detail = the entry; rows skipped
  kDeviceTimeout = 3,           ///< a peer did not signal in time: peer = that rank (own rank: a CTA never finished)
  kDeviceSequenceOverrun = 4,   ///< a signal from a later call arrived first: detail = its seq
  kDeviceBadMessage = 5,        ///< a received header is inconsistent: peer = its source, detail = message index
  kDeviceInFlight = 6,          ///< a send found its half held by an unreceived operation: detail = that seq
  kDeviceBadReceive = 7,        ///< a receive launch whose tag names no operation waiting for it: detail = the tag
  kDeviceRegionBusy = 8,        ///< a send into a region peers may still read (LlCallState): detail = first safe seq
  kDeviceProxyFailed = 9,       ///< a FIFO push found the proxy stopped (its abort flag): peer = the destination
  kDeviceCombineMismatch = 10,  ///< an expert rank returned other than the rows this rank's topk_idx selects:
                                ///< peer = that rank, detail = rows returned << 32 | rows selected; out not written
                                ///< (or, negative, one of the expert-side combine's causes below)
};
/// kDeviceCombineMismatch details of an expert-side combine (kernels/EXPERT_SIDE_COMBINE.md; peer = the recording
/// rank): the dispatch's kept plan (its messages on an expert rank, or its weights on the home rank) was replaced by a
/// later dispatch into the same half; the combine's topk_weights differ from the combine_weights its dispatch carried.
inline constexpr int64_t kCombinePlanGone = -1;
inline constexpr int64_t kCombineWeightsDiffer = -2;
inline constexpr uint32_t kNumDeviceErrorCodes = 11;

/// One error a kernel hit. The right to write it is claimed with an atomic on a device-memory word, the fields are
/// written, and `code` is stored last, so the host never reads a code with the fields of another error.
struct DeviceErrorRecord {
  uint32_t code;   ///< DeviceErrorCode
  uint32_t op;     ///< LlOp
  int32_t peer;    ///< rank the error concerns, or -1
  uint32_t seq;    ///< call sequence number
  int64_t detail;  ///< code-specific value
};

/// The kernels' error records, one per severity (DeviceErrorIsRecoverable), each keeping the first error of its
/// kind: a fatal error after a recoverable one that the host has not read yet must still be reported, or the buffer
/// would be aborted on the device (every later launch does nothing) while the host saw only the bad input and went
/// on calling — a silent dead buffer (found by the GPU bad-input catalogue, bench/RESULTS.md session 15). The host
/// reads `fatal` first.
struct DeviceErrorRecords {
  DeviceErrorRecord recoverable;  ///< claimed by the word flags[0]; re-armed by the host once reported
  DeviceErrorRecord fatal;        ///< claimed by the abort flag flags[1]; cleared only by recovery
};

/// Canonical status codes (the numbering absl::StatusCode and google.rpc.Code share).
enum class CanonicalCode : int {
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kFailedPrecondition = 9,
  kUnavailable = 14,
  kDataLoss = 15,
};

/// The status code the caller gets for a device error: bad input is InvalidArgument, a silent peer DeadlineExceeded,
/// a broken call-order rule FailedPrecondition, a stopped proxy Unavailable, anything that means the ranks disagree
/// (or an unknown code) DataLoss.
LLEP_HD constexpr CanonicalCode DeviceErrorCanonicalCode(uint32_t code) {
  switch (code) {
    case kDeviceBadExpertId:
    case kDeviceBadLayoutRange:
    case kDeviceCombineMismatch:
      return CanonicalCode::kInvalidArgument;
    case kDeviceTimeout:
      return CanonicalCode::kDeadlineExceeded;
    case kDeviceInFlight:
    case kDeviceBadReceive:
    case kDeviceRegionBusy:
      return CanonicalCode::kFailedPrecondition;
    case kDeviceProxyFailed:
      return CanonicalCode::kUnavailable;
    default:
      return CanonicalCode::kDataLoss;
  }
}

/// Recoverable errors leave the buffer consistent (the kernels treated the bad entries as absent, or a combine whose
/// topk_idx does not match its handle completed its protocol without writing out); every other code leaves the
/// protocol state unknown: the operation is aborted and the host refuses further calls. Recoverable is exactly the
/// caller's bad input (InvalidArgument): one list of codes, in DeviceErrorCanonicalCode.
LLEP_HD constexpr bool DeviceErrorIsRecoverable(uint32_t code) {
  return DeviceErrorCanonicalCode(code) == CanonicalCode::kInvalidArgument;
}

}  // namespace llep::protocol
