// The network backend interface the proxy threads drive: register one region, exchange addresses, post RDMA
// writes carrying a 32-bit immediate, poll completions. Layer: proxy. One Transport per proxy thread, used only
// by that thread (libfabric FI_THREAD_DOMAIN semantics). Implementations: fabric/ (libfabric: shm, tcp;ofi_rxm,
// verbs;ofi_rxm, efa); an ibverbs RC backend plugs in behind the same interface (issue: inter-node path).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace llep::proxy {

struct Completion {
  enum class Kind { kWriteDone, kRemoteImm };
  Kind kind;
  uint64_t cookie = 0;  ///< kWriteDone: the cookie given to PostWrite.
  uint32_t imm = 0;     ///< kRemoteImm: the immediate of a write that landed in our region.
};

class Transport {
 public:
  virtual ~Transport() = default;

  /// Human-readable backend name ("libfabric/shm").
  virtual std::string Name() const = 0;
  /// Registers [base, base+bytes) as both the local source and the remote target of writes. Called once.
  virtual absl::Status RegisterRegion(void* base, uint64_t bytes) = 0;
  /// What peers need to reach this endpoint and region (address, key, base). Valid after RegisterRegion.
  virtual absl::StatusOr<std::string> LocalBlob() const = 0;
  /// Records every rank's blob (index = rank, including our own).
  virtual absl::Status Connect(const std::vector<std::string>& blobs) = 0;
  /// Largest byte count one PostWrite accepts; the proxy splits larger commands.
  virtual uint64_t MaxWriteBytes() const = 0;
  /// Posts an RDMA write of `bytes` from local_off to peer's remote_off with `imm` delivered to the peer's
  /// completion queue. Returns false (nothing posted) when the send queue is full: poll, then retry. imm == 0 (never a
  /// valid immediate, protocol/imm.h) asks for a plain write without remote completion; the proxy does that only on
  /// transports with OrderedAtomics().
  virtual absl::StatusOr<bool> PostWrite(int peer, uint64_t local_off, uint64_t remote_off, uint64_t bytes,
                                         uint32_t imm, uint64_t cookie) = 0;
  /// True when writes and atomics to one peer take effect at the target in posting order and remote 64-bit atomic
  /// adds exist (ibverbs RC: one QP per peer, the NIC's own atomics). The proxy then signals with an atomic add onto
  /// the peer's signal word after the data, so no receiver CPU is involved; otherwise (EFA, libfabric providers
  /// without that ordering) the receiver counts immediates (arrival_counter.h).
  virtual bool OrderedAtomics() const { return false; }
  /// Adds `add` to the 8-byte-aligned 64-bit word at peer's remote_off, ordered after earlier posts to that peer.
  /// Returns false when the send queue is full. Only called when OrderedAtomics().
  virtual absl::StatusOr<bool> PostAtomicAdd(int peer, uint64_t remote_off, uint64_t add, uint64_t cookie) {
    (void)peer, (void)remote_off, (void)add, (void)cookie;
    return absl::UnimplementedError(Name() + " has no ordered remote atomics");
  }
  /// Appends up to `max` completions to `out`; returns how many. Must be called continuously: software
  /// providers progress data only inside this call (FI_PROGRESS_MANUAL), also on ranks that only receive.
  virtual absl::StatusOr<int> Poll(Completion* out, int max) = 0;
};

}  // namespace llep::proxy
