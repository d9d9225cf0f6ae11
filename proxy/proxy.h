// CPU proxy: threads that drain GPU→CPU (or CPU→CPU) command rings and turn them into RDMA writes with
// immediates, and that count incoming immediates to release signals (arrival_counter.h).
// Layer: proxy. Created by runtime/ after the transports are connected; one thread, ring and transport per
// index. Traffic between ranks a and b always uses thread ThreadFor(a, b) on both sides, so all immediates of
// one (op, half, source) reach one thread and its ArrivalCounter.
//
// Per popped batch the thread groups commands by destination (stable, so per-destination order is kept),
// merges adjacent writes that are contiguous on both sides into one RDMA write, and posts them. For a kSignal it
// stages an InboxSlot announcing how many data writes it posted for that (op, half, destination) since the last
// signal, then writes the slot to the peer's inbox with a signal immediate. On transports whose writes and atomics
// take effect in order (Transport::OrderedAtomics: ibverbs RC) data goes as plain writes and the signal as a remote
// atomic add onto the peer's signal word, so the receiving proxy does nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "proxy/transport.h"
#include "runtime/protocol/fifo_ring.h"
#include "runtime/protocol/ll_layout.h"

namespace llep::proxy {

struct ProxyOptions {
  uint32_t fifo_entries = 4096;  ///< Ring size per thread (power of two).
  int max_batch = 256;           ///< Commands popped per sweep.
  /// Idle sweeps before a thread starts sleeping between polls. Busy polling is fastest on a dedicated core;
  /// sleeping keeps oversubscribed hosts (CI: 4 ranks on 2 cores) responsive.
  int spin_before_sleep = 2000;
  int idle_sleep_us = 20;
  /// A thread that stays inside one transport call this long is wedged: libfabric's shm provider spins forever on
  /// a lock in the shared memory of a peer that died holding it. The watchdog then fails the proxy (producers and
  /// receivers get an error naming the peer) and Stop() abandons the thread instead of joining it. A healthy call
  /// returns in microseconds.
  absl::Duration stall_timeout = absl::Seconds(2);
  /// Rank masking (DeepEP's shrink mode): a thread's failure (a transport error, or the wedge above) is confined to
  /// that thread instead of aborting the proxy. The thread stops using its transport, drops what producers push to
  /// it, and PeerFailed() reports the peers it serves, which the owner then masks. Needs one thread per peer
  /// (num_threads >= num_ranks, so ThreadFor gives every peer its own thread): a dead peer then takes down only the
  /// thread that talked to it.
  bool isolate_peer_failures = false;
};

/// Ring memory owned outside the proxy, for producers that cannot write the proxy's heap: a GPU pushes into pinned
/// host memory mapped into it, with its head in device memory (runtime/cuda_fifo_ring.h).
struct ExternalRing {
  protocol::FifoRingHandle producer;  ///< what ring(i) hands to producers (device pointers)
  protocol::FifoRingHandle consumer;  ///< the same ring as this CPU sees it (ring, tail and size are used)
  int32_t* abort_word = nullptr;      ///< the producers' abort flag (CPU view); Abort() raises it
};

struct ProxyStats {
  uint64_t commands = 0;
  uint64_t writes_posted = 0;
  uint64_t bytes_posted = 0;
  uint64_t immediates = 0;
};

class Proxy;
/// Deletes a proxy whose threads all stopped; leaks one whose thread is wedged inside its transport (that thread may
/// still touch the proxy, its transports and the region they write from). See Proxy::Stop.
struct ProxyDeleter {
  void operator()(Proxy* p) const;
};
using ProxyPtr = std::unique_ptr<Proxy, ProxyDeleter>;

class Proxy {
 public:
  /// `transports[i]` must be registered on `region` and connected. Starts the threads. Thread i drains its own ring
  /// (options.fifo_entries commands in this process's heap) unless `rings` is given: then rings[i], one per transport.
  static absl::StatusOr<ProxyPtr> Create(const protocol::LlLayout& layout, int rank, uint8_t* region,
                                         std::vector<std::unique_ptr<Transport>> transports,
                                         const ProxyOptions& options, std::vector<ExternalRing> rings = {});
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  static int ThreadFor(int rank, int peer, int num_threads) { return (rank + peer) % num_threads; }
  int num_threads() const { return static_cast<int>(threads_.size()); }
  /// The producer handle of thread i's ring.
  const protocol::FifoRingHandle& ring(int i) const;
  /// First error any thread hit (OK while healthy). After an error the abort flag is raised.
  absl::Status status() const;
  const volatile int32_t* abort_flag() const { return &abort_flag_; }
  /// True once any thread failed (one acquire load; Abort() records the status before raising the flag).
  bool failed() const { return __atomic_load_n(&abort_flag_, __ATOMIC_ACQUIRE) != 0; }
  /// Raises the abort flag and records `why` (first error wins). Threads keep draining completions.
  void Abort(const absl::Status& why);
  /// options.isolate_peer_failures: whether the thread serving `peer` failed (one relaxed load; false otherwise).
  bool PeerFailed(int peer) const;
  /// The error that took down the thread serving `peer` (OK while it is healthy).
  absl::Status PeerStatus(int peer) const;
  ProxyStats stats() const;
  /// Stops the threads, waiting at most options.stall_timeout for each to leave the transport call it is in. Returns
  /// false if one is wedged there: it is detached, and the proxy, its transports and the memory they read and write
  /// (region, rings) must never be freed; the owner leaks them (ProxyDeleter does so for the proxy). Idempotent.
  bool Stop();

 private:
  friend struct ProxyDeleter;
  struct Thread;
  Proxy(const protocol::LlLayout& layout, int rank, uint8_t* region, const ProxyOptions& options);
  ~Proxy();
  void Run(Thread* t);
  void Watch();
  absl::Status Sweep(Thread* t, bool* did_work);
  absl::Status PostBatch(Thread* t, int n);
  absl::Status Post(Thread* t, int dst, uint64_t local_off, uint64_t remote_off, uint64_t bytes, uint32_t imm,
                    uint64_t cookie);
  absl::Status PostAtomic(Thread* t, int dst, uint64_t remote_off, uint64_t add);
  /// Calls `post` until the transport accepts it, progressing completions while its send queue is full (defined and
  /// instantiated in proxy.cc; a template, so the per-write path allocates nothing).
  template <typename PostFn>
  absl::Status PostUntilAccepted(Thread* t, uint64_t bytes, const PostFn& post);
  absl::Status Progress(Thread* t, bool* did_work);
  /// A thread's failure: aborts the proxy, or (isolate_peer_failures) retires that thread alone.
  void Fail(Thread* t, const absl::Status& why);

  protocol::LlLayout layout_;
  int rank_;
  uint8_t* region_;
  ProxyOptions options_;
  std::vector<std::unique_ptr<Thread>> threads_;
  std::atomic<bool> stop_{false};
  absl::Notification stop_watch_;
  std::thread watchdog_;
  int stopped_ = -1;  // Stop()'s result once called: 1 all joined, 0 one abandoned
  std::vector<int32_t*> external_abort_words_;
  alignas(64) volatile int32_t abort_flag_ = 0;
  mutable absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace llep::proxy
