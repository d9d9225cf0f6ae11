// Python binding of runtime/cpu_buffer.h: argument conversion, Status -> exception, GIL handling only.
// Tensors cross as raw addresses (int) plus shapes; the Python layer (llep/buffer.py) validates dtypes and
// shapes and owns the tensors, so this module never links torch and works with any torch version.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "runtime/bootstrap.h"
#include "runtime/cpu_buffer.h"
#include "server_hooks/bindings/buffer_holder.h"
#include "server_hooks/bindings/call_from_addresses.h"
#include "server_hooks/bindings/status_to_python.h"

namespace llep::bindings {
namespace py = pybind11;
namespace {

class PyCpuBuffer : public BufferHolder<CpuBuffer> {
 public:
  PyCpuBuffer(int T, int H, int E, int R, int rank, py::function allgather, const std::string& provider,
              double timeout_s, int proxy_threads, bool metrics, int metrics_layers, bool shrink) {
    CpuBufferOptions opt;
    opt.shrink = shrink;
    opt.metrics = metrics;
    opt.metrics_layers = metrics_layers;
    opt.provider = provider;
    opt.timeout = absl::Seconds(timeout_s);
    opt.num_proxy_threads = proxy_threads;
    Create(protocol::LlShape{T, H, E, R}, rank, std::move(allgather), opt);
  }

  // The backend interface both bindings share (call_from_addresses.h DefCallMethods): the pending operation when
  // split (the hook's), else the receive phase runs at once and the result is None. The stream handle is unused here.
  py::object Dispatch(const DispatchCall& c, bool split, uintptr_t /*stream*/) {
    CpuBuffer* buf = Live();
    return SendThenMaybeReceive([&] { return buf->DispatchSend(c); }, split);
  }

  py::object Combine(const CombineCall& c, bool split, uintptr_t /*stream*/) {
    CpuBuffer* buf = Live();
    return SendThenMaybeReceive([&] { return buf->CombineSend(c); }, split);
  }

  /// The receive phase (the hook). Releases the GIL while waiting: vLLM runs hooks from another thread.
  void Receive(const std::shared_ptr<PendingOp>& op, uintptr_t /*stream*/) {
    if (!op || op->seq() == 0) ThrowIfError(absl::FailedPreconditionError("receive hook already ran"));
    PendingOp taken = std::move(*op);
    absl::Status s;
    {
      py::gil_scoped_release nogil;
      s = Live()->Receive(std::move(taken));
    }
    ThrowIfError(s);
  }

  /// Writable memoryview of the zero-copy combine staging of the next call's half.
  py::memoryview NextCombineBuffer() {
    const protocol::LlShape& s = Live()->layout().shape;
    const int64_t bytes = int64_t{s.num_local_experts()} * s.max_recv_rows() * Live()->layout().combine_stride;
    return py::memoryview::from_memory(Live()->NextCombineBuffer(), bytes, /*readonly=*/false);
  }

  std::string transport() { return Live()->transport_name(); }

  void Clean(uintptr_t /*stream*/) {
    CpuBuffer* buf = Live();
    absl::Status s;
    {
      py::gil_scoped_release nogil;  // a barrier: may wait up to the timeout
      s = buf->Clean();
    }
    ThrowIfError(s);
  }
  void SetMasked(int rank, bool masked, uintptr_t /*stream*/) { ThrowIfError(Live()->SetMasked(rank, masked)); }
  void QueryMasks(uintptr_t out, uintptr_t /*stream*/) {
    const std::vector<int32_t> m = Live()->Masks();
    std::copy(m.begin(), m.end(), Ptr<int32_t>(out));
  }
  void ClearMasks(uintptr_t /*stream*/) { Live()->ClearMasks(); }

  absl::Status SnapshotMetrics(std::vector<uint64_t>* out) override {
    *out = Live()->MetricsSnapshot();
    return absl::OkStatus();
  }

 private:
  // Runs a send phase with the GIL released (it may wait on a full proxy ring); when not split, the receive phase
  // too. Returns the pending op (split) or None.
  template <typename SendFn>
  py::object SendThenMaybeReceive(SendFn&& send, bool split) {
    absl::StatusOr<PendingOp> op;
    absl::Status received;
    {
      py::gil_scoped_release nogil;
      op = send();
      if (op.ok() && !split) received = Live()->Receive(*std::move(op));
    }
    ThrowIfError(op.status());
    ThrowIfError(received);
    if (!split) return py::none();
    return py::cast(std::make_shared<PendingOp>(*std::move(op)));
  }
};

}  // namespace

void BindCpuBuffer(py::module_& m) {
  py::class_<PendingOp, std::shared_ptr<PendingOp>>(m, "PendingOp", "A sent operation waiting for its receive phase.")
      .def_property_readonly("seq", &PendingOp::seq);
  py::class_<PyCpuBuffer> c(m, "CpuBuffer", "One rank of the CPU backend (runtime/cpu_buffer.h).");
  BindMetricsMethods<PyCpuBuffer>(c);
  DefCallMethods<PyCpuBuffer>(c);
  c.def(py::init<int, int, int, int, int, py::function, const std::string&, double, int, bool, int, bool>(),
        py::arg("T"), py::arg("H"), py::arg("E"), py::arg("R"), py::arg("rank"), py::arg("allgather"),
        py::arg("provider"), py::arg("timeout_s"), py::arg("proxy_threads"), py::arg("metrics") = true,
        py::arg("metrics_layers") = base::kDefaultMetricsLayers, py::arg("shrink") = false)
      .def("receive", &PyCpuBuffer::Receive)
      .def("next_combine_buffer", &PyCpuBuffer::NextCombineBuffer)
      .def_property_readonly("combine_row_stride", &PyCpuBuffer::combine_row_stride)
      .def_property_readonly("buffer_bytes", &PyCpuBuffer::buffer_bytes)
      .def_property_readonly("transport", &PyCpuBuffer::transport)
      .def("close", &PyCpuBuffer::Close);
}

}  // namespace llep::bindings
