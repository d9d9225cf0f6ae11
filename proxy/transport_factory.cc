#include "proxy/transport_factory.h"

#include "proxy/fabric/fabric_transport.h"
#include "proxy/verbs/verbs_transport.h"

namespace llep::proxy {

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const std::string& name, const std::string& node, int rank,
                                                           int num_ranks) {
  if (name == kIbverbsTransport) {
    VerbsOptions vo;
    vo.rank = rank;
    vo.num_ranks = num_ranks;
    return CreateVerbsTransport(vo);
  }
  FabricOptions fo;
  fo.provider = name;
  if (!node.empty()) fo.node = node;  // fabric_transport binds no address for shm
  return CreateFabricTransport(fo);
}

}  // namespace llep::proxy
