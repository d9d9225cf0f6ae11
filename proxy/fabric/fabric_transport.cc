#include "proxy/fabric/fabric_transport.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "runtime/base/status_macros.h"
#include "runtime/protocol/hd.h"

namespace llep::proxy {
namespace {

constexpr uint32_t kFabricApiVersion = FI_VERSION(1, 14);
// Key requested when the provider lets the application choose (no FI_MR_PROV_KEY): one region per domain.
constexpr uint64_t kRequestedKey = 0x11e9;
constexpr int kPostedRecvs = 256;

absl::Status FiError(int rc, absl::string_view call) {
  const std::string msg = absl::StrCat(call, " failed: ", fi_strerror(-rc), " (", rc, ")");
  // No matching provider / capability on this fabric: unavailable here, not an internal error.
  if (-rc == FI_ENODATA || -rc == FI_ENOSYS) return absl::UnavailableError(msg);
  // Other FI_E* codes are errno values (rdma/fi_errno.h), so errno's mapping applies.
  return absl::Status(base::ErrnoCode(-rc), msg);
}

#define LLEP_FI_RETURN_IF_ERROR(expr)                         \
  do {                                                        \
    const int llep_fi_rc_ = static_cast<int>(expr);           \
    if (llep_fi_rc_ != 0) return FiError(llep_fi_rc_, #expr); \
  } while (0)

struct InfoDeleter {
  void operator()(fi_info* p) const { fi_freeinfo(p); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

bool IsShm(const std::string& provider) { return provider.rfind("shm", 0) == 0; }

absl::StatusOr<InfoPtr> GetInfo(const FabricOptions& options) {
  InfoPtr hints(fi_allocinfo());
  if (!hints) return absl::ResourceExhaustedError("fi_allocinfo");
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  // Modes we support: we pass a fi_context2 with every operation and keep receives posted if asked.
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->fabric_attr->prov_name = strdup(options.provider.c_str());
  const bool use_node = !IsShm(options.provider) && !options.node.empty();
  fi_info* info = nullptr;
  const int rc = fi_getinfo(kFabricApiVersion, use_node ? options.node.c_str() : nullptr, nullptr,
                            use_node ? FI_SOURCE : 0, hints.get(), &info);
  if (rc != 0) {
    return base::Annotate(FiError(rc, "fi_getinfo"), absl::StrCat("libfabric provider '", options.provider, "'"));
  }
  InfoPtr result(info);
  if (IsShm(options.provider) && result->addr_format == FI_ADDR_STR) {
    // The shm provider names its shared-memory region after the process id unless given a name. A rank that was
    // killed leaves that region behind, and a later process that gets the same pid then fails fi_enable with EBUSY
    // (seen in the fault tests, which kill ranks). A name with a per-process random part does not collide.
    static const uint64_t nonce = [] {
      std::random_device rd;
      return protocol::JoinHalves(rd(), rd()) ^ static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
    }();
    static std::atomic<uint32_t> next{0};
    const std::string name = absl::StrCat("fi_shm://llep_", getpid(), "_", absl::Hex(nonce), "_", next++);
    free(result->src_addr);
    result->src_addr = strdup(name.c_str());
    result->src_addrlen = name.size() + 1;
  }
  // The first entry is the provider's preferred configuration; require remote CQ data wide enough for our imm.
  if (result->domain_attr->cq_data_size < 4) {
    return absl::UnimplementedError(absl::StrCat("provider '", options.provider, "' carries only ",
                                                 result->domain_attr->cq_data_size, " bytes of remote CQ data"));
  }
  return result;
}

struct OpContext {
  fi_context2 ctx;  // must be first: libfabric hands this pointer back as op_context
  uint64_t cookie = 0;
  bool is_recv = false;
};

class FabricTransport final : public Transport {
 public:
  ~FabricTransport() override {
    if (mr_ != nullptr) fi_close(&mr_->fid);
    if (ep_ != nullptr) fi_close(&ep_->fid);
    if (av_ != nullptr) fi_close(&av_->fid);
    if (cq_ != nullptr) fi_close(&cq_->fid);
    if (domain_ != nullptr) fi_close(&domain_->fid);
    if (fabric_ != nullptr) fi_close(&fabric_->fid);
  }

  absl::Status Open(const FabricOptions& options) {
    LLEP_ASSIGN_OR_RETURN(info_, GetInfo(options));
    name_ = absl::StrCat("libfabric/", info_->fabric_attr->prov_name);
    LLEP_FI_RETURN_IF_ERROR(fi_fabric(info_->fabric_attr, &fabric_, nullptr));
    LLEP_FI_RETURN_IF_ERROR(fi_domain(fabric_, info_.get(), &domain_, nullptr));
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_DATA;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 0;  // provider default
    LLEP_FI_RETURN_IF_ERROR(fi_cq_open(domain_, &cq_attr, &cq_, nullptr));
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    LLEP_FI_RETURN_IF_ERROR(fi_av_open(domain_, &av_attr, &av_, nullptr));
    LLEP_FI_RETURN_IF_ERROR(fi_endpoint(domain_, info_.get(), &ep_, nullptr));
    LLEP_FI_RETURN_IF_ERROR(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV));
    LLEP_FI_RETURN_IF_ERROR(fi_ep_bind(ep_, &av_->fid, 0));
    LLEP_FI_RETURN_IF_ERROR(fi_enable(ep_));
    const size_t tx_depth = info_->tx_attr->size > 0 ? info_->tx_attr->size : 256;
    tx_contexts_.resize(tx_depth);
    for (auto& c : tx_contexts_) free_tx_.push_back(&c);
    max_write_ = info_->ep_attr->max_msg_size > 0 ? info_->ep_attr->max_msg_size : (uint64_t{1} << 30);
    if ((info_->mode & FI_RX_CQ_DATA) != 0) {
      // Remote CQ data consumes a posted receive: keep as many posted as the receive queue holds (at most 256).
      const size_t rx_depth = info_->rx_attr->size > 0 ? info_->rx_attr->size : kPostedRecvs;
      rx_contexts_.resize(std::min<size_t>(kPostedRecvs, rx_depth));
      for (auto& c : rx_contexts_) {
        c.is_recv = true;
        LLEP_RETURN_IF_ERROR(PostRecv(&c));
      }
    }
    return absl::OkStatus();
  }

  std::string Name() const override { return name_; }

  absl::Status RegisterRegion(void* base, uint64_t bytes) override {
    if (mr_ != nullptr) return absl::FailedPreconditionError("region already registered");
    const uint64_t mode = info_->domain_attr->mr_mode;
    LLEP_FI_RETURN_IF_ERROR(
        fi_mr_reg(domain_, base, bytes, FI_WRITE | FI_REMOTE_WRITE, 0, kRequestedKey, 0, &mr_, nullptr));
    if ((mode & FI_MR_ENDPOINT) != 0) {
      LLEP_FI_RETURN_IF_ERROR(fi_mr_bind(mr_, &ep_->fid, 0));
      LLEP_FI_RETURN_IF_ERROR(fi_mr_enable(mr_));
    }
    base_ = static_cast<uint8_t*>(base);
    bytes_ = bytes;
    desc_ = fi_mr_desc(mr_);
    key_ = fi_mr_key(mr_);
    if (key_ == FI_KEY_NOTAVAIL) return absl::UnimplementedError("provider needs raw MR keys (FI_MR_RAW)");
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> LocalBlob() const override {
    if (mr_ == nullptr) return absl::FailedPreconditionError("LocalBlob before RegisterRegion");
    char addr[256];
    size_t len = sizeof(addr);
    LLEP_FI_RETURN_IF_ERROR(fi_getname(&ep_->fid, addr, &len));
    Blob b{};
    b.key = key_;
    b.base = reinterpret_cast<uint64_t>(base_);
    b.bytes = bytes_;
    b.addr_len = static_cast<uint32_t>(len);
    std::string out(reinterpret_cast<const char*>(&b), sizeof(b));
    out.append(addr, len);
    return out;
  }

  absl::Status Connect(const std::vector<std::string>& blobs) override {
    peers_.clear();
    for (size_t r = 0; r < blobs.size(); ++r) {
      Blob b{};
      if (blobs[r].size() < sizeof(b)) return absl::InvalidArgumentError(absl::StrCat("short blob from rank ", r));
      std::memcpy(&b, blobs[r].data(), sizeof(b));
      if (blobs[r].size() != sizeof(b) + b.addr_len) {
        return absl::InvalidArgumentError(absl::StrCat("malformed blob from rank ", r));
      }
      Peer p;
      p.key = b.key;
      p.bytes = b.bytes;
      // FI_MR_VIRT_ADDR: target addresses are the peer's virtual addresses; otherwise offsets into its region.
      p.base = (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) != 0 ? b.base : 0;
      const int n = fi_av_insert(av_, blobs[r].data() + sizeof(b), 1, &p.addr, 0, nullptr);
      if (n != 1) return FiError(n < 0 ? n : -FI_EINVAL, absl::StrCat("fi_av_insert(rank ", r, ")"));
      peers_.push_back(p);
    }
    return absl::OkStatus();
  }

  uint64_t MaxWriteBytes() const override { return max_write_; }

  absl::StatusOr<bool> PostWrite(int peer, uint64_t local_off, uint64_t remote_off, uint64_t bytes, uint32_t imm,
                                 uint64_t cookie) override {
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("write to unknown rank ", peer));
    }
    const Peer& p = peers_[peer];
    if (local_off + bytes > bytes_ || remote_off + bytes > p.bytes) {
      return absl::OutOfRangeError(
          absl::StrCat("write [", remote_off, ", +", bytes, ") outside the registered region"));
    }
    if (free_tx_.empty()) return false;
    OpContext* c = free_tx_.back();
    c->cookie = cookie;
    const ssize_t rc = fi_writedata(ep_, base_ + local_off, bytes, desc_, imm, p.addr, p.base + remote_off, p.key, c);
    if (rc == -FI_EAGAIN) return false;
    if (rc != 0) return FiError(static_cast<int>(rc), "fi_writedata");
    free_tx_.pop_back();
    return true;
  }

  absl::StatusOr<int> Poll(Completion* out, int max) override {
    fi_cq_data_entry entries[32];
    const int want = max < 32 ? max : 32;
    const ssize_t n = fi_cq_read(cq_, entries, want);
    if (n == -FI_EAGAIN) return 0;
    if (n == -FI_EAVAIL) return ReadError();
    if (n < 0) return FiError(static_cast<int>(n), "fi_cq_read");
    int produced = 0;
    for (ssize_t i = 0; i < n; ++i) {
      const fi_cq_data_entry& e = entries[i];
      // Filter on FI_REMOTE_CQ_DATA, not FI_RMA: rxm reports remote writes without FI_RMA. The op_context of a
      // remote write is undefined unless it consumed one of our posted receives (FI_RX_CQ_DATA), so it is only
      // dereferenced when it points into our own context arrays.
      if ((e.flags & FI_REMOTE_CQ_DATA) != 0) {
        out[produced++] = Completion{Completion::Kind::kRemoteImm, 0, static_cast<uint32_t>(e.data)};
        if (OpContext* c = Owned(rx_contexts_, e.op_context)) LLEP_RETURN_IF_ERROR(PostRecv(c));
      } else if (OpContext* c = Owned(tx_contexts_, e.op_context)) {
        out[produced++] = Completion{Completion::Kind::kWriteDone, c->cookie, 0};
        free_tx_.push_back(c);
      }
    }
    return produced;
  }

 private:
  struct Blob {
    uint64_t key;
    uint64_t base;
    uint64_t bytes;
    uint32_t addr_len;
    uint32_t reserved;
  };
  struct Peer {
    fi_addr_t addr = FI_ADDR_UNSPEC;
    uint64_t key = 0;
    uint64_t base = 0;
    uint64_t bytes = 0;
  };

  static OpContext* Owned(std::vector<OpContext>& pool, void* p) {
    if (pool.empty()) return nullptr;
    const auto addr = reinterpret_cast<uintptr_t>(p);
    const auto lo = reinterpret_cast<uintptr_t>(pool.data()),
               hi = reinterpret_cast<uintptr_t>(pool.data() + pool.size());
    if (addr < lo || addr >= hi || (addr - lo) % sizeof(OpContext) != 0) return nullptr;
    return static_cast<OpContext*>(p);
  }

  absl::Status PostRecv(OpContext* c) {
    // Bounded: a receive queue that never frees a slot is a provider failure, not something to spin on.
    for (int attempt = 0; attempt < 1000000; ++attempt) {
      const ssize_t rc = fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, c);
      if (rc == 0) return absl::OkStatus();
      if (rc != -FI_EAGAIN) return FiError(static_cast<int>(rc), "fi_recv");
      fi_cq_data_entry ignored;
      (void)fi_cq_read(cq_, &ignored, 0);  // progress, then retry
    }
    return absl::ResourceExhaustedError(absl::StrCat(name_, ": receive queue stays full (fi_recv -FI_EAGAIN)"));
  }

  absl::Status ReadError() {
    fi_cq_err_entry err{};
    const ssize_t rc = fi_cq_readerr(cq_, &err, 0);
    if (rc < 0) return FiError(static_cast<int>(rc), "fi_cq_readerr");
    const char* detail = fi_cq_strerror(cq_, err.prov_errno, err.err_data, nullptr, 0);
    return absl::UnavailableError(absl::StrCat(name_, " completion error: ", fi_strerror(err.err),
                                               " (provider: ", detail != nullptr ? detail : "?", ")"));
  }

  InfoPtr info_;
  std::string name_;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  fid_mr* mr_ = nullptr;
  void* desc_ = nullptr;
  uint64_t key_ = 0;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t max_write_ = 0;
  std::vector<OpContext> tx_contexts_;
  std::vector<OpContext*> free_tx_;
  std::vector<OpContext> rx_contexts_;
  std::vector<Peer> peers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateFabricTransport(const FabricOptions& options) {
  auto t = std::make_unique<FabricTransport>();
  LLEP_RETURN_IF_ERROR(t->Open(options));
  return std::unique_ptr<Transport>(std::move(t));
}

std::vector<std::string> ListFabricProviders() {
  InfoPtr hints(fi_allocinfo());
  std::vector<std::string> out;
  if (!hints) return out;
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  fi_info* info = nullptr;
  if (fi_getinfo(kFabricApiVersion, nullptr, nullptr, 0, hints.get(), &info) != 0) return out;
  std::set<std::string> seen;
  for (fi_info* i = info; i != nullptr; i = i->next) {
    if (i->domain_attr->cq_data_size >= 4 && seen.insert(i->fabric_attr->prov_name).second) {
      out.emplace_back(i->fabric_attr->prov_name);
    }
  }
  fi_freeinfo(info);
  return out;
}

}  // namespace llep::proxy
