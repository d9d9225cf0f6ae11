// Python binding of runtime/gpu_buffer.h. Tensors cross as device addresses, streams as their integer handles
// (torch.cuda.Stream.cuda_stream), so the module never links torch. llep/buffer.py validates dtypes, shapes and
// devices before calling here.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/bootstrap.h"
#include "runtime/gpu_buffer.h"
#include "server_hooks/bindings/buffer_holder.h"
#include "server_hooks/bindings/call_from_addresses.h"
#include "server_hooks/bindings/status_to_python.h"

namespace llep::bindings {
namespace py = pybind11;
namespace {

cudaStream_t Stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

class PyGpuBuffer : public BufferHolder<GpuBuffer> {
 public:
  PyGpuBuffer(int T, int H, int E, int R, int rank, py::function allgather, int device, double timeout_s, int num_ctas,
              bool kernel_trace, bool metrics, int ranks_per_node, std::string transport, int proxy_threads,
              int metrics_layers, bool shrink) {
    GpuBufferOptions opt;
    opt.shrink = shrink;
    opt.metrics_layers = metrics_layers;
    opt.ranks_per_node = ranks_per_node;
    opt.transport = std::move(transport);
    opt.num_proxy_threads = proxy_threads;
    opt.metrics = metrics;
    opt.kernel_trace = kernel_trace;
    opt.device = device;
    opt.timeout = absl::Seconds(timeout_s);
    opt.num_ctas = num_ctas;
    Create(protocol::LlShape{T, H, E, R}, rank, std::move(allgather), opt);
  }

  // The backend interface both bindings share (call_from_addresses.h): the pending operation when split (the
  // hook's), else None (nothing to hold: the receive phase is queued in the same launch).
  py::object Dispatch(const DispatchCall& c, bool split, uintptr_t stream) {
    return Pending(Live()->Dispatch(c, split, Stream(stream)), split);
  }

  py::object Combine(const CombineCall& c, bool split, uintptr_t stream) {
    return Pending(Live()->Combine(c, split, Stream(stream)), split);
  }

  /// The hook: queues the receive phase on `stream`. Never waits on the host.
  void Receive(const std::shared_ptr<GpuPendingOp>& op, uintptr_t stream) {
    if (!op) ThrowIfError(absl::InvalidArgumentError("no operation"));
    ThrowIfError(Live()->Receive(*op, Stream(stream)));
  }

  void CheckErrors(bool bad_input) { ThrowIfError(Live()->CheckErrors(bad_input)); }
  void Clean(uintptr_t stream) {
    GpuBuffer* buf = Live();
    absl::Status s;
    {
      py::gil_scoped_release nogil;  // recovery synchronises the device and runs a collective
      s = buf->Clean(Stream(stream));
    }
    ThrowIfError(s);
  }
  void SetMasked(int rank, bool masked, uintptr_t stream) {
    ThrowIfError(Live()->SetMasked(rank, masked, Stream(stream)));
  }
  void QueryMasks(uintptr_t dst, uintptr_t stream) {
    ThrowIfError(Live()->QueryMasks(reinterpret_cast<int32_t*>(dst), Stream(stream)));
  }
  void ClearMasks(uintptr_t stream) { ThrowIfError(Live()->ClearMasks(Stream(stream))); }
  uintptr_t NextCombineBuffer() { return reinterpret_cast<uintptr_t>(Live()->NextCombineBuffer()); }
  int num_ctas() { return Live()->num_ctas(); }
  std::vector<std::string> PeerPaths() {
    std::vector<std::string> out;
    for (PeerPath p : Live()->peer_paths()) out.emplace_back(PeerPathName(p));
    return out;
  }
  py::dict ProxyStats() {
    const proxy::ProxyStats s = Live()->proxy_stats();
    py::dict d;
    d["transport"] = Live()->transport_name();
    d["commands"] = s.commands;
    d["writes_posted"] = s.writes_posted;
    d["bytes_posted"] = s.bytes_posted;
    d["immediates"] = s.immediates;
    return d;
  }
  int device() { return Live()->device(); }
  absl::Status SnapshotMetrics(std::vector<uint64_t>* out) override {
    auto w = Live()->MetricsSnapshot();
    if (!w.ok()) return w.status();
    *out = *std::move(w);
    return absl::OkStatus();
  }
  /// Queues the binning of every received operation's latencies on `stream` (before a snapshot that must hold them).
  void FlushMetrics(uintptr_t stream) { ThrowIfError(Live()->FlushMetrics(Stream(stream))); }

  std::vector<uint64_t> KernelTrace() {
    auto t = Live()->KernelTrace();
    ThrowIfError(t.status());
    return *std::move(t);
  }

 private:
  static py::object Pending(absl::StatusOr<GpuPendingOp> op, bool split) {
    ThrowIfError(op.status());
    if (!split) return py::none();
    return py::cast(std::make_shared<GpuPendingOp>(*std::move(op)));
  }
};

}  // namespace

void BindGpuBuffer(py::module_& m) {
  py::class_<GpuPendingOp, std::shared_ptr<GpuPendingOp>>(m, "GpuPendingOp",
                                                          "A queued send phase waiting for its receive launch.")
      .def_property_readonly("seq", [](const GpuPendingOp& op) { return op.seq; });
  py::class_<PyGpuBuffer> c(m, "GpuBuffer",
                            "One rank of the GPU backend: NVLink and proxy peers (runtime/gpu_buffer.h).");
  BindMetricsMethods<PyGpuBuffer>(c);
  DefCallMethods<PyGpuBuffer>(c);
  c.def(py::init<int, int, int, int, int, py::function, int, double, int, bool, bool, int, std::string, int, int,
                 bool>(),
        py::arg("T"), py::arg("H"), py::arg("E"), py::arg("R"), py::arg("rank"), py::arg("allgather"),
        py::arg("device"), py::arg("timeout_s"), py::arg("num_ctas"), py::arg("kernel_trace") = false,
        py::arg("metrics") = true, py::arg("ranks_per_node") = -1, py::arg("transport") = "",
        py::arg("proxy_threads") = 1, py::arg("metrics_layers") = base::kDefaultMetricsLayers,
        py::arg("shrink") = false)
      .def("peer_paths", &PyGpuBuffer::PeerPaths, "How this rank reaches each rank: 'self', 'nvlink' or 'proxy'.")
      .def("proxy_stats", &PyGpuBuffer::ProxyStats,
           "The proxy's transport and counters (commands, writes_posted, bytes_posted, immediates); zeros and an "
           "empty transport when every peer is reached over NVLink.")
      .def("flush_metrics", &PyGpuBuffer::FlushMetrics)
      .def("receive", &PyGpuBuffer::Receive)
      .def("check_errors", &PyGpuBuffer::CheckErrors, py::arg("bad_input") = true)
      .def("next_combine_buffer", &PyGpuBuffer::NextCombineBuffer)
      .def("kernel_trace", &PyGpuBuffer::KernelTrace,
           "Diagnostic timeline [num_ctas][2 ops][16] of global-timer ns (kernels/cuda/ll_kernels.h TracePoint), "
           "after a device synchronisation; empty unless created with kernel_trace (LLEP_KERNEL_TRACE=1).")
      .def_property_readonly("combine_row_stride", &PyGpuBuffer::combine_row_stride)
      .def_property_readonly("buffer_bytes", &PyGpuBuffer::buffer_bytes)
      .def_property_readonly("num_ctas", &PyGpuBuffer::num_ctas)
      .def_property_readonly("device", &PyGpuBuffer::device)
      .def("close", &PyGpuBuffer::Close);
}

}  // namespace llep::bindings
