// The call sequence of one buffer and its in-flight rules, shared by the CPU and the GPU backend. Layer: runtime.
//
// Every send takes the next sequence number (protocol::NextCallSeq); its parity picks the buffer half, and its kind
// (dispatch or combine) the region of that half its peers receive into. Two rules keep peers from overwriting
// what is still being read; a send that would break one is refused (FailedPrecondition):
//  1. At most two operations hold buffer state: a send needs the operation that used its half before (two sends
//     earlier) received here, i.e. its receive (hook) has run.
//  2. A region is reused only once every peer finished receiving from it. A rank cannot see its peers' receives,
//     but all ranks make the same calls in the same order, so it is enough that, between the receive of the
//     region's last operation and this send, this rank sent and received another operation: that operation's data
//     from each peer left after the peer's own receive of the region. Alternating dispatch and combine (every decode
//     loop, with or without two overlapped micro-batches) always satisfies it; three dispatches in a row with two of
//     them in flight do not.
// The GPU kernels apply the same rules on the device to replays of CUDA graphs (kernels/cuda/ll_kernels.h
// LlCallState), which the host does not see. Not thread-safe: the owner locks.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/protocol/imm.h"
#include "runtime/protocol/ll_shape.h"
#include "runtime/protocol/signal.h"

namespace llep {

class CallSequence {
 public:
  /// The sequence number the next send will take (what NextCombineBuffer() stages for).
  uint32_t next() const { return protocol::NextCallSeq(last_); }
  /// Takes the next sequence number for an operation of kind `op`, or FailedPrecondition if a rule refuses it.
  absl::StatusOr<uint32_t> Begin(protocol::LlOp op);
  /// Marks `seq` (the last Begin) as sent and waiting for its receive phase.
  void AwaitReceive(uint32_t seq);
  /// True while `seq` was sent and its receive phase has not ended.
  bool AwaitingReceive(uint32_t seq) const;
  /// Ends the wait of `seq`; false if it was not waiting (already received, or never sent here).
  bool Received(uint32_t seq);
  /// `seq` (the last Begin) was launched with its receive phase: received at once.
  void Completed(uint32_t seq) { Finish(seq, last_op_); }
  /// Starts over after a collective reset (clean_low_latency_buffer): the next send takes NextCallSeq(last), nothing
  /// is in flight (an unreceived operation is abandoned: its receive is refused) and no region is held by a peer.
  void Restart(uint32_t last);
  /// The last sequence number taken (0 before the first send).
  uint32_t last() const { return last_; }

 private:
  struct Waiting {
    uint32_t seq;
    protocol::LlOp op;
  };
  /// Per (kind, half): the last operation received from the region and the first sequence number sent after it.
  struct Region {
    uint32_t last_seq = 0;
    uint32_t sent_after = 0;  // 0: nothing received from the region yet
  };
  void Finish(uint32_t seq, protocol::LlOp op);

  uint32_t last_ = 0;
  protocol::LlOp last_op_ = protocol::LlOp::kDispatch;
  uint32_t newest_received_ = 0;  // 0: none yet
  Region regions_[protocol::kNumLlOps][2];
  std::vector<Waiting> unreceived_;
};

}  // namespace llep
