#include "runtime/call_sequence.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace llep {

absl::StatusOr<uint32_t> CallSequence::Begin(const char* op_name) {
  const uint32_t seq = next();
  for (uint32_t s : unreceived_) {
    if (protocol::HalfOfSeq(s) == protocol::HalfOfSeq(seq)) {
      return absl::FailedPreconditionError(
          absl::StrCat("at most two low-latency operations may be in flight: ", op_name, " call ", seq,
                       " would reuse the buffer half of call ", s, ", whose receive (hook) has not run"));
    }
  }
  last_ = seq;
  return seq;
}

bool CallSequence::AwaitingReceive(uint32_t seq) const {
  return seq != 0 && std::find(unreceived_.begin(), unreceived_.end(), seq) != unreceived_.end();
}

bool CallSequence::Received(uint32_t seq) {
  auto it = std::find(unreceived_.begin(), unreceived_.end(), seq);
  if (seq == 0 || it == unreceived_.end()) return false;
  unreceived_.erase(it);
  return true;
}

}  // namespace llep
