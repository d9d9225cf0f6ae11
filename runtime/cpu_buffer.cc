#include "runtime/cpu_buffer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proxy/fabric/fabric_transport.h"
#include "runtime/base/log.h"
#include "runtime/base/status_macros.h"
#include "runtime/protocol/signal.h"
#include "runtime/protocol/sys_order.h"
#include "runtime/validate.h"

namespace llep {

using protocol::LlOp;

namespace {

/// The kept entry (per buffer half: expert plan or sent weights) of the dispatch with this plan key, half 1's when both
/// name it; null when none does (key 0 names no dispatch).
template <typename Kept>
const Kept* KeptFor(const std::array<Kept, 2>& kept, uint64_t key) {
  const Kept* found = nullptr;
  for (const Kept& k : kept) {
    if (key != 0 && k.plan_key == key) found = &k;
  }
  return found;
}

uint64_t NowNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace

CpuBuffer::CpuBuffer(const protocol::LlLayout& layout, Bootstrap& bootstrap, const CpuBufferOptions& options)
    : layout_(layout), bootstrap_(bootstrap), options_(options), rank_(bootstrap.rank()) {
  if (options_.metrics) {
    metrics_layout_ = protocol::ComputeMetricsLayout(layout.shape.num_ranks, layout.shape.num_local_experts(),
                                                     options_.metrics_layers);
    metrics_.assign(static_cast<size_t>(metrics_layout_.num_words()), 0);
  }
  masks_.reset(new std::atomic<int32_t>[layout.shape.num_ranks]);
  for (int r = 0; r < layout.shape.num_ranks; ++r) masks_[r].store(0, std::memory_order_relaxed);
  if (options_.shrink) {
    options_.num_proxy_threads = std::max(options_.num_proxy_threads, layout.shape.num_ranks);
    options_.proxy.isolate_peer_failures = true;
  }
}

absl::Status CpuBuffer::SetMasked(int rank, bool masked) {
  if (!options_.shrink) return absl::FailedPreconditionError("rank masking needs a buffer created with enable_shrink");
  if (rank < 0 || rank >= layout_.shape.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank_to_mask ", rank, " is outside [0, ", layout_.shape.num_ranks, ")"));
  }
  masks_[rank].store(masked ? 1 : 0, std::memory_order_release);
  return absl::OkStatus();
}

std::vector<int32_t> CpuBuffer::Masks() const {
  std::vector<int32_t> m(layout_.shape.num_ranks);
  for (int r = 0; r < layout_.shape.num_ranks; ++r) m[r] = masks_[r].load(std::memory_order_acquire);
  return m;
}

void CpuBuffer::ClearMasks() {
  for (int r = 0; r < layout_.shape.num_ranks; ++r) masks_[r].store(0, std::memory_order_release);
}

std::vector<uint8_t> CpuBuffer::MaskForCall() {
  std::vector<uint8_t> m;
  if (!options_.shrink) return m;
  m.resize(layout_.shape.num_ranks);
  for (int r = 0; r < layout_.shape.num_ranks; ++r) {
    if (r != rank_ && proxy_ != nullptr && proxy_->PeerFailed(r) && masks_[r].exchange(1) == 0) {
      LLEP_LOG(kWarning) << "rank " << rank_ << " masks rank " << r << ": " << proxy_->PeerStatus(r).message();
    }
    m[r] = masks_[r].load(std::memory_order_acquire) != 0 ? 1 : 0;
  }
  return m;
}

std::vector<uint64_t> CpuBuffer::MetricsSnapshot() const {
  absl::MutexLock lock(&metrics_mu_);
  return metrics_;
}

void CpuBuffer::AddMetrics(const std::function<void(std::vector<uint64_t>&)>& f) {
  if (!options_.metrics) return;
  absl::MutexLock lock(&metrics_mu_);
  f(metrics_);
}

CpuBuffer::~CpuBuffer() { StopProxy(); }

void CpuBuffer::StopProxy() {
  // A proxy thread wedged inside its transport (a peer died in libfabric's shm) may still read the region: then the
  // region is leaked with the proxy instead of unmapped under it.
  if (proxy_ != nullptr && !proxy_->Stop()) region_.Abandon();
  proxy_.reset();
}

absl::StatusOr<std::unique_ptr<CpuBuffer>> CpuBuffer::Create(const protocol::LlShape& shape, Bootstrap& bootstrap,
                                                             const CpuBufferOptions& options) {
  LLEP_RETURN_IF_ERROR(ValidateShapeForGroup(shape, bootstrap.size()));
  if (options.num_proxy_threads < 1) return absl::InvalidArgumentError("num_proxy_threads must be >= 1");
  std::unique_ptr<CpuBuffer> b(new CpuBuffer(protocol::ComputeLlLayout(shape), bootstrap, options));
  LLEP_RETURN_IF_ERROR(b->Init());
  return b;
}

absl::Status CpuBuffer::Init() {
  LLEP_ASSIGN_OR_RETURN(region_, HostRegion::Allocate(static_cast<size_t>(layout_.total_bytes)));
  const int R = layout_.shape.num_ranks;
  peers_.assign(R, kernels::HostPeer{});
  peers_[rank_].direct_base = region_.data();
  transport_name_ = "local";
  if (R > 1) {
    std::vector<std::unique_ptr<proxy::Transport>> transports;
    std::vector<std::string> blobs;
    for (int i = 0; i < options_.num_proxy_threads; ++i) {
      proxy::FabricOptions fo;
      fo.provider = options_.provider.empty() ? "shm" : options_.provider;
      LLEP_ASSIGN_OR_RETURN(auto t, proxy::CreateFabricTransport(fo));
      LLEP_RETURN_IF_ERROR(t->RegisterRegion(region_.data(), region_.size()));
      LLEP_ASSIGN_OR_RETURN(std::string blob, t->LocalBlob());
      blobs.push_back(std::move(blob));
      transports.push_back(std::move(t));
    }
    transport_name_ = transports[0]->Name();
    LLEP_ASSIGN_OR_RETURN(std::vector<std::string> all, bootstrap_.AllGather(PackStringList(blobs)));
    std::vector<std::vector<std::string>> per_thread(options_.num_proxy_threads, std::vector<std::string>(R));
    for (int r = 0; r < R; ++r) {
      LLEP_ASSIGN_OR_RETURN(std::vector<std::string> mine, UnpackStringList(all[r]));
      if (static_cast<int>(mine.size()) != options_.num_proxy_threads) {
        return absl::FailedPreconditionError(absl::StrCat("rank ", r, " runs ", mine.size(),
                                                          " proxy threads, this rank ", options_.num_proxy_threads,
                                                          ": every rank needs the same num_proxy_threads"));
      }
      for (int i = 0; i < options_.num_proxy_threads; ++i) per_thread[i][r] = std::move(mine[i]);
    }
    for (int i = 0; i < options_.num_proxy_threads; ++i) LLEP_RETURN_IF_ERROR(transports[i]->Connect(per_thread[i]));
    LLEP_ASSIGN_OR_RETURN(proxy_,
                          proxy::Proxy::Create(layout_, rank_, region_.data(), std::move(transports), options_.proxy));
    for (int d = 0; d < R; ++d) {
      if (d != rank_) peers_[d].fifo = &proxy_->ring(proxy::Proxy::ThreadFor(rank_, d, proxy_->num_threads()));
    }
  }
  // Nobody sends before every rank's endpoint, region and proxy exist.
  return bootstrap_.Barrier();
}

kernels::HostRankContext CpuBuffer::Context(const std::vector<uint8_t>* masked) const {
  return kernels::HostRankContext{layout_, rank_, region_.data(), peers_.data(),
                                  masked != nullptr && !masked->empty() ? masked->data() : nullptr};
}

proxy::ProxyStats CpuBuffer::proxy_stats() const { return proxy_ ? proxy_->stats() : proxy::ProxyStats{}; }

uint16_t* CpuBuffer::NextCombineBuffer() const {
  absl::MutexLock lock(&mu_);
  return reinterpret_cast<uint16_t*>(region_.data() +
                                     layout_.CombineSendOffset(protocol::HalfOfSeq(calls_.next()), 0, 0));
}

absl::StatusOr<uint32_t> CpuBuffer::BeginSend(LlOp op) {
  if (closed_) return absl::FailedPreconditionError("buffer is closed");
  if (proxy_ != nullptr && proxy_->failed()) return base::Annotate(proxy_->status(), "proxy failed earlier");
  LLEP_ASSIGN_OR_RETURN(const uint32_t seq, calls_.Begin(op));
  calls_.AwaitReceive(seq);
  return seq;
}

absl::StatusOr<PendingOp> CpuBuffer::DispatchSend(const DispatchCall& call) {
  const protocol::LlShape& shape = layout_.shape;
  LLEP_RETURN_IF_ERROR(ValidateDispatchCall(shape, call, options_.metrics_layers));
  LLEP_RETURN_IF_ERROR(ValidateTopk(shape, call.topk_idx, call.num_tokens, call.num_topk));
  absl::MutexLock lock(&mu_);
  LLEP_ASSIGN_OR_RETURN(const uint32_t seq, BeginSend(LlOp::kDispatch));
  PendingOp op;
  op.send_start_ns_ = NowNs();
  kernels::BuildRoutePlan(shape, call.topk_idx, call.num_tokens, call.num_topk, &dispatch_plan_);
  op.seq_ = seq;
  op.op_ = LlOp::kDispatch;
  op.dispatch_ = call;
  // Every dispatch takes its half's slot, so one without weights retires the older plan too (as on the GPU).
  KeptWeights& kept = sent_weights_[static_cast<size_t>(protocol::HalfOfSeq(seq))];
  kept.plan_key = call.carries_weights ? call.plan_key : 0;
  kept.w.clear();
  if (call.carries_weights) {
    kept.w.assign(call.topk_weights, call.topk_weights + static_cast<size_t>(call.num_tokens) * call.num_topk);
  }
  const std::vector<uint8_t> masked = MaskForCall();
  if (!kernels::DispatchSendHost(Context(&masked), {&call, &dispatch_plan_, seq})) {
    return base::Annotate(proxy_->status(), "dispatch send aborted");
  }
  op.send_end_ns_ = NowNs();
  AddMetrics([&](std::vector<uint64_t>& m) {
    for (int d = 0; d < shape.num_ranks; ++d) {
      m[metrics_layout_.sent_selections(d)] += static_cast<uint64_t>(dispatch_plan_.rows_per_dst[d]);
    }
  });
  return op;
}

absl::StatusOr<PendingOp> CpuBuffer::CombineSend(const CombineCall& call) {
  const protocol::LlShape& shape = layout_.shape;
  LLEP_RETURN_IF_ERROR(ValidateCombineCall(shape, call));
  LLEP_RETURN_IF_ERROR(ValidateTopk(shape, call.topk_idx, call.num_tokens, call.num_topk));
  LLEP_RETURN_IF_ERROR(ValidateLayoutRange(shape, call.layout_range));
  absl::MutexLock lock(&mu_);
  const kernels::ExpertSidePlan* expert_plan = nullptr;
  if (call.expert_reduced) {
    expert_plan = KeptFor(expert_plans_, call.plan_key);
    const KeptWeights* sent = KeptFor(sent_weights_, call.plan_key);
    if (expert_plan == nullptr || sent == nullptr) {
      return absl::FailedPreconditionError(
          "combine of a dispatch that carried topk_weights: that dispatch's messages are no longer kept (a later "
          "dispatch into the same buffer half replaced them, or it was not received); combine each handle before the "
          "second dispatch after it");
    }
    // Bit for bit, as the GPU backend compares (a -0.0 for a 0.0 is a different input there too).
    if (sent->w.size() != static_cast<size_t>(call.num_tokens) * call.num_topk ||
        std::memcmp(sent->w.data(), call.topk_weights, sent->w.size() * sizeof(float)) != 0) {
      return absl::InvalidArgumentError(
          "combine topk_weights differ from the topk_weights its dispatch carried (the experts' ranks reduced with "
          "those): pass the same weights to both");
    }
  }
  LLEP_ASSIGN_OR_RETURN(const uint32_t seq, BeginSend(LlOp::kCombine));
  PendingOp op;
  op.send_start_ns_ = NowNs();
  op.seq_ = seq;
  op.op_ = LlOp::kCombine;
  op.combine_ = call;
  op.plan_ = std::make_unique<kernels::RoutePlan>();
  kernels::BuildRoutePlan(shape, call.topk_idx, call.num_tokens, call.num_topk, op.plan_.get());
  const std::vector<uint8_t> masked = MaskForCall();
  if (!kernels::CombineSendHost(Context(&masked), {&call, seq, expert_plan})) {
    return base::Annotate(proxy_->status(), "combine send aborted");
  }
  op.send_end_ns_ = NowNs();
  return op;
}

absl::Status CpuBuffer::Receive(PendingOp op) {
  {
    absl::MutexLock lock(&mu_);
    if (!calls_.AwaitingReceive(op.seq_)) {
      return absl::FailedPreconditionError("operation already received or not sent on this buffer");
    }
  }
  // The half stays reserved while it is read, so a send on another thread cannot overwrite it. It is released
  // even on failure: after a timeout the half's contents are undefined, and retrying would only wait for the
  // same missing peer again.
  const uint64_t recv_start = NowNs();
  const absl::Status s = op.op_ == LlOp::kDispatch ? ReceiveDispatch(op) : ReceiveCombine(op);
  if (s.ok() && !op.barrier_) {
    const uint64_t recv_end = NowNs();
    const uint64_t ns[protocol::kNumMetricPhases] = {op.send_end_ns_ - op.send_start_ns_, op.wait_end_ns_ - recv_start,
                                                     recv_end - op.send_start_ns_};
    AddMetrics([&](std::vector<uint64_t>& m) {
      protocol::AddOpLatencies(metrics_layout_, static_cast<int>(op.op_), ns,
                               [&](int word, uint64_t v) { m[word] += v; });
    });
  }
  absl::MutexLock lock(&mu_);
  calls_.Received(op.seq_);
  return s;
}

absl::Status CpuBuffer::WaitForSignals(PendingOp& op, std::vector<uint32_t>* values, int64_t* wait_stats) {
  const int R = layout_.shape.num_ranks, half = protocol::HalfOfSeq(op.seq_);
  values->assign(R, 0);
  op.masked_ = MaskForCall();
  std::vector<int> pending;
  for (int r = 0; r < R; ++r) {
    if (op.masked_.empty() || op.masked_[r] == 0) pending.push_back(r);  // a masked source is not waited for
  }
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + absl::ToChronoNanoseconds(options_.timeout);
  for (int spins = 0; !pending.empty(); ++spins) {
    for (size_t i = 0; i < pending.size();) {
      const int src = pending[i];
      // Pairs with the release store of the signal (ll_host.cc for direct peers, arrival_counter.cc for proxied).
      const uint64_t word = protocol::LoadAcquireSys(
          reinterpret_cast<const uint64_t*>(region_.data() + layout_.SignalOffset(half, op.op_, src)));
      const uint32_t s = protocol::SignalSeq(word);
      if (s == op.seq_) {
        (*values)[src] = protocol::SignalValue(word);
        const int64_t waited =
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
        if (wait_stats != nullptr) wait_stats[src] += waited;
        if (!op.barrier_) {
          AddMetrics([&](std::vector<uint64_t>& m) {
            m[metrics_layout_.recv_wait_ns(static_cast<int>(op.op_), src)] += static_cast<uint64_t>(waited);
          });
        }
        pending[i] = pending.back();
        pending.pop_back();
        continue;
      }
      if (protocol::SignalIsNewer(s, op.seq_)) {
        return absl::DataLossError(absl::StrCat(protocol::LlOpName(op.op_), " call ", op.seq_, ": rank ", src,
                                                " already signalled call ", s,
                                                " into the same half; more operations were in flight than allowed"));
      }
      ++i;
    }
    if (pending.empty()) break;
    // One flag read per spin; the Status (behind a mutex) only once the proxy failed.
    if (proxy_ != nullptr && proxy_->failed()) {
      return base::Annotate(proxy_->status(), absl::StrCat(protocol::LlOpName(op.op_), " receive"));
    }
    if (options_.shrink && (spins & 63) == 0) {
      // A peer whose proxy thread failed will never signal: mask it now rather than at the deadline.
      const std::vector<uint8_t> now_masked = MaskForCall();
      for (size_t i = 0; i < pending.size();) {
        if (now_masked[pending[i]] == 0) {
          ++i;
          continue;
        }
        op.masked_[pending[i]] = 1;
        pending[i] = pending.back();
        pending.pop_back();
      }
      if (pending.empty()) break;
    }
    if ((spins & 63) == 0 && std::chrono::steady_clock::now() > deadline) {
      std::sort(pending.begin(), pending.end());
      if (!op.barrier_) {  // Clean()'s barrier is not an operation of the user's (the GPU's runs with metrics off)
        AddMetrics([&](std::vector<uint64_t>& m) { ++m[metrics_layout_.timeouts(static_cast<int>(op.op_))]; });
      }
      if (options_.shrink) {
        // DeepEP's shrink semantics: the silent ranks are masked and the call completes without them.
        LLEP_LOG(kWarning) << protocol::LlOpName(op.op_) << " call " << op.seq_ << ": rank " << rank_
                           << " masks silent rank(s) " << absl::StrJoin(pending, ", ") << " after "
                           << absl::FormatDuration(options_.timeout);
        for (const int r : pending) {
          masks_[r].store(1, std::memory_order_release);
          op.masked_[r] = 1;
        }
        break;
      }
      return absl::DeadlineExceededError(absl::StrCat(protocol::LlOpName(op.op_), " call ", op.seq_,
                                                      " timed out after ", absl::FormatDuration(options_.timeout),
                                                      " waiting for rank(s) ", absl::StrJoin(pending, ", "),
                                                      " (peer dead, stalled, or calling a different sequence)"));
    }
    if (spins > 256) std::this_thread::sleep_for(std::chrono::microseconds(spins > 4096 ? 50 : 5));
  }
  op.wait_end_ns_ = NowNs();
  return absl::OkStatus();
}

absl::Status CpuBuffer::ReceiveDispatch(PendingOp& op) {
  const DispatchCall& c = op.dispatch_;
  std::vector<uint32_t> tokens;
  LLEP_RETURN_IF_ERROR(WaitForSignals(op, &tokens, c.wait_recv_cost_stats));
  kernels::ExpertSidePlan received;
  const std::string err = kernels::DispatchRecvHost(
      Context(&op.masked_), {&c, op.seq_, tokens.data(), c.carries_weights ? &received : nullptr});
  if (!err.empty()) return absl::DataLossError(absl::StrCat("dispatch call ", op.seq_, ": ", err));
  {
    absl::MutexLock lock(&mu_);
    kernels::ExpertSidePlan& slot = expert_plans_[static_cast<size_t>(protocol::HalfOfSeq(op.seq_))];
    slot = std::move(received);  // a dispatch without weights leaves plan_key 0: the half's older plan is retired
  }
  if (op.barrier_) return absl::OkStatus();
  AddMetrics([&](std::vector<uint64_t>& m) {
    for (int le = 0; le < layout_.shape.num_local_experts(); ++le) {
      m[metrics_layout_.expert_recv_tokens(c.layer, le)] += static_cast<uint64_t>(c.recv_count[le]);
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBuffer::ReceiveCombine(PendingOp& op) {
  const CombineCall& c = op.combine_;
  std::vector<uint32_t> rows;
  LLEP_RETURN_IF_ERROR(WaitForSignals(op, &rows, c.wait_recv_cost_stats));
  for (int src = 0; src < layout_.shape.num_ranks; ++src) {
    if (!op.masked_.empty() && op.masked_[src] != 0) continue;  // its rows are dropped from the sum
    // Expert-side reduction: one row per token with a selection on src; otherwise one per selection.
    const int32_t expected = c.expert_reduced ? op.plan_->tokens_per_dst[src] : op.plan_->rows_per_dst[src];
    if (rows[src] != static_cast<uint32_t>(expected)) {
      return absl::InvalidArgumentError(absl::StrCat("combine call ", op.seq_, ": rank ", src, " returned ", rows[src],
                                                     " rows but this rank's topk_idx expects ", expected,
                                                     "; combine needs the topk_idx of the matching dispatch"));
    }
  }
  kernels::CombineRecvHost(Context(&op.masked_), {&c, op.plan_.get(), op.seq_});
  return absl::OkStatus();
}

absl::Status CpuBuffer::Clean() {
  const int R = layout_.shape.num_ranks, E_loc = layout_.shape.num_local_experts();
  if (proxy_ != nullptr && proxy_->failed()) return base::Annotate(proxy_->status(), "clean_low_latency_buffer");
  if (!options_.shrink) {
    uint32_t last = 0;
    {
      absl::MutexLock lock(&mu_);
      if (closed_) return absl::FailedPreconditionError("buffer is closed");
      last = calls_.last();
    }
    LLEP_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, bootstrap_.AllGatherU64(last));
    uint32_t newest = last;
    for (const uint64_t w : all) {
      const auto v = static_cast<uint32_t>(w);
      if (newest == 0 || (v != 0 && protocol::SignalIsNewer(v, newest))) newest = v;
    }
    absl::MutexLock lock(&mu_);
    calls_.Restart(newest);
    return absl::OkStatus();
  }
  // Shrink: a dispatch of no tokens is a barrier among the unmasked ranks (each signals every unmasked peer, then
  // waits for theirs), and its receive masks a rank that stays silent. Outputs: only counts and ranges are written.
  std::vector<int32_t> recv_count(E_loc), src_info(1);
  std::vector<int64_t> layout_range(static_cast<size_t>(E_loc) * R);
  uint16_t unused_x = 0;
  DispatchCall call;
  call.num_topk = 1;
  call.mode.use_fp8 = false;
  call.recv_x = &unused_x;
  call.recv_count = recv_count.data();
  call.src_info = src_info.data();
  call.layout_range = layout_range.data();
  {
    absl::MutexLock lock(&mu_);
    // Operations left unreceived by a failed call would hold their halves: abandon them (their receive is refused).
    calls_.Restart(calls_.last());
  }
  LLEP_ASSIGN_OR_RETURN(PendingOp op, DispatchSend(call));
  op.barrier_ = true;
  return Receive(std::move(op));
}

absl::Status CpuBuffer::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::OkStatus();
    closed_ = true;
  }
  const std::vector<int32_t> masks = Masks();
  const bool any_masked = std::find(masks.begin(), masks.end(), 1) != masks.end();
  absl::Status s = any_masked ? absl::OkStatus() : bootstrap_.Barrier();
  StopProxy();
  return s;
}

}  // namespace llep
