#include "runtime/device_error_status.h"

#include "absl/strings/str_cat.h"
#include "runtime/protocol/imm.h"

namespace llep {

using protocol::LlOp;

absl::Status DeviceErrorToStatus(const protocol::DeviceErrorRecord& e, const DeviceErrorContext& ctx) {
  const LlOp op = e.op == 0 ? LlOp::kDispatch : LlOp::kCombine;
  const std::string where = absl::StrCat("GPU ", protocol::LlOpName(op), " call ", e.seq, ": ");
  std::string msg;
  switch (e.code) {
    case protocol::kDeviceBadExpertId:
      msg = absl::StrCat(where, "topk_idx holds expert id ", e.detail, ", outside [-1, ", ctx.num_experts,
                         ") or repeated within one token; that selection was dropped (treated as -1)");
      break;
    case protocol::kDeviceBadLayoutRange:
      msg = absl::StrCat(where, "the handle's layout_range is inconsistent (entry or total ", e.detail, ", home rank ",
                         e.peer, "); those rows were not sent: pass the handle of the matching dispatch");
      break;
    case protocol::kDeviceCombineMismatch:
      if (e.detail == protocol::kCombinePlanGone) {
        msg = absl::StrCat(where, "rank ", e.peer,
                           " no longer holds the plan of this combine's dispatch (it carried combine_weights, and a "
                           "later dispatch into the same buffer half replaced it): combine a dispatch that carries "
                           "combine_weights before the next-but-one dispatch (out was not written)");
      } else if (e.detail == protocol::kCombineWeightsDiffer) {
        msg = absl::StrCat(where,
                           "topk_weights differ from the combine_weights its dispatch carried (the experts' ranks "
                           "reduced with those): pass the same values (out was not written)");
      } else {
        msg =
            absl::StrCat(where, "rank ", e.peer, " returned ", e.detail >> 32,
                         " rows but this rank's topk_idx selects ", e.detail & 0xFFFFFFFF,
                         " of its experts; combine needs the topk_idx of the matching dispatch (out was not written)");
      }
      break;
    case protocol::kDeviceTimeout:
      msg = absl::StrCat(where,
                         e.peer == ctx.rank ? "this rank's own kernel did not finish its sends"
                                            : absl::StrCat("rank ", e.peer, " did not signal"),
                         " within ", absl::FormatDuration(ctx.timeout),
                         " (peer dead, stalled, or calling a different sequence of operations)");
      break;
    case protocol::kDeviceInFlight:
      msg = absl::StrCat(
          where, "its buffer half still held call ", e.detail,
          ", whose receive (hook) had not run (nothing was sent): at most two low-latency operations may be in "
          "flight per buffer (a captured graph that sends without receiving was replayed again before its receive "
          "ran)");
      break;
    case protocol::kDeviceBadReceive:
      msg = absl::StrCat("GPU ", protocol::LlOpName(op), " receive (hook, call tag ", e.detail,
                         "): its operation was not waiting for it (already received, or its send never ran): a graph "
                         "holding the receive was replayed without a new replay of the send");
      break;
    case protocol::kDeviceRegionBusy:
      msg = absl::StrCat(
          where, "it would overwrite, on its peers, the receive region of the previous ", protocol::LlOpName(op),
          " in its buffer half before they are known to have received it (nothing was sent): between that receive "
          "and this send, this rank must send and receive another operation, e.g. alternate dispatch and combine "
          "(replayed graphs broke the rule; runtime/call_sequence.h)");
      break;
    case protocol::kDeviceProxyFailed:
      msg = absl::StrCat(where, "the proxy serving rank ", e.peer, " stopped: ", ctx.proxy_status);
      break;
    case protocol::kDeviceSequenceOverrun:
      msg = absl::StrCat(where, "rank ", e.peer, " already signalled call ", e.detail,
                         " into the same half: more operations were in flight than allowed");
      break;
    default:
      msg = absl::StrCat(where, "inconsistent data from rank ", e.peer, " (error code ", e.code, ", detail ", e.detail,
                         "): ranks disagree on the call sequence, topk_idx of dispatch and combine, or the buffer "
                         "shape");
      break;
  }
  return absl::Status(static_cast<absl::StatusCode>(protocol::DeviceErrorCanonicalCode(e.code)), msg);
}

}  // namespace llep
