// The native module llep._llep (llep._llep_hip in the LLEP_GPU=hip build): layout queries, the CPU backend binding,
// the GPU backend binding when built, the output pool's count probe (output_pool_probe.cc) and the error classes.
#include <pybind11/pybind11.h>

#include "runtime/base/env.h"
#include "runtime/protocol/ll_layout.h"
#include "runtime/validate.h"
#include "server_hooks/bindings/status_to_python.h"

namespace llep::bindings {
void BindCpuBuffer(pybind11::module_& m);
void BindOutputPoolProbe(pybind11::module_& m);
#ifdef LLEP_HAVE_GPU
void BindGpuBuffer(pybind11::module_& m);
#endif
}  // namespace llep::bindings

#ifndef LLEP_MODULE_NAME
#define LLEP_MODULE_NAME _llep
#endif

PYBIND11_MODULE(LLEP_MODULE_NAME, m) {
  namespace py = pybind11;
  m.doc() = "llep native module (torch-independent: tensors cross as addresses and shapes)";
  llep::bindings::RegisterExceptions(m);
  m.def(
      "ll_buffer_bytes",
      [](int T, int H, int R, int E) {
        const llep::protocol::LlShape shape{T, H, E, R};
        llep::bindings::ThrowIfError(llep::ValidateShape(shape));
        return llep::protocol::ComputeLlLayout(shape).total_bytes;
      },
      py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"), py::arg("num_experts"),
      "Bytes of llep's double-buffered LL region for this shape.");
  m.def("deepep_v1_size_hint", &llep::protocol::DeepEpV1LowLatencySizeHint, py::arg("T"), py::arg("H"), py::arg("E"),
        "DeepEP V1's size hint for the same shape (for comparison only).");
  m.attr("MAX_TOPK") = llep::protocol::kMaxTopK;
  m.def(
      "read_options",
      [] {
        absl::StatusOr<llep::base::Options> o = llep::base::ReadOptions();
        llep::bindings::ThrowIfError(o.status());
        py::dict d;
        d["backend"] = o->backend;
        d["fabric_provider"] = o->fabric_provider;
        d["fabric_node"] = o->fabric_node;
        d["timeout_s"] = absl::ToDoubleSeconds(o->timeout);
        d["proxy_threads"] = o->proxy_threads;
        d["num_ctas"] = o->num_ctas;
        d["metrics"] = o->metrics;
        d["kernel_trace"] = o->kernel_trace;
        d["metrics_layers"] = o->metrics_layers;
        d["metrics_port"] = o->metrics_port;
        d["metrics_addr"] = o->metrics_addr;
        d["metrics_labels"] = o->metrics_labels;
        d["metrics_interval_s"] = o->metrics_interval_s;
        d["as_deep_ep"] = o->as_deep_ep;
        d["reuse_outputs"] = o->reuse_outputs;
        return d;
      },
      "The LLEP_* options the Python layer uses, read now (runtime/base/env.h: one read site, one default each; "
      "README 'Options'). Raises LlepInvalidArgumentError for a malformed value.");
  m.attr("OPTION_NAMES") = [] {
    py::list names;
    for (const char* n : llep::base::kOptionNames) names.append(n);
    return names;
  }();
  llep::bindings::BindCpuBuffer(m);
  llep::bindings::BindOutputPoolProbe(m);
  // HAVE_CUDA: a GPU backend for torch's "cuda" device, which a ROCm torch also calls "cuda"; GPU_PLATFORM says whose.
#ifdef LLEP_HAVE_GPU
  llep::bindings::BindGpuBuffer(m);
  m.attr("HAVE_CUDA") = true;
  m.attr("GPU_PLATFORM") = LLEP_GPU_PLATFORM;
#else
  m.attr("HAVE_CUDA") = false;
  m.attr("GPU_PLATFORM") = "none";
#endif
}
