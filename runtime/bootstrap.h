// Out-of-band exchange of per-rank blobs (endpoint addresses, memory keys, later CUDA IPC handles).
// Layer: runtime. Two implementations: a caller-supplied allgather callback (torch.distributed from Python) and
// a TCP key-value store (tcp_store.h) so C++ programs and tests need no Python. Collective calls must be made
// by all ranks in the same order; a Bootstrap is used by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace llep {

class TcpStoreClient;

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Every rank contributes `blob`; returns all blobs indexed by rank.
  virtual absl::StatusOr<std::vector<std::string>> AllGather(const std::string& blob) = 0;
  /// Returns once every rank called Barrier (an AllGather of nothing).
  absl::Status Barrier();
  /// Every rank contributes one number; returns all of them indexed by rank (e.g. where each rank's call sequence
  /// stands, when the ranks re-align after a failed call).
  absl::StatusOr<std::vector<uint64_t>> AllGatherU64(uint64_t value);
};

/// A list of byte strings as one blob ([u32 count] then per entry [u32 length][bytes]), for AllGather of several
/// values (e.g. one endpoint address per proxy thread).
std::string PackStringList(const std::vector<std::string>& items);
/// The inverse; DataLoss for a truncated or malformed blob.
absl::StatusOr<std::vector<std::string>> UnpackStringList(const std::string& packed);

using AllGatherFn = std::function<absl::StatusOr<std::vector<std::string>>(const std::string& blob)>;

/// Wraps an external allgather (e.g. torch.distributed.all_gather_object). The callback's result must have
/// `size` entries; anything else is reported as an error.
std::unique_ptr<Bootstrap> MakeCallbackBootstrap(int rank, int size, AllGatherFn allgather);

/// AllGather over a TCP store: each round writes "<prefix>/<round>/<rank>" and reads all others' keys.
std::unique_ptr<Bootstrap> MakeStoreBootstrap(int rank, int size, std::unique_ptr<TcpStoreClient> client,
                                              std::string prefix, absl::Duration timeout);

}  // namespace llep
