#include "metrics/exporter.h"

#include <prometheus/check_names.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <cmath>
#include <exception>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "metrics/metric_names.h"
#include "runtime/base/status_macros.h"
#include "runtime/protocol/imm.h"

namespace llep::metrics {

namespace {

constexpr const char* kPhaseNames[] = {"send", "recv_wait", "total"};
static_assert(sizeof(kPhaseNames) / sizeof(kPhaseNames[0]) == protocol::kNumMetricPhases, "one name per phase");

// Decode steps take ~1 ms (graphs, small batch, one GPU per rank) to seconds (eager, many layers).
prometheus::Histogram::BucketBoundaries StepBoundariesSeconds() {
  return {0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2};
}

prometheus::Histogram::BucketBoundaries LatencyBoundariesSeconds() {
  prometheus::Histogram::BucketBoundaries b;
  for (int i = 0; i < protocol::kLatencyBounds; ++i)
    b.push_back(static_cast<double>(protocol::LatencyBoundNs(i)) / 1e9);
  return b;
}

}  // namespace

// Pointers into the registry's families, one per series (the registry owns them).
struct Exporter::Families {
  prometheus::Counter* ops[2] = {};
  prometheus::Counter* timeouts[2] = {};
  prometheus::Histogram* latency[2][protocol::kNumMetricPhases] = {};
  std::vector<prometheus::Counter*> recv_wait[2];     // [src]
  std::vector<prometheus::Counter*> dispatch_tokens;  // [dst]
  // [layer][local expert]. A layer's series appear with its first received token (layer 0's from the start), so a
  // model with 61 layers exports 61 x E_loc series, not LLEP_METRICS_LAYERS x E_loc.
  prometheus::Family<prometheus::Counter>* expert_recv_family = nullptr;
  std::vector<std::vector<prometheus::Counter*>> expert_recv;
  prometheus::Histogram* decode_step = nullptr;
  prometheus::Counter* decode_tokens = nullptr;
};

Exporter::Exporter(const protocol::MetricsLayout& layout, SnapshotFn snapshot, const ExporterOptions& options)
    : layout_(layout), snapshot_(std::move(snapshot)), options_(options) {}

absl::StatusOr<std::unique_ptr<Exporter>> Exporter::Create(const protocol::MetricsLayout& layout, SnapshotFn snapshot,
                                                           const ExporterOptions& options) {
  if (layout.num_words() <= 0 || layout.num_ranks <= 0) {
    return absl::FailedPreconditionError("metrics are off for this buffer: nothing to export");
  }
  if (options.interval <= absl::ZeroDuration()) return absl::InvalidArgumentError("metrics interval must be positive");
  if (options.port < -1 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", options.port, " is outside [-1, 65535]"));
  }
  for (const auto& [name, value] : options.labels) {
    if (!prometheus::CheckLabelName(name) || name == "rank") {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics label '", name, "' is not a valid Prometheus label name (or is the reserved 'rank')"));
    }
  }
  std::unique_ptr<Exporter> e(new Exporter(layout, std::move(snapshot), options));
  LLEP_RETURN_IF_ERROR(e->Init());
  return e;
}

absl::Status Exporter::Init() {
  registry_ = std::make_shared<prometheus::Registry>();
  families_ = std::make_unique<Families>();
  prometheus::Labels constant(options_.labels.begin(), options_.labels.end());
  constant["rank"] = std::to_string(options_.rank);
  const int R = layout_.num_ranks, E_loc = layout_.num_local_experts;
  auto& ops = prometheus::BuildCounter()
                  .Name(kOpsTotal)
                  .Help("Low-latency operations completed (their latencies are in llep_op_latency_seconds)")
                  .Labels(constant)
                  .Register(*registry_);
  auto& timeouts = prometheus::BuildCounter()
                       .Name(kTimeoutsTotal)
                       .Help("Receive waits that timed out: a peer did not signal within the buffer's timeout")
                       .Labels(constant)
                       .Register(*registry_);
  auto& latency = prometheus::BuildHistogram()
                      .Name(kOpLatencySeconds)
                      .Help(
                          "Operation latency from device timestamps: send (start to last signal published), "
                          "recv_wait (receive start to every signal seen), total (send start to receive end)")
                      .Labels(constant)
                      .Register(*registry_);
  auto& wait = prometheus::BuildCounter()
                   .Name(kRecvWaitSecondsTotal)
                   .Help("Time the receive phase waited for each source rank's signal")
                   .Labels(constant)
                   .Register(*registry_);
  auto& sent = prometheus::BuildCounter()
                   .Name(kDispatchTokensTotal)
                   .Help("(token, expert) selections dispatched to each destination rank")
                   .Labels(constant)
                   .Register(*registry_);
  auto& recv = prometheus::BuildCounter()
                   .Name(kExpertRecvTokensTotal)
                   .Help(
                       "Tokens received per MoE layer and local expert (the sum of recv_count over that layer's "
                       "dispatches; expert is the global id)")
                   .Labels(constant)
                   .Register(*registry_);
  auto& bytes = prometheus::BuildGauge()
                    .Name(kBufferBytes)
                    .Help("Bytes of the communication buffer")
                    .Labels(constant)
                    .Register(*registry_);
  bytes.Add({{"kind", "region"}}).Set(static_cast<double>(options_.buffer_bytes));
  families_->decode_step =
      &prometheus::BuildHistogram()
           .Name(kDecodeStepSeconds)
           .Help("Decode step latency measured by the engine on the host (one per step with a batch)")
           .Labels(constant)
           .Register(*registry_)
           .Add({}, StepBoundariesSeconds());
  families_->decode_tokens = &prometheus::BuildCounter()
                                  .Name(kDecodeTokensTotal)
                                  .Help("Tokens the engine's decode steps fed through the model")
                                  .Labels(constant)
                                  .Register(*registry_)
                                  .Add({});
  for (int op = 0; op < 2; ++op) {
    families_->ops[op] = &ops.Add({{"op", protocol::LlOpName(static_cast<protocol::LlOp>(op))}});
    families_->timeouts[op] = &timeouts.Add({{"op", protocol::LlOpName(static_cast<protocol::LlOp>(op))}});
    for (int ph = 0; ph < protocol::kNumMetricPhases; ++ph) {
      families_->latency[op][ph] =
          &latency.Add({{"op", protocol::LlOpName(static_cast<protocol::LlOp>(op))}, {"phase", kPhaseNames[ph]}},
                       LatencyBoundariesSeconds());
    }
    for (int src = 0; src < R; ++src) {
      families_->recv_wait[op].push_back(
          &wait.Add({{"op", protocol::LlOpName(static_cast<protocol::LlOp>(op))}, {"src_rank", std::to_string(src)}}));
    }
  }
  for (int d = 0; d < R; ++d) families_->dispatch_tokens.push_back(&sent.Add({{"dst_rank", std::to_string(d)}}));
  families_->expert_recv_family = &recv;
  families_->expert_recv.resize(static_cast<size_t>(layout_.num_layers));
  {
    absl::MutexLock lock(&mu_);
    AddLayerSeries(0);
    last_.assign(static_cast<size_t>(layout_.num_words()), 0);
  }
  LLEP_RETURN_IF_ERROR(Collect());
  if (options_.port >= 0) {
    const std::string address = absl::StrCat(options_.bind_address, ":", options_.port);
    try {
      exposer_ = std::make_unique<prometheus::Exposer>(address, 1);
    } catch (const std::exception& ex) {
      return absl::UnavailableError(absl::StrCat("metrics exporter cannot listen on ", address, ": ", ex.what()));
    }
    exposer_->RegisterCollectable(registry_, "/metrics");
    const std::vector<int> ports = exposer_->GetListeningPorts();
    port_ = ports.empty() ? -1 : ports[0];
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

Exporter::~Exporter() {
  if (thread_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  exposer_.reset();  // stop serving before the registry goes
}

void Exporter::Loop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      const auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.interval);
      if (stop_) break;
    }
    Collect().IgnoreError();  // kept in last_status()
  }
  Collect().IgnoreError();  // the final values, for a scrape that still comes before the exposer stops
}

absl::Status Exporter::ObserveDecodeStep(double seconds, int64_t tokens) {
  if (!(seconds >= 0.0) || !std::isfinite(seconds) || tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a decode step needs a finite time >= 0 and a token count >= 0, got ", seconds, " s and ", tokens));
  }
  families_->decode_step->Observe(seconds);  // prometheus-cpp series are thread-safe
  families_->decode_tokens->Increment(static_cast<double>(tokens));
  return absl::OkStatus();
}

absl::Status Exporter::Collect() {
  std::vector<uint64_t> now;
  absl::Status s = snapshot_(&now);
  if (s.ok() && now.size() != static_cast<size_t>(layout_.num_words())) {
    s = absl::InternalError(
        absl::StrCat("metrics snapshot has ", now.size(), " words, the layout ", layout_.num_words()));
  }
  absl::MutexLock lock(&mu_);
  last_status_ = s;
  if (!s.ok()) return s;
  // Counters are monotonic on the producer side; a word that went down (it cannot) is skipped, not negated.
  const auto delta = [&](int word) -> double {
    const uint64_t a = last_[static_cast<size_t>(word)], b = now[static_cast<size_t>(word)];
    return b > a ? static_cast<double>(b - a) : 0.0;
  };
  const protocol::MetricsLayout& m = layout_;
  for (int op = 0; op < 2; ++op) {
    families_->ops[op]->Increment(delta(m.ops(op)));
    families_->timeouts[op]->Increment(delta(m.timeouts(op)));
    for (int ph = 0; ph < protocol::kNumMetricPhases; ++ph) {
      std::vector<double> buckets(protocol::kLatencyBuckets);
      for (int b = 0; b < protocol::kLatencyBuckets; ++b) buckets[b] = delta(m.latency_bucket(op, ph, b));
      families_->latency[op][ph]->ObserveMultiple(buckets, delta(m.latency_sum_ns(op, ph)) / 1e9);
    }
    for (int src = 0; src < m.num_ranks; ++src) {
      families_->recv_wait[op][src]->Increment(delta(m.recv_wait_ns(op, src)) / 1e9);
    }
  }
  for (int d = 0; d < m.num_ranks; ++d) families_->dispatch_tokens[d]->Increment(delta(m.sent_selections(d)));
  for (int layer = 0; layer < m.num_layers; ++layer) {
    std::vector<prometheus::Counter*>& series = families_->expert_recv[static_cast<size_t>(layer)];
    for (int le = 0; le < m.num_local_experts; ++le) {
      const double d = delta(m.expert_recv_tokens(layer, le));
      if (d == 0) continue;
      if (series.empty()) AddLayerSeries(layer);
      series[static_cast<size_t>(le)]->Increment(d);
    }
  }
  last_ = std::move(now);
  return absl::OkStatus();
}

void Exporter::AddLayerSeries(int layer) {
  const int E_loc = layout_.num_local_experts;
  std::vector<prometheus::Counter*>& series = families_->expert_recv[static_cast<size_t>(layer)];
  for (int le = 0; le < E_loc; ++le) {
    series.push_back(&families_->expert_recv_family->Add({{"layer", std::to_string(layer)},
                                                          {"local_expert", std::to_string(le)},
                                                          {"expert", std::to_string(options_.rank * E_loc + le)}}));
  }
}

std::string Exporter::Text() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

absl::Status Exporter::last_status() const {
  absl::MutexLock lock(&mu_);
  return last_status_;
}

}  // namespace llep::metrics
