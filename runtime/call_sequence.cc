#include "runtime/call_sequence.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace llep {
namespace {

const char* Name(protocol::LlOp op) { return op == protocol::LlOp::kDispatch ? "dispatch" : "combine"; }

/// a is b or a later sequence number (modular, as signals compare them).
bool AtOrAfter(uint32_t a, uint32_t b) { return a == b || protocol::SignalIsNewer(a, b); }

}  // namespace

absl::StatusOr<uint32_t> CallSequence::Begin(protocol::LlOp op) {
  const uint32_t seq = next();
  const int half = protocol::HalfOfSeq(seq);
  for (const Waiting& w : unreceived_) {
    if (protocol::HalfOfSeq(w.seq) == half) {
      return absl::FailedPreconditionError(absl::StrCat(
          "at most two low-latency operations may be in flight: ", Name(op), " call ", seq,
          " would reuse the buffer half of ", Name(w.op), " call ", w.seq, ", whose receive (hook) has not run"));
    }
  }
  const Region& r = regions_[static_cast<int>(op)][half];
  if (r.sent_after != 0 && (newest_received_ == 0 || !AtOrAfter(newest_received_, r.sent_after))) {
    return absl::FailedPreconditionError(absl::StrCat(
        Name(op), " call ", seq, " would overwrite, on its peers, the receive region of ", Name(op), " call ",
        r.last_seq, " before they are known to have received it: between that call's receive and the next ", Name(op),
        " into the same buffer half, this rank must send and receive another operation (alternate dispatch and "
        "combine, as decode loops do)"));
  }
  last_ = seq;
  last_op_ = op;
  return seq;
}

void CallSequence::AwaitReceive(uint32_t seq) { unreceived_.push_back({seq, last_op_}); }

bool CallSequence::AwaitingReceive(uint32_t seq) const {
  return seq != 0 &&
         std::any_of(unreceived_.begin(), unreceived_.end(), [&](const Waiting& w) { return w.seq == seq; });
}

bool CallSequence::Received(uint32_t seq) {
  auto it = std::find_if(unreceived_.begin(), unreceived_.end(), [&](const Waiting& w) { return w.seq == seq; });
  if (seq == 0 || it == unreceived_.end()) return false;
  const protocol::LlOp op = it->op;
  unreceived_.erase(it);
  Finish(seq, op);
  return true;
}

void CallSequence::Restart(uint32_t last) {
  last_ = last;
  last_op_ = protocol::LlOp::kDispatch;
  newest_received_ = 0;
  for (auto& per_op : regions_) {
    for (Region& r : per_op) r = Region{};
  }
  unreceived_.clear();
}

void CallSequence::Finish(uint32_t seq, protocol::LlOp op) {
  Region& r = regions_[static_cast<int>(op)][protocol::HalfOfSeq(seq)];
  r.last_seq = seq;
  r.sent_after = next();
  if (newest_received_ == 0 || protocol::SignalIsNewer(seq, newest_received_)) newest_received_ = seq;
}

}  // namespace llep
