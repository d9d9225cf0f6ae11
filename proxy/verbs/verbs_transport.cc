#include "proxy/verbs/verbs_transport.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/base/env.h"
#include "runtime/base/status_macros.h"

namespace llep::proxy {
namespace {

constexpr uint32_t kBlobMagic = 0x4C4C5652;  // "LLVR"

// What a peer needs to connect to us: addressing, the region's address and key, and the QP number we created for
// each rank (qpn[r] is our end of the pair (us, r)).
struct BlobHeader {
  uint32_t magic;
  uint32_t num_ranks;
  uint16_t lid;
  uint8_t gid[16];
  uint32_t mtu;  // ibv_mtu
  uint64_t base;
  uint32_t rkey;
};

absl::Status Errno(absl::string_view what) { return absl::UnavailableError(absl::StrCat(what, ": ", strerror(errno))); }

class VerbsTransport final : public Transport {
 public:
  explicit VerbsTransport(const VerbsOptions& o) : opt_(o) {}
  ~VerbsTransport() override {
    for (ibv_qp* qp : qps_) {
      if (qp != nullptr) ibv_destroy_qp(qp);
    }
    if (srq_ != nullptr) ibv_destroy_srq(srq_);
    if (cq_ != nullptr) ibv_destroy_cq(cq_);
    if (mr_ != nullptr) ibv_dereg_mr(mr_);
    if (atomic_mr_ != nullptr) ibv_dereg_mr(atomic_mr_);
    if (pd_ != nullptr) ibv_dealloc_pd(pd_);
    if (ctx_ != nullptr) ibv_close_device(ctx_);
  }

  absl::Status Open() {
    if (opt_.num_ranks < 1 || opt_.rank < 0 || opt_.rank >= opt_.num_ranks || opt_.queue_depth < 1) {
      return absl::InvalidArgumentError(absl::StrCat("verbs transport: rank ", opt_.rank, " of ", opt_.num_ranks,
                                                     ", queue depth ", opt_.queue_depth));
    }
    LLEP_ASSIGN_OR_RETURN(const base::Options env, base::ReadOptions());
    LLEP_RETURN_IF_ERROR(OpenDevice(opt_.device.empty() ? env.ib_device : opt_.device));
    LLEP_RETURN_IF_ERROR(QueryPort(opt_.gid_index >= 0 ? opt_.gid_index : env.ib_gid_index));
    LLEP_RETURN_IF_ERROR(CreateQueues());
    return CreateQueuePairs();
  }

  std::string Name() const override { return name_; }

  absl::Status RegisterRegion(void* base, uint64_t bytes) override {
    if (mr_ != nullptr) return absl::FailedPreconditionError("verbs transport: region already registered");
    mr_ = ibv_reg_mr(pd_, base, bytes, kAccess);
    if (mr_ == nullptr) return Errno("ibv_reg_mr");
    base_ = static_cast<uint8_t*>(base);
    bytes_ = bytes;
    return absl::OkStatus();
  }

  absl::Status RegisterDmabuf(void* base, uint64_t bytes, int fd, uint64_t offset) {
    if (mr_ != nullptr) return absl::FailedPreconditionError("verbs transport: region already registered");
    mr_ = ibv_reg_dmabuf_mr(pd_, offset, bytes, reinterpret_cast<uint64_t>(base), fd, kAccess);
    if (mr_ == nullptr) return Errno("ibv_reg_dmabuf_mr (GPU memory through dma-buf)");
    base_ = static_cast<uint8_t*>(base);
    bytes_ = bytes;
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> LocalBlob() const override {
    if (mr_ == nullptr) return absl::FailedPreconditionError("verbs transport: register the region first");
    BlobHeader h{};
    h.magic = kBlobMagic;
    h.num_ranks = static_cast<uint32_t>(opt_.num_ranks);
    h.lid = port_.lid;
    std::memcpy(h.gid, gid_.raw, sizeof(h.gid));
    h.mtu = static_cast<uint32_t>(port_.active_mtu);
    h.base = reinterpret_cast<uint64_t>(base_);
    h.rkey = mr_->rkey;
    std::string blob(reinterpret_cast<const char*>(&h), sizeof(h));
    for (int r = 0; r < opt_.num_ranks; ++r) {
      const uint32_t qpn = qps_[r] != nullptr ? qps_[r]->qp_num : 0;
      blob.append(reinterpret_cast<const char*>(&qpn), sizeof(qpn));
    }
    return blob;
  }

  absl::Status Connect(const std::vector<std::string>& blobs) override {
    if (static_cast<int>(blobs.size()) != opt_.num_ranks) {
      return absl::InvalidArgumentError(absl::StrCat(blobs.size(), " blobs for ", opt_.num_ranks, " ranks"));
    }
    peers_.assign(opt_.num_ranks, Peer{});
    for (int r = 0; r < opt_.num_ranks; ++r) {
      if (r == opt_.rank) continue;
      BlobHeader h{};
      const size_t want = sizeof(h) + sizeof(uint32_t) * static_cast<size_t>(opt_.num_ranks);
      if (blobs[r].size() != want) return absl::DataLossError(absl::StrCat("rank ", r, ": bad verbs blob size"));
      std::memcpy(&h, blobs[r].data(), sizeof(h));
      if (h.magic != kBlobMagic || static_cast<int>(h.num_ranks) != opt_.num_ranks) {
        return absl::FailedPreconditionError(absl::StrCat("rank ", r, " is not an ibverbs transport of this job"));
      }
      uint32_t remote_qpn = 0;
      std::memcpy(&remote_qpn, blobs[r].data() + sizeof(h) + sizeof(uint32_t) * opt_.rank, sizeof(remote_qpn));
      peers_[r] = Peer{h.base, h.rkey};
      if (absl::Status s = ToRts(qps_[r], h, remote_qpn); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("connecting to rank ", r, ": ", s.message()));
      }
    }
    return absl::OkStatus();
  }

  uint64_t MaxWriteBytes() const override { return port_.max_msg_sz; }

  absl::StatusOr<bool> PostWrite(int peer, uint64_t local_off, uint64_t remote_off, uint64_t bytes, uint32_t imm,
                                 uint64_t cookie) override {
    if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
    if (local_off + bytes > bytes_) return absl::OutOfRangeError("verbs write leaves the registered region");
    if (outstanding_[peer] >= opt_.queue_depth) return false;  // send queue full: poll, then retry
    ibv_sge sge{reinterpret_cast<uint64_t>(base_) + local_off, static_cast<uint32_t>(bytes), mr_->lkey};
    ibv_send_wr wr{};
    wr.opcode = imm != 0 ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = peers_[peer].base + remote_off;
    wr.wr.rdma.rkey = peers_[peer].rkey;
    return Submit(peer, cookie, &sge, &wr, "write");
  }

  // RC: a QP executes its requests in order at the responder, so an atomic after writes lands after them.
  bool OrderedAtomics() const override { return atomics_; }

  absl::StatusOr<bool> PostAtomicAdd(int peer, uint64_t remote_off, uint64_t add, uint64_t cookie) override {
    if (!atomics_) return absl::UnimplementedError(absl::StrCat(name_, " reports no RDMA atomics"));
    if (absl::Status s = CheckPeer(peer); !s.ok()) return s;
    if ((remote_off & 7) != 0) return absl::InvalidArgumentError("remote atomic target must be 8-byte aligned");
    if (outstanding_[peer] >= opt_.queue_depth) return false;
    ibv_sge sge{reinterpret_cast<uint64_t>(&atomic_result_), sizeof(atomic_result_), atomic_mr_->lkey};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.wr.atomic.remote_addr = peers_[peer].base + remote_off;
    wr.wr.atomic.compare_add = add;
    wr.wr.atomic.rkey = peers_[peer].rkey;
    return Submit(peer, cookie, &sge, &wr, "atomic");
  }

  absl::StatusOr<int> Poll(Completion* out, int max) override {
    ibv_wc wc[32];
    const int n = ibv_poll_cq(cq_, max < 32 ? max : 32, wc);
    if (n < 0) return absl::UnavailableError("ibv_poll_cq failed");
    int k = 0;
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        return absl::UnavailableError(absl::StrCat("ibverbs completion error: ", ibv_wc_status_str(wc[i].status),
                                                   " (vendor error ", wc[i].vendor_err, ")"));
      }
      if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        out[k++] = Completion{Completion::Kind::kRemoteImm, 0, ntohl(wc[i].imm_data)};
        if (absl::Status s = PostReceive(); !s.ok()) return s;
      } else if (wc[i].opcode == IBV_WC_RDMA_WRITE || wc[i].opcode == IBV_WC_FETCH_ADD) {
        const Slot slot = slots_[wc[i].wr_id];
        FreeSlot(wc[i].wr_id);
        --outstanding_[slot.peer];
        out[k++] = Completion{Completion::Kind::kWriteDone, slot.cookie, 0};
      }
    }
    return k;
  }

 private:
  /// Opens the device named `want` (the first one when empty).
  absl::Status OpenDevice(const std::string& want) {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr || n == 0) {
      const absl::Status s = absl::UnavailableError(
          absl::StrCat("ibverbs: no RDMA devices (", list == nullptr ? strerror(errno) : "empty device list",
                       "); use a libfabric provider instead"));
      if (list != nullptr) ibv_free_device_list(list);
      return s;
    }
    ibv_device* dev = nullptr;
    for (int i = 0; i < n && dev == nullptr; ++i) {
      if (want.empty() || want == ibv_get_device_name(list[i])) dev = list[i];
    }
    if (dev == nullptr) {
      ibv_free_device_list(list);
      return absl::NotFoundError(absl::StrCat("ibverbs: no device named '", want, "'"));
    }
    name_ = absl::StrCat("ibverbs/", ibv_get_device_name(dev));
    ctx_ = ibv_open_device(dev);
    ibv_free_device_list(list);
    if (ctx_ == nullptr) return Errno("ibv_open_device");
    return absl::OkStatus();
  }

  /// The port must be active; its GID at `gid_index` addresses us on RoCE.
  absl::Status QueryPort(int gid_index) {
    if (ibv_query_port(ctx_, static_cast<uint8_t>(opt_.port), &port_) != 0) return Errno("ibv_query_port");
    if (port_.state != IBV_PORT_ACTIVE) {
      return absl::UnavailableError(absl::StrCat(name_, " port ", opt_.port, " is not active"));
    }
    gid_index_ = gid_index;
    if (ibv_query_gid(ctx_, static_cast<uint8_t>(opt_.port), gid_index_, &gid_) != 0) return Errno("ibv_query_gid");
    return absl::OkStatus();
  }

  /// Protection domain, device limits, the atomics' scratch word, one completion queue for every QP and one shared
  /// receive queue (immediates from any peer land there), filled with receives.
  absl::Status CreateQueues() {
    if ((pd_ = ibv_alloc_pd(ctx_)) == nullptr) return Errno("ibv_alloc_pd");
    ibv_device_attr dev_attr{};
    if (ibv_query_device(ctx_, &dev_attr) != 0) return Errno("ibv_query_device");
    atomics_ = dev_attr.atomic_cap != IBV_ATOMIC_NONE;
    // Outstanding RDMA reads / atomics per QP, within what the device allows as responder and initiator.
    max_dest_rd_atomic_ = static_cast<uint8_t>(dev_attr.max_qp_rd_atom < 16 ? dev_attr.max_qp_rd_atom : 16);
    max_rd_atomic_ = static_cast<uint8_t>(dev_attr.max_qp_init_rd_atom < 16 ? dev_attr.max_qp_init_rd_atom : 16);
    // Atomics return the old value into local memory: one registered scratch word (its value is never read).
    if ((atomic_mr_ = ibv_reg_mr(pd_, &atomic_result_, sizeof(atomic_result_), IBV_ACCESS_LOCAL_WRITE)) == nullptr) {
      return Errno("ibv_reg_mr (atomic scratch)");
    }
    const int peers = opt_.num_ranks - 1;
    const int cqe = opt_.queue_depth * (peers + 1) + 16;
    if ((cq_ = ibv_create_cq(ctx_, cqe, nullptr, nullptr, 0)) == nullptr) return Errno("ibv_create_cq");
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = static_cast<uint32_t>(opt_.queue_depth);
    sa.attr.max_sge = 1;
    if ((srq_ = ibv_create_srq(pd_, &sa)) == nullptr) return Errno("ibv_create_srq");
    for (int i = 0; i < opt_.queue_depth; ++i) {
      if (absl::Status s = PostReceive(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  /// One reliable-connected QP per peer, brought to INIT (Connect takes them to RTR and RTS with the peer's blob).
  absl::Status CreateQueuePairs() {
    qps_.assign(opt_.num_ranks, nullptr);
    outstanding_.assign(opt_.num_ranks, 0);
    for (int r = 0; r < opt_.num_ranks; ++r) {
      if (r == opt_.rank) continue;
      ibv_qp_init_attr qa{};
      qa.send_cq = cq_;
      qa.recv_cq = cq_;
      qa.srq = srq_;
      qa.qp_type = IBV_QPT_RC;
      qa.sq_sig_all = 1;
      qa.cap.max_send_wr = static_cast<uint32_t>(opt_.queue_depth);
      qa.cap.max_send_sge = 1;
      if ((qps_[r] = ibv_create_qp(pd_, &qa)) == nullptr) return Errno("ibv_create_qp (RC)");
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = static_cast<uint8_t>(opt_.port);
      a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
      if (ibv_modify_qp(qps_[r], &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
        return Errno("ibv_modify_qp INIT");
      }
    }
    return absl::OkStatus();
  }

  static constexpr int kAccess =
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  struct Peer {
    uint64_t base = 0;
    uint32_t rkey = 0;
  };
  struct Slot {
    int peer;
    uint64_t cookie;
  };

  absl::Status CheckPeer(int peer) const {
    if (peer < 0 || peer >= opt_.num_ranks || qps_[peer] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("verbs transport: no QP for rank ", peer));
    }
    return absl::OkStatus();
  }

  /// Posts `wr` (opcode and remote fields set by the caller) with one SGE, signaled, tracked by a completion slot.
  absl::StatusOr<bool> Submit(int peer, uint64_t cookie, ibv_sge* sge, ibv_send_wr* wr, const char* what) {
    wr->wr_id = NewSlot(peer, cookie);
    wr->sg_list = sge;
    wr->num_sge = 1;
    wr->send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad = nullptr;
    if (const int rc = ibv_post_send(qps_[peer], wr, &bad); rc != 0) {
      FreeSlot(wr->wr_id);
      return absl::UnavailableError(absl::StrCat("ibv_post_send (", what, ") to rank ", peer, ": ", strerror(rc)));
    }
    ++outstanding_[peer];
    return true;
  }

  absl::Status PostReceive() {
    ibv_recv_wr wr{};  // zero-length: write-with-immediate only needs a receive to consume, not a buffer
    ibv_recv_wr* bad = nullptr;
    if (const int rc = ibv_post_srq_recv(srq_, &wr, &bad); rc != 0) {
      return absl::UnavailableError(absl::StrCat("ibv_post_srq_recv: ", strerror(rc)));
    }
    return absl::OkStatus();
  }

  absl::Status ToRts(ibv_qp* qp, const BlobHeader& h, uint32_t remote_qpn) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = static_cast<ibv_mtu>(h.mtu < static_cast<uint32_t>(port_.active_mtu) ? h.mtu : port_.active_mtu);
    a.dest_qp_num = remote_qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = max_dest_rd_atomic_;
    a.min_rnr_timer = 12;
    a.ah_attr.dlid = h.lid;
    a.ah_attr.port_num = static_cast<uint8_t>(opt_.port);
    if (port_.link_layer == IBV_LINK_LAYER_ETHERNET || h.lid == 0) {  // RoCE: route by GID
      a.ah_attr.is_global = 1;
      std::memcpy(a.ah_attr.grh.dgid.raw, h.gid, sizeof(h.gid));
      a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index_);
      a.ah_attr.grh.hop_limit = 64;
    }
    if (ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
      return Errno("ibv_modify_qp RTR");
    }
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;  // 4.096 us * 2^14 = 67 ms per retry
    a.retry_cnt = 7;
    a.rnr_retry = 7;  // infinite RNR retries: a receiver briefly out of posted receives is waited for
    a.sq_psn = 0;
    a.max_rd_atomic = max_rd_atomic_;
    if (ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                          IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
      return Errno("ibv_modify_qp RTS");
    }
    return absl::OkStatus();
  }

  uint64_t NewSlot(int peer, uint64_t cookie) {
    if (free_.empty()) {
      slots_.push_back(Slot{peer, cookie});
      return slots_.size() - 1;
    }
    const uint64_t i = free_.back();
    free_.pop_back();
    slots_[i] = Slot{peer, cookie};
    return i;
  }
  void FreeSlot(uint64_t i) { free_.push_back(i); }

  VerbsOptions opt_;
  std::string name_ = "ibverbs";
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_srq* srq_ = nullptr;
  ibv_mr* mr_ = nullptr;
  ibv_mr* atomic_mr_ = nullptr;
  uint64_t atomic_result_ = 0;
  bool atomics_ = false;
  uint8_t max_dest_rd_atomic_ = 0, max_rd_atomic_ = 0;
  ibv_port_attr port_{};
  ibv_gid gid_{};
  int gid_index_ = 0;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<ibv_qp*> qps_;
  std::vector<Peer> peers_;
  std::vector<int> outstanding_;
  std::vector<Slot> slots_;
  std::vector<uint64_t> free_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const VerbsOptions& options) {
  auto t = std::make_unique<VerbsTransport>(options);
  if (absl::Status s = t->Open(); !s.ok()) return s;
  return std::unique_ptr<Transport>(std::move(t));
}

absl::Status RegisterDmabufRegion(Transport& t, void* base, uint64_t bytes, int fd, uint64_t offset) {
  auto* v = dynamic_cast<VerbsTransport*>(&t);
  if (v == nullptr) {
    return absl::UnimplementedError(absl::StrCat(t.Name(), " cannot register dma-buf memory (host-staged only)"));
  }
  return v->RegisterDmabuf(base, bytes, fd, offset);
}

}  // namespace llep::proxy
