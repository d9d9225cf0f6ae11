// The consumer side of a runtime/protocol/fifo_ring.h ring. Layer: proxy. Used by exactly one proxy thread.
#pragma once

#include <cstdint>

#include "runtime/protocol/fifo_ring.h"

namespace llep::proxy {

class FifoConsumer {
 public:
  explicit FifoConsumer(const protocol::FifoRingHandle& ring) : ring_(ring) {}

  /// Copies up to `max` committed commands, in ring order, into `out` and frees their slots. Returns the count.
  int Poll(protocol::FifoCmd* out, int max) {
    int n = 0;
    while (n < max) {
      protocol::FifoCmd* slot = &ring_.ring[tail_ & (ring_.size - 1)];
      // Pairs with the release store of w1 in FifoPush(): w0 is read only after the commit bit is seen.
      const uint64_t w1 = __atomic_load_n(&slot->w1, __ATOMIC_ACQUIRE);
      if ((w1 & protocol::kCmdCommitBit) != protocol::ExpectedCommit(tail_, ring_.size)) break;
      out[n].w0 = __atomic_load_n(&slot->w0, __ATOMIC_RELAXED);
      out[n].w1 = w1;
      ++n;
      ++tail_;
    }
    // Pairs with the acquire load of tail in FifoPush(): our reads of the slots happen before producers reuse them.
    if (n > 0) __atomic_store_n(ring_.tail, tail_, __ATOMIC_RELEASE);
    return n;
  }

 private:
  protocol::FifoRingHandle ring_;
  uint64_t tail_ = 0;
};

}  // namespace llep::proxy
