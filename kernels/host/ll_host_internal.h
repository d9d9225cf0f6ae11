// The host LL phases' shared pieces (kernels/host/ll_host.cc: dispatch, ll_host_combine.cc: combine): the signal
// store, the proxy ring pushes and the rank mask. Internal to kernels/host (included by those two files only); not part
// of ll_host.h's interface.
#pragma once

#include <cstdint>

#include "kernels/host/ll_host.h"
#include "runtime/protocol/signal.h"
#include "runtime/protocol/sys_order.h"

namespace llep::kernels {

inline void StoreSignalRelease(uint8_t* base, int64_t offset, uint64_t word) {
  // Pairs with the acquire load in runtime/cpu_buffer.cc WaitForSignals(): data copied above is visible first.
  protocol::StoreReleaseSys(reinterpret_cast<uint64_t*>(base + offset), word);
}

inline bool PushWrite(const HostPeer& peer, protocol::LlOp op, int half, int dst, int64_t local_off, int64_t remote_off,
                      int64_t bytes) {
  return protocol::FifoPush(*peer.fifo,
                            protocol::MakeWriteCmd(op, half, dst, static_cast<uint64_t>(local_off),
                                                   static_cast<uint64_t>(remote_off), static_cast<uint64_t>(bytes)));
}

inline bool PushSignal(const HostPeer& peer, protocol::LlOp op, int half, int dst, uint64_t word) {
  return protocol::FifoPush(*peer.fifo, protocol::MakeSignalCmd(op, half, dst, word));
}

/// Peer d's signal word for this rank: a release store into its region (a peer mapped here), or a signal command after
/// the writes already pushed to its proxy ring (ring order delivers it after them). False: the ring refused the push.
inline bool SignalPeer(const HostRankContext& ctx, const HostPeer& peer, protocol::LlOp op, int half, int d,
                       uint64_t word) {
  if (peer.direct_base == nullptr) return PushSignal(peer, op, half, d, word);
  StoreSignalRelease(peer.direct_base, ctx.layout.SignalOffset(half, op, ctx.rank), word);
  return true;
}

inline bool IsMasked(const HostRankContext& ctx, int r) { return ctx.masked != nullptr && ctx.masked[r] != 0; }

}  // namespace llep::kernels
