// Which path each peer takes: NVLink (CUDA IPC stores) or the CPU proxy (FIFO commands, RDMA writes).
// Layer: runtime. Pure decisions over what every rank published at setup, so all ranks compute the same answer for
// every pair; the GPU buffer gathers the inputs (host identity, P2P reachability) and applies the result.
//
// Rules: ranks are on one node when they share a host identity and, with a virtual-node split (ranks_per_node > 0,
// env LLEP_RANKS_PER_NODE or DeepEP's allow_nvlink_for_low_latency_mode=False = 1), the same group of
// ranks_per_node consecutive ranks. A pair on one node takes NVLink only if both ranks can map the other's memory
// (CUDA peer access, as each of them sees it); everything else goes through the proxy. A virtual split is how one
// host exercises the inter-node path (tests, benchmarks) without a NIC.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace llep {

enum class PeerPath { kSelf, kNvlink, kProxy };

const char* PeerPathName(PeerPath p);

/// `reach[a][b]`: rank a can map rank b's device memory (a's own report). `host_ids[r]`: rank r's host identity.
/// Returns paths[a][b] for every pair; symmetric by construction. Errors: inconsistent sizes, ranks_per_node < 0.
absl::StatusOr<std::vector<std::vector<PeerPath>>> DecidePeerPaths(const std::vector<std::string>& host_ids,
                                                                   const std::vector<std::vector<bool>>& reach,
                                                                   int ranks_per_node);

/// True when any pair of ranks needs the proxy (then every rank sets one up: the transports' setup is collective).
bool AnyProxyPath(const std::vector<std::vector<PeerPath>>& paths);

/// This machine's identity: hostname and kernel boot id, so two containers that share a hostname on different
/// machines (or a reused hostname after a reboot) never look like one host.
std::string HostIdentity();

}  // namespace llep
