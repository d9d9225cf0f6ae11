// Native ibverbs implementation of proxy/transport.h: reliable-connected (RC) queue pairs, one per peer, RDMA
// write-with-immediate, one completion queue and one shared receive queue per transport. Layer: proxy/verbs. Owned and
// driven by one proxy thread.
//
// Why a native backend next to libfabric's verbs;ofi_rxm: RC gives in-order execution per QP and real RDMA atomics
// without rxm's emulation layer, and it is what ConnectX / Thor-2 / Pollara / irdma NICs run best. Where the device
// reports atomics (OrderedAtomics), the proxy sends data as plain RDMA writes and each signal as a fetch-and-add onto
// the peer's signal word on the same QP, after the data: the receiving CPU does nothing. Without atomics every write
// carries an immediate and the receiver counts them (proxy/arrival_counter.h), exactly as over unordered EFA.
//
// Memory: RegisterRegion registers host memory (ibv_reg_mr); RegisterDmabuf registers device memory exported as a
// dma-buf (ibv_reg_dmabuf_mr; the runtime obtains the fd from CUDA). Receives: RC write-with-immediate consumes one
// posted receive per arriving write, so zero-length receives are kept posted on the SRQ and re-posted per completion.
//
// This machine class (CI) has no RDMA device: the backend compiles and links everywhere, and creating it without a
// device returns Unavailable (tested); the data path runs only where a NIC exists.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "proxy/transport.h"

namespace llep::proxy {

struct VerbsOptions {
  int rank = 0;        ///< this rank (index into the blobs Connect receives)
  int num_ranks = 1;   ///< one RC QP is created per other rank before LocalBlob
  std::string device;  ///< ibv device name ("mlx5_0"); empty = env LLEP_IB_DEVICE, else the first device
  int port = 1;
  int gid_index = -1;      ///< -1 = env LLEP_IB_GID_INDEX, else 0 (RoCE v2 setups often need 3)
  int queue_depth = 1024;  ///< send WRs per QP and receives kept posted on the SRQ
};

/// Opens the device, protection domain, CQ, SRQ and one RC QP per peer (state INIT until Connect).
absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const VerbsOptions& options);

/// Registers a dma-buf (device memory) as the transport's region instead of RegisterRegion: `fd` and `offset`
/// describe the buffer as exported, `base` is its virtual address in this process (used for local offsets), `bytes`
/// its length. Unimplemented unless `t` is a verbs transport.
absl::Status RegisterDmabufRegion(Transport& t, void* base, uint64_t bytes, int fd, uint64_t offset);

}  // namespace llep::proxy
