// Built instead of verbs_transport.cc when llep is configured with LLEP_WITH_VERBS=OFF (no rdma-core headers).
#include "proxy/verbs/verbs_transport.h"

namespace llep::proxy {

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const VerbsOptions&) {
  return absl::UnimplementedError("llep was built without ibverbs (LLEP_WITH_VERBS=OFF)");
}

absl::Status RegisterDmabufRegion(Transport& t, void*, uint64_t, int, uint64_t) {
  return absl::UnimplementedError(t.Name() + " cannot register dma-buf memory (built without ibverbs)");
}

}  // namespace llep::proxy
