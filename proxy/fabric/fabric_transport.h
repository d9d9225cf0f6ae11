// libfabric implementation of proxy/transport.h: an RDM endpoint, RMA writes with remote CQ data.
// Layer: proxy/fabric. Owned and driven by one proxy thread (FI_THREAD_DOMAIN).
// Providers: shm and tcp;ofi_rxm run in CI on loopback; verbs;ofi_rxm and efa use the same code path. Every
// mr_mode bit the provider returns is honoured (LOCAL: descriptors on every post; VIRT_ADDR: remote addresses
// are virtual, else offsets; PROV_KEY: key read back after registration; ENDPOINT: MR bound to the endpoint and
// enabled; ALLOCATED: regions are mmap'ed memory), and so is FI_RX_CQ_DATA (zero-byte receives stay posted
// for remote CQ data to land in).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "proxy/transport.h"

namespace llep::proxy {

struct FabricOptions {
  std::string provider = "shm";  ///< fi_info provider name, e.g. "shm", "tcp;ofi_rxm", "verbs;ofi_rxm", "efa".
  /// Address to bind; empty means the provider's default (required for shm). Loopback by default for sockets.
  std::string node = "127.0.0.1";
};

/// Opens fabric, domain, completion queue, address vector and endpoint for `options.provider`.
absl::StatusOr<std::unique_ptr<Transport>> CreateFabricTransport(const FabricOptions& options);

/// Providers fi_getinfo reports with RMA + remote CQ data on this host (for diagnostics and test selection).
std::vector<std::string> ListFabricProviders();

}  // namespace llep::proxy
