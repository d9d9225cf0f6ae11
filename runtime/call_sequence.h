// The call sequence of one buffer and its in-flight rule, shared by the CPU and the GPU backend. Layer: runtime.
//
// Every send takes the next sequence number (protocol::NextCallSeq); its parity picks the buffer half. A send is
// refused while an operation that uses the same half has been sent but not received (its receive hook has not
// run): at most two operations hold buffer state at once, as in DeepEP. Not thread-safe: the owner locks.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/protocol/ll_shape.h"
#include "runtime/protocol/signal.h"

namespace llep {

class CallSequence {
 public:
  /// The sequence number the next send will take (what NextCombineBuffer() stages for).
  uint32_t next() const { return protocol::NextCallSeq(last_); }
  /// Takes the next sequence number, or FailedPrecondition if its half is still held by an unreceived op.
  absl::StatusOr<uint32_t> Begin(const char* op_name);
  /// Marks `seq` as sent and waiting for its receive phase.
  void AwaitReceive(uint32_t seq) { unreceived_.push_back(seq); }
  /// True while `seq` was sent and its receive phase has not ended.
  bool AwaitingReceive(uint32_t seq) const;
  /// Ends the wait of `seq`; false if it was not waiting (already received, or never sent here).
  bool Received(uint32_t seq);

 private:
  uint32_t last_ = 0;
  std::vector<uint32_t> unreceived_;
};

}  // namespace llep
