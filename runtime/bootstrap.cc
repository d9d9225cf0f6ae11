#include "runtime/bootstrap.h"

#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/base/status_macros.h"
#include "runtime/tcp_store.h"

namespace llep {

absl::StatusOr<std::vector<uint64_t>> Bootstrap::AllGatherU64(uint64_t value) {
  std::string mine(sizeof(value), '\0');
  std::memcpy(mine.data(), &value, sizeof(value));
  absl::StatusOr<std::vector<std::string>> all = AllGather(mine);
  if (!all.ok()) return all.status();
  std::vector<uint64_t> out(all->size());
  for (size_t r = 0; r < all->size(); ++r) {
    if ((*all)[r].size() != sizeof(value)) return absl::DataLossError("AllGatherU64: malformed contribution");
    std::memcpy(&out[r], (*all)[r].data(), sizeof(value));
  }
  return out;
}

std::string PackStringList(const std::vector<std::string>& items) {
  std::string out;
  const uint32_t n = static_cast<uint32_t>(items.size());
  out.append(reinterpret_cast<const char*>(&n), 4);
  for (const std::string& b : items) {
    const uint32_t len = static_cast<uint32_t>(b.size());
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += b;
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> UnpackStringList(const std::string& packed) {
  size_t off = 0;
  auto read_u32 = [&](uint32_t* v) {
    if (off + 4 > packed.size()) return false;
    std::memcpy(v, packed.data() + off, 4);
    off += 4;
    return true;
  };
  uint32_t n = 0;
  if (!read_u32(&n) || n > packed.size()) return absl::DataLossError("malformed string-list blob");
  std::vector<std::string> out;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t len = 0;
    if (!read_u32(&len) || off + len > packed.size()) return absl::DataLossError("truncated string-list blob");
    out.emplace_back(packed.substr(off, len));
    off += len;
  }
  if (off != packed.size()) return absl::DataLossError("trailing bytes after a string-list blob");
  return out;
}

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
