// The metrics exporter of one rank: a collector thread that snapshots the backend's counter block
// (runtime/protocol/metrics_layout.h) asynchronously, turns the increments since the last snapshot into
// prometheus-cpp counters and histograms, and an HTTP exposer serving them at /metrics (text format 0.0.4).
// Layer: metrics (depends on runtime/protocol, runtime/base and prometheus-cpp only; the caller supplies the
// snapshot function, so this layer never sees a buffer).
//
// The hot path never waits for it: the kernels (or the CPU backend) only add to their counter block; the snapshot
// function is the backend's asynchronous copy (GpuBuffer::MetricsSnapshot waits for its own copy stream only).
// Names (metric_names.h) follow Prometheus conventions: prefix llep_, base units, _total on counters; every series
// carries the constant labels `rank` and whatever the caller adds (model_name, engine, ...).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/protocol/metrics_layout.h"

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace llep::metrics {

/// Copies the whole counter block (layout.num_words() words) into *out.
using SnapshotFn = std::function<absl::Status(std::vector<uint64_t>* out)>;

struct ExporterOptions {
  std::string bind_address = "127.0.0.1";      ///< loopback unless the operator opens it up
  int port = 0;                                ///< 0: an ephemeral port (read it back with port()); -1: no HTTP server
  absl::Duration interval = absl::Seconds(1);  ///< snapshot period of the collector thread
  int rank = 0;                                ///< constant label `rank`
  std::map<std::string, std::string> labels;   ///< further constant labels (model_name, engine, ...)
  int64_t buffer_bytes = 0;                    ///< reported as llep_buffer_bytes{kind="region"}
};

class Exporter {
 public:
  /// Registers the metric families, takes a first snapshot, starts the collector thread and (port >= 0) the
  /// HTTP exposer. Errors: bad label names, a port that cannot be bound, a failing first snapshot.
  static absl::StatusOr<std::unique_ptr<Exporter>> Create(const protocol::MetricsLayout& layout, SnapshotFn snapshot,
                                                          const ExporterOptions& options);
  ~Exporter();  ///< stops the thread after a last collection

  /// Takes a snapshot now and feeds the registry (what the thread does every interval).
  absl::Status Collect();
  /// The registry rendered in the text format, as a scrape would see it.
  std::string Text() const;
  /// An engine's decode step: `seconds` into llep_decode_step_seconds, `tokens` added to llep_decode_tokens_total.
  /// Thread-safe; InvalidArgument for a negative or non-finite time or a negative count.
  absl::Status ObserveDecodeStep(double seconds, int64_t tokens);
  /// The bound HTTP port, or -1 without an exposer.
  int port() const { return port_; }
  /// The last collection's error, if any (the thread keeps going: a transient failure costs one interval).
  absl::Status last_status() const;

 private:
  struct Families;
  Exporter(const protocol::MetricsLayout& layout, SnapshotFn snapshot, const ExporterOptions& options);
  absl::Status Init();
  void Loop();
  /// Registers the series of one layer's experts (Init for layer 0, Collect when a layer first receives).
  void AddLayerSeries(int layer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const protocol::MetricsLayout layout_;
  const SnapshotFn snapshot_;
  const ExporterOptions options_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Families> families_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = -1;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> last_ ABSL_GUARDED_BY(mu_);  // the snapshot the registry reflects
  absl::Status last_status_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace llep::metrics
