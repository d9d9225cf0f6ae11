// Proxy threads over an in-process fake network that delivers each receiver's writes in random order (as EFA
// may): signals must still appear only after their data, batches merge and split as specified, and transport
// failures surface as a Status plus the abort flag rather than a hang. An ordered variant with remote atomics models
// RC QPs: signals become atomic adds on the peer's signal word and nothing is counted at the receiver.
#include "proxy/proxy.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "proxy/batch.h"
#include "proxy/fifo_consumer.h"
#include "runtime/protocol/signal.h"

namespace llep::proxy {
namespace {

using protocol::FifoCmd;
using protocol::FifoCmdFields;
using protocol::FifoOpcode;
using protocol::LlOp;

class FakeNetwork {
 public:
  struct Delivery {
    uint64_t remote_off;
    std::string bytes;
    uint32_t imm;
    bool atomic_add = false;  // bytes hold the 8-byte addend
  };
  explicit FakeNetwork(int ranks, bool ordered = false)
      : regions_(ranks), inflight_(ranks), done_(ranks), rng_(5), ordered_(ordered) {}
  void Attach(int rank, uint8_t* region) { regions_[rank] = region; }
  void Send(int src, int dst, const uint8_t* data, uint64_t bytes, uint64_t remote_off, uint32_t imm, uint64_t cookie) {
    std::lock_guard<std::mutex> lock(mu_);
    inflight_[dst].push_back({remote_off, std::string(reinterpret_cast<const char*>(data), bytes), imm});
    done_[src].push_back(cookie);
  }
  void Atomic(int src, int dst, uint64_t remote_off, uint64_t add, uint64_t cookie) {
    std::lock_guard<std::mutex> lock(mu_);
    inflight_[dst].push_back({remote_off, std::string(reinterpret_cast<const char*>(&add), 8), 0, true});
    done_[src].push_back(cookie);
  }
  // Lands one in-flight operation (data, then its completion if it carries an immediate): a random one, like an
  // unordered NIC, or the oldest when ordered (RC). Returns false when nothing is in flight.
  bool Deliver(int dst, Completion* c, bool* completion) {
    std::lock_guard<std::mutex> lock(mu_);
    if (inflight_[dst].empty()) return false;
    const size_t i = ordered_ ? 0 : rng_() % inflight_[dst].size();
    Delivery d = std::move(inflight_[dst][i]);
    inflight_[dst].erase(inflight_[dst].begin() + static_cast<long>(i));
    if (d.atomic_add) {
      uint64_t add = 0;
      std::memcpy(&add, d.bytes.data(), 8);
      __atomic_fetch_add(reinterpret_cast<uint64_t*>(regions_[dst] + d.remote_off), add, __ATOMIC_RELEASE);
    } else {
      std::memcpy(regions_[dst] + d.remote_off, d.bytes.data(), d.bytes.size());
    }
    *completion = d.imm != 0;
    *c = Completion{Completion::Kind::kRemoteImm, 0, d.imm};
    return true;
  }
  bool TakeDone(int src, Completion* c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_[src].empty()) return false;
    *c = Completion{Completion::Kind::kWriteDone, done_[src].front(), 0};
    done_[src].pop_front();
    return true;
  }

 private:
  std::mutex mu_;
  std::vector<uint8_t*> regions_;
  std::vector<std::vector<Delivery>> inflight_;
  std::vector<std::deque<uint64_t>> done_;
  std::mt19937 rng_;
  bool ordered_;
};

class FakeTransport final : public Transport {
 public:
  FakeTransport(FakeNetwork* net, int rank, uint64_t max_write) : net_(net), rank_(rank), max_write_(max_write) {}
  std::string Name() const override { return "fake"; }
  absl::Status RegisterRegion(void* base, uint64_t) override {
    base_ = static_cast<uint8_t*>(base);
    net_->Attach(rank_, base_);
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> LocalBlob() const override { return std::string("fake"); }
  absl::Status Connect(const std::vector<std::string>&) override { return absl::OkStatus(); }
  uint64_t MaxWriteBytes() const override { return max_write_; }
  absl::StatusOr<bool> PostWrite(int peer, uint64_t local_off, uint64_t remote_off, uint64_t bytes, uint32_t imm,
                                 uint64_t cookie) override {
    if (fail_posts) return absl::UnavailableError("link down");
    EXPECT_LE(bytes, max_write_);
    net_->Send(rank_, peer, base_ + local_off, bytes, remote_off, imm, cookie);
    return true;
  }
  absl::StatusOr<int> Poll(Completion* out, int max) override {
    int n = 0;
    while (n < max) {
      if (net_->TakeDone(rank_, &out[n])) {
        ++n;
        continue;
      }
      bool completion = false;
      if (!net_->Deliver(rank_, &out[n], &completion)) break;
      if (completion) ++n;
    }
    return n;
  }
  bool OrderedAtomics() const override { return atomics; }
  absl::StatusOr<bool> PostAtomicAdd(int peer, uint64_t remote_off, uint64_t add, uint64_t cookie) override {
    EXPECT_TRUE(atomics);
    EXPECT_EQ(remote_off % 8, 0u);
    net_->Atomic(rank_, peer, remote_off, add, cookie);
    return true;
  }
  std::atomic<bool> fail_posts{false};
  bool atomics = false;  // set before the proxy starts

 private:
  FakeNetwork* net_;
  int rank_;
  uint64_t max_write_;
  uint8_t* base_ = nullptr;
};

struct Pair {
  explicit Pair(uint64_t max_write, bool rc = false)
      : layout(protocol::ComputeLlLayout({8, 512, 4, 2})), net(2, /*ordered=*/rc) {
    for (int r = 0; r < 2; ++r) {
      regions[r].reset(new uint8_t[layout.total_bytes]());
      auto t = std::make_unique<FakeTransport>(&net, r, max_write);
      t->atomics = rc;
      transports[r] = t.get();
      EXPECT_TRUE(t->RegisterRegion(regions[r].get(), layout.total_bytes).ok());
      std::vector<std::unique_ptr<Transport>> ts;
      ts.push_back(std::move(t));
      auto p = Proxy::Create(layout, r, regions[r].get(), std::move(ts), ProxyOptions{});
      EXPECT_TRUE(p.ok()) << p.status();
      proxies[r] = *std::move(p);
    }
  }
  uint64_t WaitSignal(int rank, LlOp op, int half, int src, uint32_t seq) {
    const auto* p = reinterpret_cast<const uint64_t*>(regions[rank].get() + layout.SignalOffset(half, op, src));
    for (int i = 0; i < 2000000; ++i) {
      const uint64_t w = __atomic_load_n(p, __ATOMIC_ACQUIRE);
      if (protocol::SignalSeq(w) == seq) return w;
      std::this_thread::yield();
    }
    return 0;
  }
  protocol::LlLayout layout;
  FakeNetwork net;
  std::unique_ptr<uint8_t[]> regions[2];
  FakeTransport* transports[2];
  ProxyPtr proxies[2];
};

TEST(ProxyTest, SignalsAppearOnlyAfterTheirDataUnderReordering) {
  Pair p(/*max_write=*/1000);  // also splits the 4 KiB writes into 5 pieces each
  const int64_t chunk = 4096;
  for (uint32_t seq = 1; seq <= 200; ++seq) {
    const int half = protocol::HalfOfSeq(seq);
    const int64_t base = p.layout.DispatchRecvOffset(half, 0, 0, false);
    // Rank 0 writes 3 chunks of a recognisable pattern into rank 1's receive area, then signals.
    for (int c = 0; c < 3; ++c) {
      std::memset(p.regions[0].get() + base + c * chunk, static_cast<int>((seq + c) & 0xFF), chunk);
      ASSERT_TRUE(protocol::FifoPush(
          p.proxies[0]->ring(0),
          protocol::MakeWriteCmd(LlOp::kDispatch, half, 1, base + c * chunk, base + c * chunk, chunk)));
    }
    ASSERT_TRUE(protocol::FifoPush(p.proxies[0]->ring(0),
                                   protocol::MakeSignalCmd(LlOp::kDispatch, half, 1, protocol::PackSignal(seq, 42))));
    const uint64_t w = p.WaitSignal(1, LlOp::kDispatch, half, 0, seq);
    ASSERT_EQ(w, protocol::PackSignal(seq, 42)) << "seq " << seq;
    for (int c = 0; c < 3; ++c) {
      for (int64_t i = 0; i < chunk; i += 511) {
        ASSERT_EQ(p.regions[1][base + c * chunk + i], static_cast<uint8_t>((seq + c) & 0xFF)) << "seq " << seq;
      }
    }
  }
  EXPECT_TRUE(p.proxies[0]->status().ok());
  EXPECT_TRUE(p.proxies[1]->status().ok());
  EXPECT_GE(p.proxies[1]->stats().immediates, 200u * 4);
}

TEST(ProxyTest, OrderedAtomicTransportsSignalWithAnAddAfterTheData) {
  Pair p(/*max_write=*/1000, /*rc=*/true);
  const int64_t chunk = 4096;
  for (uint32_t seq = 1; seq <= 200; ++seq) {
    const int half = protocol::HalfOfSeq(seq);
    const LlOp op = seq % 3 == 0 ? LlOp::kCombine : LlOp::kDispatch;
    const int64_t base = p.layout.DispatchRecvOffset(half, 0, 0, false);
    for (int c = 0; c < 2; ++c) {
      std::memset(p.regions[0].get() + base + c * chunk, static_cast<int>((seq * 7 + c) & 0xFF), chunk);
      ASSERT_TRUE(protocol::FifoPush(p.proxies[0]->ring(0),
                                     protocol::MakeWriteCmd(op, half, 1, base + c * chunk, base + c * chunk, chunk)));
    }
    // Values that shrink as well as grow: the add must wrap modulo 2^64 to land exactly on the new word.
    const uint32_t value = (seq * 2654435761u) % 1000;
    ASSERT_TRUE(protocol::FifoPush(p.proxies[0]->ring(0),
                                   protocol::MakeSignalCmd(op, half, 1, protocol::PackSignal(seq, value))));
    const uint64_t w = p.WaitSignal(1, op, half, 0, seq);
    ASSERT_EQ(w, protocol::PackSignal(seq, value)) << "seq " << seq;
    for (int c = 0; c < 2; ++c) {
      ASSERT_EQ(p.regions[1][base + c * chunk + chunk - 1], static_cast<uint8_t>((seq * 7 + c) & 0xFF)) << seq;
    }
  }
  EXPECT_TRUE(p.proxies[0]->status().ok()) << p.proxies[0]->status();
  EXPECT_TRUE(p.proxies[1]->status().ok()) << p.proxies[1]->status();
  EXPECT_EQ(p.proxies[1]->stats().immediates, 0u);  // nothing for the receiving CPU to count
}

TEST(ProxyTest, TransportFailureRaisesAbortAndStatus) {
  Pair p(1 << 20);
  p.transports[0]->fail_posts = true;
  ASSERT_TRUE(protocol::FifoPush(p.proxies[0]->ring(0), protocol::MakeWriteCmd(LlOp::kCombine, 0, 1, 0, 0, 64)));
  for (int i = 0; i < 100000 && *p.proxies[0]->abort_flag() == 0; ++i) std::this_thread::yield();
  EXPECT_NE(*p.proxies[0]->abort_flag(), 0);
  EXPECT_EQ(p.proxies[0]->status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(p.proxies[0]->status().message()).find("link down"), std::string::npos);
}

TEST(ProxyTest, RejectsCommandsForItself) {
  Pair p(1 << 20);
  ASSERT_TRUE(protocol::FifoPush(p.proxies[0]->ring(0), protocol::MakeWriteCmd(LlOp::kCombine, 0, 0, 0, 0, 64)));
  for (int i = 0; i < 100000 && p.proxies[0]->status().ok(); ++i) std::this_thread::yield();
  EXPECT_EQ(p.proxies[0]->status().code(), absl::StatusCode::kInvalidArgument);
}

FifoCmdFields Write(int dst, uint64_t lo, uint64_t ro, uint64_t bytes, int half = 0) {
  FifoCmdFields f{};
  EXPECT_TRUE(protocol::DecodeCmd(protocol::MakeWriteCmd(LlOp::kDispatch, half, dst, lo, ro, bytes), &f));
  return f;
}
FifoCmdFields Signal(int dst) {
  FifoCmdFields f{};
  EXPECT_TRUE(protocol::DecodeCmd(protocol::MakeSignalCmd(LlOp::kDispatch, 0, dst, 1), &f));
  return f;
}

TEST(BatchTest, GroupsByDestinationAndMergesContiguousWrites) {
  std::vector<FifoCmdFields> c = {
      Write(2, 0, 1024, 16),   Write(1, 0, 0, 32), Write(2, 16, 1040, 16), Write(1, 32, 32, 32),
      Write(1, 96, 64, 32),    Signal(2),          Write(2, 32, 1056, 16), Signal(1),
      Write(1, 128, 96, 32, 1)};
  const int n = GroupAndMerge(c.data(), static_cast<int>(c.size()));
  ASSERT_EQ(n, 7);
  // rank 1: [0,64) merged; [96) not contiguous locally; signal; the half-1 write stays separate.
  EXPECT_EQ(c[0].dst_rank, 1);
  EXPECT_EQ(c[0].bytes, 64u);
  EXPECT_EQ(c[1].local_off, 96u);
  EXPECT_EQ(c[2].opcode, FifoOpcode::kSignal);
  EXPECT_EQ(c[3].half, 1);
  // rank 2: two merged writes, then its signal, then a write after the signal (never merged across it).
  EXPECT_EQ(c[4].dst_rank, 2);
  EXPECT_EQ(c[4].bytes, 32u);
  EXPECT_EQ(c[5].opcode, FifoOpcode::kSignal);
  EXPECT_EQ(c[6].remote_off, 1056u);
}

// ---------------------------------------------------------------------------------------------- ring

struct Ring {
  explicit Ring(uint32_t size) : cmds(size) { handle = {cmds.data(), &head, &tail, &tail_cache, &abort_flag, size}; }
  std::vector<FifoCmd> cmds;
  uint64_t head = 0, tail = 0, tail_cache = 0;
  volatile int32_t abort_flag = 0;
  protocol::FifoRingHandle handle{};
};

TEST(FifoRingTest, SingleProducerManyLapsInOrder) {
  Ring r(8);
  FifoConsumer consumer(r.handle);
  FifoCmd out[8];
  uint64_t next = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    ASSERT_TRUE(protocol::FifoPush(r.handle, protocol::MakeSignalCmd(LlOp::kDispatch, 0, 1, i)));
    if (i % 3 == 2) {
      const int n = consumer.Poll(out, 8);
      for (int j = 0; j < n; ++j) ASSERT_EQ(out[j].w0, next++);
    }
  }
  while (next < 1000) {
    const int n = consumer.Poll(out, 8);
    for (int j = 0; j < n; ++j) ASSERT_EQ(out[j].w0, next++);
  }
  EXPECT_EQ(consumer.Poll(out, 8), 0);
}

TEST(FifoRingTest, ManyProducersLoseNothing) {
  Ring r(64);
  constexpr int kProducers = 4, kPerProducer = 10000;
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (uint64_t i = 0; i < kPerProducer; ++i) {
        ASSERT_TRUE(protocol::FifoPush(
            r.handle,
            protocol::MakeSignalCmd(LlOp::kDispatch, 0, p, protocol::JoinHalves(p, static_cast<uint32_t>(i)))));
      }
    });
  }
  FifoConsumer consumer(r.handle);
  std::vector<uint64_t> next(kProducers, 0);
  FifoCmd out[64];
  int total = 0;
  while (total < kProducers * kPerProducer) {
    const int n = consumer.Poll(out, 64);
    for (int j = 0; j < n; ++j) {
      const int p = static_cast<int>(protocol::HighHalf(out[j].w0));
      ASSERT_EQ(out[j].w0 & 0xFFFFFFFF, next[p]++);  // per-producer order is kept
    }
    total += n;
  }
  for (auto& t : producers) t.join();
}

TEST(FifoRingTest, FullRingPushReturnsOnAbort) {
  Ring r(2);
  ASSERT_TRUE(protocol::FifoPush(r.handle, protocol::MakeSignalCmd(LlOp::kDispatch, 0, 1, 1)));
  ASSERT_TRUE(protocol::FifoPush(r.handle, protocol::MakeSignalCmd(LlOp::kDispatch, 0, 1, 2)));
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    __atomic_store_n(&r.abort_flag, 1, __ATOMIC_RELEASE);
  });
  EXPECT_FALSE(protocol::FifoPush(r.handle, protocol::MakeSignalCmd(LlOp::kDispatch, 0, 1, 3)));
  aborter.join();
}

TEST(ProxyTest, ExternalRingsCarryCommandsAndAbortReachesTheirProducers) {
  // Rank 0's proxy drains a ring it does not own (as a GPU's pinned ring), rank 1's its own.
  const protocol::LlLayout layout = protocol::ComputeLlLayout({8, 512, 4, 2});
  FakeNetwork net(2);
  std::unique_ptr<uint8_t[]> regions[2];
  ProxyPtr proxies[2];
  Ring external(16);
  for (int r = 0; r < 2; ++r) {
    regions[r].reset(new uint8_t[layout.total_bytes]());
    auto t = std::make_unique<FakeTransport>(&net, r, 1 << 20);
    ASSERT_TRUE(t->RegisterRegion(regions[r].get(), layout.total_bytes).ok());
    std::vector<std::unique_ptr<Transport>> ts;
    ts.push_back(std::move(t));
    std::vector<ExternalRing> rings;
    if (r == 0) rings.push_back({external.handle, external.handle, const_cast<int32_t*>(&external.abort_flag)});
    auto p = Proxy::Create(layout, r, regions[r].get(), std::move(ts), ProxyOptions{}, std::move(rings));
    ASSERT_TRUE(p.ok()) << p.status();
    proxies[r] = *std::move(p);
  }
  EXPECT_EQ(proxies[0]->ring(0).ring, external.cmds.data());
  const int64_t off = layout.CombineRecvOffset(1, 0, 0);
  std::memset(regions[0].get() + off, 0x5A, 256);
  for (int i = 0; i < 40; ++i) {  // more than the ring holds: the proxy frees slots of memory it does not own
    ASSERT_TRUE(protocol::FifoPush(external.handle, protocol::MakeWriteCmd(LlOp::kCombine, 1, 1, off, off, 256)));
  }
  ASSERT_TRUE(
      protocol::FifoPush(external.handle, protocol::MakeSignalCmd(LlOp::kCombine, 1, 1, protocol::PackSignal(7, 40))));
  const auto* sig = reinterpret_cast<const uint64_t*>(regions[1].get() + layout.SignalOffset(1, LlOp::kCombine, 0));
  uint64_t w = 0;
  for (int i = 0; i < 2000000 && protocol::SignalSeq(w) != 7; ++i) {
    w = __atomic_load_n(sig, __ATOMIC_ACQUIRE);
    std::this_thread::yield();
  }
  EXPECT_EQ(w, protocol::PackSignal(7, 40));
  EXPECT_EQ(regions[1][off + 255], 0x5A);
  EXPECT_EQ(external.abort_flag, 0);
  proxies[0]->Abort(absl::InternalError("test"));
  EXPECT_EQ(external.abort_flag, 1);  // producers waiting on a full external ring stop
}

// A transport call that never returns, as libfabric's shm write does when the peer died holding the lock in its
// shared memory. Released only at the end of the test; it touches nothing but this flag.
std::atomic<bool> g_transport_wedged{true};

class WedgedTransport final : public Transport {
 public:
  std::string Name() const override { return "wedged"; }
  absl::Status RegisterRegion(void*, uint64_t) override { return absl::OkStatus(); }
  absl::StatusOr<std::string> LocalBlob() const override { return std::string("wedged"); }
  absl::Status Connect(const std::vector<std::string>&) override { return absl::OkStatus(); }
  uint64_t MaxWriteBytes() const override { return 1 << 20; }
  absl::StatusOr<bool> PostWrite(int, uint64_t, uint64_t, uint64_t, uint32_t, uint64_t) override {
    while (g_transport_wedged.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return true;
  }
  absl::StatusOr<int> Poll(Completion*, int) override { return 0; }
};

TEST(ProxyTest, WedgedTransportFailsTheProxyUnblocksProducersAndIsAbandonedOnStop) {
  const protocol::LlLayout layout = protocol::ComputeLlLayout({8, 512, 4, 2});
  // The region and the proxy are leaked when the thread is abandoned (the contract of Proxy::Stop).
  uint8_t* region = new uint8_t[layout.total_bytes]();
  std::vector<std::unique_ptr<Transport>> ts;
  ts.push_back(std::make_unique<WedgedTransport>());
  ProxyOptions o;
  o.fifo_entries = 2;
  o.stall_timeout = absl::Milliseconds(300);
  auto p = Proxy::Create(layout, 0, region, std::move(ts), o);
  ASSERT_TRUE(p.ok()) << p.status();
  ProxyPtr proxy = *std::move(p);
  const protocol::FifoCmd write = protocol::MakeWriteCmd(LlOp::kDispatch, 0, 1, 0, 0, 256);
  ASSERT_TRUE(protocol::FifoPush(proxy->ring(0), write));  // the thread pops it and never returns from the post
  // Fill the 2-entry ring; the push after that waits for space until the watchdog aborts.
  const auto start = std::chrono::steady_clock::now();
  bool pushed = true;
  for (int i = 0; i < 4 && pushed; ++i) pushed = protocol::FifoPush(proxy->ring(0), write);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(pushed) << "a producer on a full ring waited past the watchdog";
  EXPECT_GE(waited, 0.25);
  EXPECT_LT(waited, 5.0);
  ASSERT_TRUE(proxy->failed());
  const absl::Status s = proxy->status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(std::string(s.message()).find("(last destination rank 1)"), std::string::npos) << s;
  const auto stop_start = std::chrono::steady_clock::now();
  EXPECT_FALSE(proxy->Stop());  // already known wedged: abandoned without waiting
  proxy.reset();                // leaks instead of joining
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - stop_start).count(), 1.0);
  g_transport_wedged = false;  // the abandoned thread returns into leaked memory, sees stop and exits
}

TEST(ProxyTest, HealthyProxyStopsAndJoinsItsThreads) {
  Pair p(/*max_write=*/1 << 20);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(p.proxies[r]->Stop());
    EXPECT_TRUE(p.proxies[r]->Stop());  // idempotent
    EXPECT_TRUE(p.proxies[r]->status().ok()) << "an idle proxy was taken for wedged";
  }
}

TEST(ProxyTest, RejectsMismatchedExternalRings) {
  const protocol::LlLayout layout = protocol::ComputeLlLayout({8, 512, 4, 2});
  FakeNetwork net(2);
  std::unique_ptr<uint8_t[]> region(new uint8_t[layout.total_bytes]());
  std::vector<std::unique_ptr<Transport>> ts;
  ts.push_back(std::make_unique<FakeTransport>(&net, 0, 1 << 20));
  Ring a(16);
  std::vector<ExternalRing> two = {{a.handle, a.handle, const_cast<int32_t*>(&a.abort_flag)},
                                   {a.handle, a.handle, const_cast<int32_t*>(&a.abort_flag)}};
  auto p = Proxy::Create(layout, 0, region.get(), std::move(ts), ProxyOptions{}, two);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace llep::proxy
