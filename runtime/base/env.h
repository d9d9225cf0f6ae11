// Every LLEP_* environment option of the library: read here and nowhere else, each with one default. The README's
// "Options" table has one row per name (tests/lint/check_options.py: no other library file, C++ or Python, reads an
// LLEP_* variable, and the README rows are exactly kOptionNames). Python gets them from `_llep.read_options()` and
// passes explicit arguments. Two knobs of kernels/host (LLEP_CPU_PORTABLE_FMA / _FP8) are read there, once each:
// that layer may not depend on abseil (STYLE.md §2), and they only pick between two bit-identical CPU code paths.
// Layer: runtime/base.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace llep::base {

/// MoE layers a buffer's counter block holds by default (LLEP_METRICS_LAYERS): DeepSeek-V3 has 61 layers, Qwen3-MoE
/// 94. A dispatch's `layer` keyword must be below the buffer's count.
inline constexpr int kDefaultMetricsLayers = 128;

struct Options {
  std::string backend;          ///< LLEP_BACKEND: "cuda" / "cpu"; "" = cuda when built with CUDA and a GPU is seen
  std::string fabric_provider;  ///< LLEP_FABRIC_PROVIDER: proxy transport; "" = automatic (runtime/gpu_buffer.h)
  std::string fabric_node;      ///< LLEP_FABRIC_NODE: address socket providers bind; "" = 127.0.0.1
  absl::Duration timeout = absl::Seconds(30);  ///< LLEP_TIMEOUT_S: receive wait before a silent peer is an error
  int proxy_threads = 1;                       ///< LLEP_PROXY_THREADS: >= 1
  int proxy_spin = 1 << 20;                    ///< LLEP_PROXY_SPIN: GPU proxy idle polls before it sleeps
  int num_ctas = 0;                            ///< LLEP_NUM_CTAS: CTAs per send launch; 0 = one per SM
  bool metrics = true;                         ///< LLEP_METRICS: 0 switches the device counters off
  bool kernel_trace = false;                   ///< LLEP_KERNEL_TRACE: 1 records the kernels' timeline
  int metrics_layers = kDefaultMetricsLayers;  ///< LLEP_METRICS_LAYERS: MoE layers counted apart (>= 1)
  int metrics_port = -1;                       ///< LLEP_METRICS_PORT: exporter base port; -1 (unset) = none
  std::string metrics_addr = "127.0.0.1";      ///< LLEP_METRICS_ADDR
  std::string metrics_labels;                  ///< LLEP_METRICS_LABELS: "k=v,k2=v2" constant labels
  double metrics_interval_s = 1.0;             ///< LLEP_METRICS_INTERVAL_S: snapshot period
  int ranks_per_node = 0;                      ///< LLEP_RANKS_PER_NODE: virtual-node size; 0 = by host
  std::string ib_device;                       ///< LLEP_IB_DEVICE: ibverbs device; "" = the first
  int ib_gid_index = 0;                        ///< LLEP_IB_GID_INDEX
  int log_level = 1;                           ///< LLEP_LOG_LEVEL: 0 error, 1 warning, 2 info, 3 debug
  bool as_deep_ep = true;     ///< LLEP_AS_DEEP_EP: 0 keeps the vLLM plugin from answering `import deep_ep`
  bool reuse_outputs = true;  ///< LLEP_REUSE_OUTPUTS: 0 makes every call allocate its outputs (llep/_output_pool.py)
};

inline constexpr const char* kOptionNames[] = {
    "LLEP_BACKEND",        "LLEP_FABRIC_PROVIDER",    "LLEP_FABRIC_NODE",      "LLEP_TIMEOUT_S",
    "LLEP_PROXY_THREADS",  "LLEP_PROXY_SPIN",         "LLEP_NUM_CTAS",         "LLEP_METRICS",
    "LLEP_KERNEL_TRACE",   "LLEP_METRICS_LAYERS",     "LLEP_METRICS_PORT",     "LLEP_METRICS_ADDR",
    "LLEP_METRICS_LABELS", "LLEP_METRICS_INTERVAL_S", "LLEP_RANKS_PER_NODE",   "LLEP_IB_DEVICE",
    "LLEP_IB_GID_INDEX",   "LLEP_LOG_LEVEL",          "LLEP_CPU_PORTABLE_FMA", "LLEP_CPU_PORTABLE_FP8",
    "LLEP_AS_DEEP_EP",     "LLEP_REUSE_OUTPUTS"};

/// Reads every option now (unset or empty = the default). InvalidArgument naming the variable for a value that does
/// not parse or is out of range, so a typo is an error instead of a silently ignored setting.
absl::StatusOr<Options> ReadOptions();

}  // namespace llep::base
