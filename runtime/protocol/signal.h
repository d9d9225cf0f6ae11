// Completion signals between ranks: the 64-bit signal word and the proxy inbox slot.
// Layer: runtime/protocol.
//
// Producer/consumer and memory order:
//  - Same-host (or self) senders write data, then publish the signal word with StoreReleaseSys (sys_order.h);
//    the receiver polls with LoadAcquireSys.
//  - Remote senders never write the signal word. Their proxy writes an InboxSlot with remote CQ data; the
//    receiving proxy publishes InboxSlot::signal_word into the signal word with a release store only after it
//    counted InboxSlot::num_data_writes data completions (proxy/arrival_counter.h). Data landing is not a signal.
//
// The word carries the call sequence number, so a half never needs zeroing between uses: a receiver waiting
// for call `seq` ignores words from older calls and reports an overrun if it sees a newer one.
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"
#include "runtime/protocol/sys_order.h"

namespace llep::protocol {

inline constexpr uint32_t kSignalVersion = 1;

// Signal word: [63:32] call sequence number (never 0 for a real call), [31:0] value. Dispatch: token messages
// sent by that source. Combine: rows sent by that source. Zero-initialised memory therefore reads "nothing yet".
LLEP_HD constexpr uint64_t PackSignal(uint32_t seq, uint32_t value) { return JoinHalves(seq, value); }
LLEP_HD constexpr uint32_t SignalSeq(uint64_t word) { return HighHalf(word); }
LLEP_HD constexpr uint32_t SignalValue(uint64_t word) { return LowHalf(word); }

/// True when `observed` is from a call after `expected` (modular, so sequence wrap-around is harmless). A
/// receiver that sees this lost its message to a later call: more operations were in flight than allowed.
LLEP_HD constexpr bool SignalIsNewer(uint32_t observed, uint32_t expected) {
  return observed != expected && static_cast<uint32_t>(observed - expected) < (1u << 31);
}

/// The call sequence number after `seq`. 0 means "never signalled" in zeroed memory, so it is skipped; 2 keeps
/// the alternation of halves (0xFFFFFFFF is odd, 2 is even).
LLEP_HD constexpr uint32_t NextCallSeq(uint32_t seq) { return seq + 1 == 0 ? 2u : seq + 1; }

/// The sequence number of the n-th operation (n = 0, 1, ...) a device-sequenced buffer (the GPU backend: kernels/cuda
/// ll_kernels.h LlCallState) sends: 4, 5, ..., 0xFFFFFFFF, then 4 again. Never 0 ("never signalled"); the period
/// 2^32 - 4 is a multiple of 4, so the halves (seq & 1) and the kernels' 4-entry latency stamp ring (seq % 4) keep
/// alternating across the wrap, which comes after 4.3e9 operations (days of decoding).
LLEP_HD constexpr uint32_t DeviceCallSeq(uint64_t n) { return static_cast<uint32_t>(4 + n % 0xFFFFFFFCull); }

/// The half a call uses: calls alternate between the two halves of the double-buffered region.
LLEP_HD constexpr int HalfOfSeq(uint32_t seq) { return static_cast<int>(seq & 1u); }

/// What a remote sender's proxy writes into the receiver's inbox (16 bytes, one RDMA write with CQ data).
struct alignas(16) InboxSlot {
  uint64_t signal_word;      ///< PackSignal(seq, value) to publish once all data arrived.
  uint32_t num_data_writes;  ///< Data writes (with data immediates) the sender posted before this slot.
  uint32_t version;          ///< kSignalVersion.
};
static_assert(sizeof(InboxSlot) == 16, "one 16-byte RDMA write must carry the whole slot");

}  // namespace llep::protocol
