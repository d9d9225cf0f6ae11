// What the CPU and the GPU buffer bindings share: the bootstrap that must outlive the buffer, collective
// creation through a Python allgather, the "destroyed" check, collective close without the GIL, the layout
// queries, and the metrics (counter snapshots and the Prometheus exporter). Layer: server_hooks/bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "metrics/exporter.h"
#include "runtime/bootstrap.h"
#include "runtime/protocol/ll_shape.h"
#include "server_hooks/bindings/py_bootstrap.h"
#include "server_hooks/bindings/status_to_python.h"

namespace llep::bindings {

/// Buffer: CpuBuffer or GpuBuffer (static Create(shape, bootstrap, options), Close(), layout(),
/// combine_buffer_row_stride()).
template <typename Buffer>
class BufferHolder {
 public:
  /// Collective: every rank of the group must call it (and Close) in the same order.
  void Close() {
    exporter_.reset();  // its thread snapshots the buffer
    if (!buffer_) return;
    absl::Status s;
    {
      pybind11::gil_scoped_release nogil;
      s = buffer_->Close();
    }
    buffer_.reset();
    ThrowIfError(s);
  }
  int64_t combine_row_stride() { return Live()->combine_buffer_row_stride(); }
  int64_t buffer_bytes() { return Live()->layout().total_bytes; }

  /// (num_ranks, num_local_experts) of the counter block, (0, 0) when metrics are off.
  std::pair<int, int> metrics_shape() {
    const protocol::MetricsLayout m = Live()->metrics_layout();
    return {m.num_ranks, m.num_local_experts};
  }
  /// A copy of the counter block (runtime/protocol/metrics_layout.h), without the GIL.
  std::vector<uint64_t> MetricsWords() {
    Live();
    std::vector<uint64_t> out;
    absl::Status s;
    {
      pybind11::gil_scoped_release nogil;
      s = SnapshotMetrics(&out);
    }
    ThrowIfError(s);
    return out;
  }
  /// The counter block decoded by its layout (the one definition, runtime/protocol/metrics_layout.h) into lists:
  /// ops [2], timeouts [2], latency_buckets [2][3][buckets] (not cumulative), latency_sum_ns [2][3],
  /// latency_bounds_ns [bounds], recv_wait_ns [2][R], dispatch_selections [R], expert_recv_tokens [layers][E_loc].
  pybind11::dict MetricsSnapshot() {
    const protocol::MetricsLayout m = Live()->metrics_layout();
    const std::vector<uint64_t> w = MetricsWords();
    namespace py = pybind11;
    py::dict d;
    if (m.num_words() == 0) return d;
    const auto op_list = [&](auto word) {
      py::list l;
      for (int op = 0; op < 2; ++op) l.append(word(op));
      return l;
    };
    d["ops"] = op_list([&](int op) { return w[m.ops(op)]; });
    d["timeouts"] = op_list([&](int op) { return w[m.timeouts(op)]; });
    d["latency_buckets"] = op_list([&](int op) {
      py::list phases;
      for (int ph = 0; ph < protocol::kNumMetricPhases; ++ph) {
        py::list b;
        for (int i = 0; i < protocol::kLatencyBuckets; ++i) b.append(w[m.latency_bucket(op, ph, i)]);
        phases.append(b);
      }
      return phases;
    });
    d["latency_sum_ns"] = op_list([&](int op) {
      py::list l;
      for (int ph = 0; ph < protocol::kNumMetricPhases; ++ph) l.append(w[m.latency_sum_ns(op, ph)]);
      return l;
    });
    py::list bounds;
    for (int i = 0; i < protocol::kLatencyBounds; ++i) bounds.append(protocol::LatencyBoundNs(i));
    d["latency_bounds_ns"] = bounds;
    d["recv_wait_ns"] = op_list([&](int op) {
      py::list l;
      for (int r = 0; r < m.num_ranks; ++r) l.append(w[m.recv_wait_ns(op, r)]);
      return l;
    });
    py::list sent, recv;
    for (int r = 0; r < m.num_ranks; ++r) sent.append(w[m.sent_selections(r)]);
    for (int layer = 0; layer < m.num_layers; ++layer) {
      py::list row;
      for (int le = 0; le < m.num_local_experts; ++le) row.append(w[m.expert_recv_tokens(layer, le)]);
      recv.append(row);
    }
    d["dispatch_selections"] = sent;
    d["expert_recv_tokens"] = recv;
    return d;
  }
  /// Starts this rank's exporter (metrics/exporter.h); returns the bound port (-1: port -1, no HTTP server).
  int StartMetricsExporter(const std::string& address, int port, const std::map<std::string, std::string>& labels,
                           double interval_s) {
    Buffer* b = Live();
    if (exporter_) ThrowIfError(absl::FailedPreconditionError("the metrics exporter is already running"));
    metrics::ExporterOptions o;
    o.bind_address = address;
    o.port = port;
    o.labels = labels;
    o.rank = rank_;
    o.interval = absl::Seconds(interval_s);
    o.buffer_bytes = b->layout().total_bytes;
    auto e = metrics::Exporter::Create(
        b->metrics_layout(), [this](std::vector<uint64_t>* out) { return SnapshotMetrics(out); }, o);
    ThrowIfError(e.status());
    exporter_ = *std::move(e);
    return exporter_->port();
  }
  void StopMetricsExporter() { exporter_.reset(); }
  /// An engine's decode step into the running exporter (llep_decode_step_seconds, llep_decode_tokens_total).
  void ObserveDecodeStep(double seconds, int64_t tokens) {
    if (!exporter_) ThrowIfError(absl::FailedPreconditionError("no metrics exporter is running"));
    ThrowIfError(exporter_->ObserveDecodeStep(seconds, tokens));
  }
  /// The exporter's current text (what a scrape returns), after a fresh collection.
  std::string MetricsText() {
    if (!exporter_) ThrowIfError(absl::FailedPreconditionError("no metrics exporter is running"));
    {
      pybind11::gil_scoped_release nogil;
      ThrowIfError(exporter_->Collect());
    }
    return exporter_->Text();
  }

  virtual ~BufferHolder() = default;

 protected:
  /// Runs on the constructing thread, which holds the GIL: the allgather callback needs it.
  /// Copies the counter block (the backend's own snapshot; called without the GIL, also from the exporter thread).
  virtual absl::Status SnapshotMetrics(std::vector<uint64_t>* out) = 0;

  template <typename Options>
  void Create(const protocol::LlShape& shape, int rank, pybind11::function allgather, const Options& options) {
    rank_ = rank;
    bootstrap_ = MakePythonBootstrap(rank, shape.num_ranks, std::move(allgather));
    auto buf = Buffer::Create(shape, *bootstrap_, options);
    ThrowIfError(buf.status());
    buffer_ = *std::move(buf);
  }
  Buffer* Live() {
    if (!buffer_) ThrowIfError(absl::FailedPreconditionError("buffer was destroyed"));
    return buffer_.get();
  }

 private:
  std::unique_ptr<Bootstrap> bootstrap_;
  std::unique_ptr<Buffer> buffer_;               // destroyed before the bootstrap it uses
  std::unique_ptr<metrics::Exporter> exporter_;  // declared last: stopped before the buffer it snapshots
  int rank_ = 0;
};

/// The metrics methods of a bound buffer class (py::class_<PyBuffer>).
template <typename Holder, typename PyClass>
void BindMetricsMethods(PyClass& c) {
  namespace py = pybind11;
  c.def_property_readonly("metrics_shape", &Holder::metrics_shape,
                          "(num_ranks, num_local_experts) of the counter block; (0, 0) when metrics are off")
      .def("metrics_snapshot", &Holder::MetricsSnapshot, "The counter block decoded into lists ({} when off)")
      .def("start_metrics_exporter", &Holder::StartMetricsExporter, py::arg("address"), py::arg("port"),
           py::arg("labels"), py::arg("interval_s"),
           "Starts the Prometheus exporter (collector thread + HTTP /metrics); returns the bound port")
      .def("stop_metrics_exporter", &Holder::StopMetricsExporter)
      .def("observe_decode_step", &Holder::ObserveDecodeStep, py::arg("seconds"), py::arg("tokens"),
           "An engine's decode step into the exporter: step latency histogram and token counter")
      .def("metrics_text", &Holder::MetricsText, "The exporter's text after a fresh collection");
}

}  // namespace llep::bindings
