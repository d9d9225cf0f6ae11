#include "proxy/proxy.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proxy/arrival_counter.h"
#include "proxy/batch.h"
#include "proxy/fifo_consumer.h"
#include "runtime/base/log.h"
#include "runtime/protocol/imm.h"
#include "runtime/protocol/signal.h"

namespace llep::proxy {

using protocol::FifoCmd;
using protocol::FifoCmdFields;
using protocol::FifoOpcode;
using protocol::LlOp;

namespace {
// Cookies: 0 for data writes, kOutboxCookie + slot index for signal writes (their outbox slot is busy until the
// write completes and must not be restaged before).
constexpr uint64_t kDataCookie = 0;
constexpr uint64_t kOutboxCookie = 1;

size_t KeyIndex(LlOp op, int half, int peer, int num_ranks) {
  return (static_cast<size_t>(op) * protocol::kNumHalves + half) * num_ranks + peer;
}
}  // namespace

struct Proxy::Thread {
  std::unique_ptr<Transport> transport;
  std::unique_ptr<ArrivalCounter> counter;
  // Ring memory: the ring itself plus head/tail/tail_cache on separate cache lines (no false sharing between
  // producers' claims and the consumer's tail updates).
  std::unique_ptr<FifoCmd[]> ring;
  alignas(64) uint64_t head = 0;
  alignas(64) uint64_t tail = 0;
  alignas(64) uint64_t tail_cache = 0;
  protocol::FifoRingHandle handle{};
  std::unique_ptr<FifoConsumer> consumer;
  std::vector<FifoCmd> batch;
  std::vector<FifoCmdFields> fields;
  std::vector<uint32_t> writes_since_signal;  // [op][half][dst]
  std::vector<uint8_t> outbox_busy;           // [op][half][dst]
  bool ordered_atomics = false;               // transport->OrderedAtomics(), asked once
  std::vector<uint64_t> last_signal;          // [op][half][dst]: the word the peer holds (ordered-atomic signals)
  std::vector<Completion> completions;
  std::thread thread;
  std::atomic<uint64_t> commands{0}, writes_posted{0}, bytes_posted{0}, immediates{0};
  // Liveness for the watchdog: beats advance on every loop turn and every retry; a thread whose beats stand still
  // for stall_timeout is stuck inside one transport call. `peer` is the destination of the last post (for the
  // message), `exited` is set as Run returns.
  std::atomic<uint64_t> beats{0};
  std::atomic<int> peer{-1};
  std::atomic<bool> wedged{false}, exited{false};
  // isolate_peer_failures: set once the thread failed; it then only drops what producers push (error under mu_).
  std::atomic<bool> failed{false};
  absl::Status error;
  void Beat() { beats.store(beats.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed); }
};

Proxy::Proxy(const protocol::LlLayout& layout, int rank, uint8_t* region, const ProxyOptions& options)
    : layout_(layout), rank_(rank), region_(region), options_(options) {}

absl::StatusOr<ProxyPtr> Proxy::Create(const protocol::LlLayout& layout, int rank, uint8_t* region,
                                       std::vector<std::unique_ptr<Transport>> transports, const ProxyOptions& options,
                                       std::vector<ExternalRing> rings) {
  if (transports.empty()) return absl::InvalidArgumentError("a proxy needs at least one transport");
  if (!rings.empty() && rings.size() != transports.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(rings.size(), " external rings for ", transports.size(), " transports: give one per thread"));
  }
  for (const ExternalRing& r : rings) {
    if (r.consumer.ring == nullptr || r.consumer.tail == nullptr || r.consumer.size < 2 ||
        (r.consumer.size & (r.consumer.size - 1)) != 0 || r.producer.size != r.consumer.size ||
        r.abort_word == nullptr) {
      return absl::InvalidArgumentError("an external ring needs ring, tail, abort word and a power-of-two size");
    }
  }
  if (options.fifo_entries < 2 || (options.fifo_entries & (options.fifo_entries - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("fifo_entries must be a power of two >= 2, got ", options.fifo_entries));
  }
  if (options.stall_timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("stall_timeout must be > 0");
  if (options.isolate_peer_failures && static_cast<int>(transports.size()) < layout.shape.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("isolating peer failures needs a thread per peer: ", transports.size(), " threads for ",
                     layout.shape.num_ranks, " ranks"));
  }
  ProxyPtr p(new Proxy(layout, rank, region, options));
  const size_t keys = static_cast<size_t>(protocol::kNumLlOps) * protocol::kNumHalves * layout.shape.num_ranks;
  for (size_t i = 0; i < transports.size(); ++i) {
    auto t = std::make_unique<Thread>();
    t->transport = std::move(transports[i]);
    t->ordered_atomics = t->transport->OrderedAtomics();
    t->counter = std::make_unique<ArrivalCounter>(layout, region);
    if (rings.empty()) {
      t->ring.reset(new FifoCmd[options.fifo_entries]());
      t->handle = protocol::FifoRingHandle{t->ring.get(),  &t->head,        &t->tail,
                                           &t->tail_cache, &p->abort_flag_, options.fifo_entries};
      t->consumer = std::make_unique<FifoConsumer>(t->handle);
    } else {
      t->handle = rings[i].producer;
      t->consumer = std::make_unique<FifoConsumer>(rings[i].consumer);
      p->external_abort_words_.push_back(rings[i].abort_word);
    }
    t->batch.resize(options.max_batch);
    t->fields.resize(options.max_batch);
    t->writes_since_signal.assign(keys, 0);
    t->outbox_busy.assign(keys, 0);
    t->last_signal.assign(keys, 0);
    t->completions.resize(64);
    p->threads_.push_back(std::move(t));
  }
  for (auto& t : p->threads_) {
    Thread* raw = t.get();
    t->thread = std::thread([p = p.get(), raw] { p->Run(raw); });
  }
  p->watchdog_ = std::thread([p = p.get()] { p->Watch(); });
  return p;
}

void ProxyDeleter::operator()(Proxy* p) const {
  if (p->Stop()) {
    delete p;
  } else {
    LLEP_LOG(kError) << "proxy: a thread is wedged inside its transport; the proxy and its transports are leaked "
                        "so that the thread never touches freed memory";
  }
}

Proxy::~Proxy() { Stop(); }

bool Proxy::Stop() {
  if (stopped_ >= 0) return stopped_ == 1;
  stop_.store(true, std::memory_order_release);
  stop_watch_.Notify();
  if (watchdog_.joinable()) watchdog_.join();
  // A healthy thread sees stop_ within one loop turn; give each the stall timeout at most, none if the watchdog
  // already found it wedged.
  const absl::Time deadline = absl::Now() + options_.stall_timeout;
  bool all = true;
  for (size_t i = 0; i < threads_.size(); ++i) {
    Thread& t = *threads_[i];
    while (!t.exited.load(std::memory_order_acquire) && !t.wedged.load(std::memory_order_relaxed) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(200));
    }
    if (t.exited.load(std::memory_order_acquire)) {
      if (t.thread.joinable()) t.thread.join();
      continue;
    }
    LLEP_LOG(kError) << "proxy thread " << i << " (" << t.transport->Name()
                     << ") is stuck inside a transport call (last destination rank "
                     << t.peer.load(std::memory_order_relaxed) << "); abandoning it";
    if (t.thread.joinable()) t.thread.detach();
    all = false;
  }
  stopped_ = all ? 1 : 0;
  return all;
}

void Proxy::Watch() {
  const absl::Duration period = std::min(options_.stall_timeout / 4, absl::Milliseconds(100));
  struct Seen {
    uint64_t beats;
    absl::Time since;
  };
  std::vector<Seen> seen(threads_.size(), Seen{~uint64_t{0}, absl::Now()});
  while (!stop_watch_.WaitForNotificationWithTimeout(period)) {
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < threads_.size(); ++i) {
      Thread& t = *threads_[i];
      const uint64_t beats = t.beats.load(std::memory_order_relaxed);
      if (beats != seen[i].beats) {
        seen[i] = {beats, now};
        continue;
      }
      if (now - seen[i].since < options_.stall_timeout || t.wedged.load(std::memory_order_relaxed)) continue;
      t.wedged.store(true, std::memory_order_relaxed);
      Fail(&t,
           absl::DeadlineExceededError(absl::StrCat(
               "proxy thread ", i, " (", t.transport->Name(), ") has been inside one transport call for ",
               absl::FormatDuration(now - seen[i].since), " (last destination rank ",
               t.peer.load(std::memory_order_relaxed),
               "): the transport is wedged, typically by a peer process that died inside it (libfabric's shm provider "
               "spins on a lock in the dead peer's shared memory)")));
    }
  }
}

const protocol::FifoRingHandle& Proxy::ring(int i) const { return threads_[i]->handle; }

absl::Status Proxy::status() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
}

void Proxy::Fail(Thread* t, const absl::Status& why) {
  if (!options_.isolate_peer_failures) {
    Abort(why);
    return;
  }
  if (t->failed.load(std::memory_order_relaxed)) return;
  {
    absl::MutexLock lock(&mu_);
    t->error = why;
  }
  t->failed.store(true, std::memory_order_release);
  LLEP_LOG(kWarning) << "proxy: " << why.message() << "; its peer is left to the owner to mask";
}

bool Proxy::PeerFailed(int peer) const {
  return options_.isolate_peer_failures &&
         threads_[ThreadFor(rank_, peer, num_threads())]->failed.load(std::memory_order_acquire);
}

absl::Status Proxy::PeerStatus(int peer) const {
  if (!PeerFailed(peer)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return threads_[ThreadFor(rank_, peer, num_threads())]->error;
}

void Proxy::Abort(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (first_error_.ok()) first_error_ = why;
  }
  __atomic_store_n(&abort_flag_, 1, __ATOMIC_RELEASE);
  for (int32_t* w : external_abort_words_) __atomic_store_n(w, 1, __ATOMIC_RELEASE);
}

ProxyStats Proxy::stats() const {
  ProxyStats s;
  for (const auto& t : threads_) {
    s.commands += t->commands.load(std::memory_order_relaxed);
    s.writes_posted += t->writes_posted.load(std::memory_order_relaxed);
    s.bytes_posted += t->bytes_posted.load(std::memory_order_relaxed);
    s.immediates += t->immediates.load(std::memory_order_relaxed);
  }
  return s;
}

void Proxy::Run(Thread* t) {
  int idle = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    t->Beat();
    bool did_work = false;
    if (t->failed.load(std::memory_order_relaxed)) {
      // Retired (isolate_peer_failures): its transport is not touched again; what producers still push is dropped
      // so they never block on a full ring.
      did_work = t->consumer->Poll(t->batch.data(), static_cast<int>(t->batch.size())) > 0;
    } else if (absl::Status s = Sweep(t, &did_work); !s.ok()) {
      // Never exit the loop on error: record it, wake producers and receivers, keep draining completions so
      // peers that still progress through us (manual-progress providers) are not stalled.
      Fail(t, absl::Status(s.code(), absl::StrCat("proxy thread (", t->transport->Name(), ", last destination rank ",
                                                  t->peer.load(std::memory_order_relaxed), "): ", s.message())));
    }
    if (did_work) {
      idle = 0;
    } else if (++idle > options_.spin_before_sleep) {
      std::this_thread::sleep_for(std::chrono::microseconds(options_.idle_sleep_us));
    } else if (idle % 64 == 0) {
      std::this_thread::yield();
    }
  }
  t->exited.store(true, std::memory_order_release);
}

absl::Status Proxy::Sweep(Thread* t, bool* did_work) {
  if (__atomic_load_n(&abort_flag_, __ATOMIC_ACQUIRE) == 0) {
    const int n = t->consumer->Poll(t->batch.data(), static_cast<int>(t->batch.size()));
    if (n > 0) {
      *did_work = true;
      t->commands.fetch_add(n, std::memory_order_relaxed);
      auto s = PostBatch(t, n);
      if (!s.ok()) return s;
    }
  }
  return Progress(t, did_work);
}

absl::Status Proxy::PostBatch(Thread* t, int n) {
  for (int i = 0; i < n; ++i) {
    if (!protocol::DecodeCmd(t->batch[i], &t->fields[i])) {
      return absl::DataLossError(absl::StrCat("malformed FIFO command w1=0x", absl::Hex(t->batch[i].w1)));
    }
    const int dst = t->fields[i].dst_rank;
    if (dst >= layout_.shape.num_ranks || dst == rank_) {
      return absl::InvalidArgumentError(absl::StrCat("FIFO command for rank ", dst, " (self ", rank_, ")"));
    }
  }
  n = GroupAndMerge(t->fields.data(), n);
  const uint64_t region_bytes = static_cast<uint64_t>(layout_.total_bytes);
  for (int i = 0; i < n;) {
    const FifoCmdFields f = t->fields[i++];
    const size_t key = KeyIndex(f.op, f.half, f.dst_rank, layout_.shape.num_ranks);
    if (f.opcode == FifoOpcode::kWrite) {
      if (f.local_off + f.bytes > region_bytes || f.remote_off + f.bytes > region_bytes) {
        return absl::OutOfRangeError(absl::StrCat("write of ", f.bytes, " bytes at local ", f.local_off, " / remote ",
                                                  f.remote_off, " leaves the ", region_bytes, "-byte region"));
      }
      if (f.bytes == 0) return absl::DataLossError("FIFO write command of zero bytes");
      // Every posted piece carries a data immediate and is counted, so splitting is invisible to the receiver. With
      // ordered atomics the signal itself follows the data in order: plain writes, nothing to count.
      const uint32_t imm = t->ordered_atomics ? 0u : protocol::PackImm(protocol::ImmKind::kData, f.op, f.half, rank_);
      const uint64_t max = t->transport->MaxWriteBytes();
      for (uint64_t done = 0; done < f.bytes;) {
        const uint64_t chunk = std::min(max, f.bytes - done);
        auto s = Post(t, f.dst_rank, f.local_off + done, f.remote_off + done, chunk, imm, kDataCookie);
        if (!s.ok()) return s;
        ++t->writes_since_signal[key];
        done += chunk;
      }
      continue;
    }
    if (t->ordered_atomics) {
      // The peer's signal word for (op, half, this rank) is written only by these adds and starts at zero, so adding
      // the difference to the word it holds leaves exactly the new word (modulo 2^64), after all data before it.
      const uint64_t add = f.signal_word - t->last_signal[key];
      t->last_signal[key] = f.signal_word;
      auto s = PostAtomic(t, f.dst_rank, static_cast<uint64_t>(layout_.SignalOffset(f.half, f.op, rank_)), add);
      if (!s.ok()) return s;
      t->writes_since_signal[key] = 0;
      continue;
    }
    // kSignal: the outbox slot for (op, half, dst) is reused every other call; wait for its previous write.
    while (t->outbox_busy[key] != 0) {
      t->Beat();
      bool ignored = false;
      auto s = Progress(t, &ignored);
      if (!s.ok()) return s;
      if (stop_.load(std::memory_order_acquire)) return absl::AbortedError("proxy stopping");
    }
    const int64_t outbox = layout_.OutboxOffset(f.half, f.op, f.dst_rank);
    protocol::InboxSlot slot{f.signal_word, t->writes_since_signal[key], protocol::kSignalVersion};
    std::memcpy(region_ + outbox, &slot, sizeof(slot));
    t->writes_since_signal[key] = 0;
    t->outbox_busy[key] = 1;
    auto s = Post(t, f.dst_rank, static_cast<uint64_t>(outbox),
                  static_cast<uint64_t>(layout_.InboxOffset(f.half, f.op, rank_)), sizeof(slot),
                  protocol::PackImm(protocol::ImmKind::kSignal, f.op, f.half, rank_), kOutboxCookie + key);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

template <typename PostFn>
absl::Status Proxy::PostUntilAccepted(Thread* t, uint64_t bytes, const PostFn& post) {
  for (;;) {
    t->Beat();
    auto posted = post();
    if (!posted.ok()) return posted.status();
    if (*posted) break;
    // Send queue full: completions free it. Keep counting receives meanwhile (manual progress).
    bool ignored = false;
    auto s = Progress(t, &ignored);
    if (!s.ok()) return s;
    if (stop_.load(std::memory_order_acquire)) return absl::AbortedError("proxy stopping");
  }
  t->writes_posted.fetch_add(1, std::memory_order_relaxed);
  t->bytes_posted.fetch_add(bytes, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status Proxy::Post(Thread* t, int dst, uint64_t local_off, uint64_t remote_off, uint64_t bytes, uint32_t imm,
                         uint64_t cookie) {
  t->peer.store(dst, std::memory_order_relaxed);
  return PostUntilAccepted(t, bytes,
                           [&] { return t->transport->PostWrite(dst, local_off, remote_off, bytes, imm, cookie); });
}

absl::Status Proxy::PostAtomic(Thread* t, int dst, uint64_t remote_off, uint64_t add) {
  t->peer.store(dst, std::memory_order_relaxed);
  return PostUntilAccepted(t, 0, [&] { return t->transport->PostAtomicAdd(dst, remote_off, add, kDataCookie); });
}

absl::Status Proxy::Progress(Thread* t, bool* did_work) {
  auto n = t->transport->Poll(t->completions.data(), static_cast<int>(t->completions.size()));
  if (!n.ok()) return n.status();
  if (*n > 0) *did_work = true;
  for (int i = 0; i < *n; ++i) {
    const Completion& c = t->completions[i];
    if (c.kind == Completion::Kind::kRemoteImm) {
      t->immediates.fetch_add(1, std::memory_order_relaxed);
      auto s = t->counter->OnImmediate(c.imm);
      if (!s.ok()) return s;
    } else if (c.cookie >= kOutboxCookie) {
      t->outbox_busy[c.cookie - kOutboxCookie] = 0;
    }
  }
  return absl::OkStatus();
}

}  // namespace llep::proxy
