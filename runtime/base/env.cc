#include "runtime/base/env.h"

#include <cstdlib>
#include <initializer_list>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runtime/base/status_macros.h"

namespace llep::base {
namespace {

// The only getenv of the library's LLEP_* options (kernels/host's two codec knobs excepted, see options.h).
std::string Raw(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

absl::Status Bad(const char* name, const std::string& v, const char* want) {
  return absl::InvalidArgumentError(absl::StrCat(name, "='", v, "': expected ", want));
}

absl::Status ReadInt(const char* name, int min, int* out) {
  const std::string v = Raw(name);
  if (v.empty()) return absl::OkStatus();
  int n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < min) return Bad(name, v, absl::StrCat("an integer >= ", min).c_str());
  *out = n;
  return absl::OkStatus();
}

absl::Status ReadDouble(const char* name, double min_exclusive, double* out) {
  const std::string v = Raw(name);
  if (v.empty()) return absl::OkStatus();
  double d = 0;
  if (!absl::SimpleAtod(v, &d) || !(d > min_exclusive)) {
    return Bad(name, v, absl::StrCat("a number > ", min_exclusive).c_str());
  }
  *out = d;
  return absl::OkStatus();
}

absl::Status ReadBool(const char* name, bool* out) {
  const std::string v = Raw(name);
  if (v.empty()) return absl::OkStatus();
  if (v != "0" && v != "1") return Bad(name, v, "0 or 1");
  *out = v == "1";
  return absl::OkStatus();
}

void ReadString(const char* name, std::string* out) {
  const std::string v = Raw(name);
  if (!v.empty()) *out = v;
}

absl::Status ReadChoice(const char* name, std::initializer_list<const char*> choices, std::string* out) {
  const std::string v = Raw(name);
  if (v.empty()) return absl::OkStatus();
  for (const char* c : choices) {
    if (v == c) {
      *out = v;
      return absl::OkStatus();
    }
  }
  return Bad(name, v, absl::StrCat("one of ", absl::StrJoin(choices, ", ")).c_str());
}

}  // namespace

absl::StatusOr<Options> ReadOptions() {
  Options o;
  LLEP_RETURN_IF_ERROR(ReadChoice("LLEP_BACKEND", {"cuda", "cpu"}, &o.backend));
  ReadString("LLEP_FABRIC_PROVIDER", &o.fabric_provider);
  ReadString("LLEP_FABRIC_NODE", &o.fabric_node);
  double timeout_s = absl::ToDoubleSeconds(o.timeout);
  LLEP_RETURN_IF_ERROR(ReadDouble("LLEP_TIMEOUT_S", 0.0, &timeout_s));
  o.timeout = absl::Seconds(timeout_s);
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_PROXY_THREADS", 1, &o.proxy_threads));
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_PROXY_SPIN", 0, &o.proxy_spin));
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_NUM_CTAS", 0, &o.num_ctas));
  LLEP_RETURN_IF_ERROR(ReadBool("LLEP_METRICS", &o.metrics));
  LLEP_RETURN_IF_ERROR(ReadBool("LLEP_KERNEL_TRACE", &o.kernel_trace));
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_METRICS_LAYERS", 1, &o.metrics_layers));
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_METRICS_PORT", 0, &o.metrics_port));
  ReadString("LLEP_METRICS_ADDR", &o.metrics_addr);
  ReadString("LLEP_METRICS_LABELS", &o.metrics_labels);
  LLEP_RETURN_IF_ERROR(ReadDouble("LLEP_METRICS_INTERVAL_S", 0.0, &o.metrics_interval_s));
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_RANKS_PER_NODE", 0, &o.ranks_per_node));
  ReadString("LLEP_IB_DEVICE", &o.ib_device);
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_IB_GID_INDEX", 0, &o.ib_gid_index));
  LLEP_RETURN_IF_ERROR(ReadInt("LLEP_LOG_LEVEL", 0, &o.log_level));
  LLEP_RETURN_IF_ERROR(ReadBool("LLEP_AS_DEEP_EP", &o.as_deep_ep));
  LLEP_RETURN_IF_ERROR(ReadBool("LLEP_REUSE_OUTPUTS", &o.reuse_outputs));
  return o;
}

}  // namespace llep::base
