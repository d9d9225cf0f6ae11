#include "runtime/bootstrap.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/base/status_macros.h"
#include "runtime/tcp_store.h"

namespace llep {
namespace {

class CallbackBootstrap final : public Bootstrap {
 public:
  CallbackBootstrap(int rank, int size, AllGatherFn fn) : rank_(rank), size_(size), fn_(std::move(fn)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::StatusOr<std::vector<std::string>> AllGather(const std::string& blob) override {
    LLEP_ASSIGN_OR_RETURN(std::vector<std::string> all, fn_(blob));
    if (static_cast<int>(all.size()) != size_) {
      return absl::InternalError(
          absl::StrCat("allgather callback returned ", all.size(), " blobs for ", size_, " ranks"));
    }
    if (all[rank_] != blob)
      return absl::InternalError("allgather callback did not return this rank's blob at its index");
    return all;
  }

 private:
  int rank_, size_;
  AllGatherFn fn_;
};

class StoreBootstrap final : public Bootstrap {
 public:
  StoreBootstrap(int rank, int size, std::unique_ptr<TcpStoreClient> client, std::string prefix, absl::Duration timeout)
      : rank_(rank), size_(size), client_(std::move(client)), prefix_(std::move(prefix)), timeout_(timeout) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::StatusOr<std::vector<std::string>> AllGather(const std::string& blob) override {
    const std::string round = absl::StrCat(prefix_, "/", round_++, "/");
    LLEP_RETURN_IF_ERROR(client_->Set(absl::StrCat(round, rank_), blob));
    std::vector<std::string> all(size_);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) {
        all[r] = blob;
        continue;
      }
      auto v = client_->Get(absl::StrCat(round, r), timeout_);
      if (!v.ok()) return base::Annotate(v.status(), absl::StrCat("bootstrap allgather waiting for rank ", r));
      all[r] = *std::move(v);
    }
    return all;
  }

 private:
  int rank_, size_;
  std::unique_ptr<TcpStoreClient> client_;
  std::string prefix_;
  absl::Duration timeout_;
  uint64_t round_ = 0;
};

}  // namespace

absl::Status Bootstrap::Barrier() { return AllGather(std::string()).status(); }

std::unique_ptr<Bootstrap> MakeCallbackBootstrap(int rank, int size, AllGatherFn allgather) {
  return std::make_unique<CallbackBootstrap>(rank, size, std::move(allgather));
}

std::unique_ptr<Bootstrap> MakeStoreBootstrap(int rank, int size, std::unique_ptr<TcpStoreClient> client,
                                              std::string prefix, absl::Duration timeout) {
  return std::make_unique<StoreBootstrap>(rank, size, std::move(client), std::move(prefix), timeout);
}

}  // namespace llep
