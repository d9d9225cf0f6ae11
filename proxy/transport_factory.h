// One place that turns a transport name into a proxy transport, so buffers and tools accept the same names.
// Layer: proxy. "ibverbs" is the native RC backend (proxy/verbs); anything else is a libfabric provider name
// ("shm", "tcp;ofi_rxm", "verbs;ofi_rxm", "efa", ...).
#pragma once

#include <memory>
#include <string>

#include "proxy/transport.h"

namespace llep::proxy {

inline constexpr char kIbverbsTransport[] = "ibverbs";

/// `node`: address to bind for socket providers (libfabric; empty = the default), ignored by shm and ibverbs.
/// `rank` / `num_ranks`: this rank among the ranks Connect will name (ibverbs creates one RC QP per peer up front).
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const std::string& name, const std::string& node, int rank,
                                                           int num_ranks);

}  // namespace llep::proxy
