// Receive-side immediate counting: releases a source's signal only after every data write it announced has
// completed here, so correctness never depends on NIC ordering (EFA SRD delivers out of order).
// Layer: proxy. Owned by one proxy thread; every immediate from a given source arrives at the same thread
// (proxy.h ThreadFor), so the state needs no locks.
//
// Per (op, half, source): data immediates count arrivals; the signal immediate means the 16-byte InboxSlot
// (runtime/protocol/signal.h) is visible and announces how many data writes preceded it. When arrivals reach
// the announced number the slot's signal word is release-stored into the signal area, where the receive phase
// acquires it. Arrivals of a later call on the same (op, half) cannot start before this publish: a sender only
// reuses a half after its own receive of a call that every peer issued after consuming this one.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "runtime/protocol/imm.h"
#include "runtime/protocol/ll_layout.h"

namespace llep::proxy {

class ArrivalCounter {
 public:
  /// `region` is this rank's LL region (inbox slots are read there, signal words written there).
  ArrivalCounter(const protocol::LlLayout& layout, uint8_t* region);

  /// Accounts one received immediate. Errors: malformed immediate, unknown source, more data than announced.
  absl::Status OnImmediate(uint32_t imm);

  /// Keys with a signal received but data still missing (for diagnostics and tests).
  int NumPending() const;

 private:
  struct Key {
    uint32_t arrived = 0;
    uint32_t announced = 0;
    uint64_t signal_word = 0;
    bool signal_seen = false;
  };
  Key& At(protocol::LlOp op, int half, int src);
  void MaybePublish(Key& key, protocol::LlOp op, int half, int src);

  protocol::LlLayout layout_;
  uint8_t* region_;
  std::vector<Key> keys_;  // [op][half][src]
};

}  // namespace llep::proxy
