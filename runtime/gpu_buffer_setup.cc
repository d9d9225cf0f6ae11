// GpuBuffer's creation (runtime/gpu_buffer.h): device allocations, the IPC exchange and peer mapping, the proxy
// set-up for peers on other nodes, and release. The calls live in gpu_buffer.cc.
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proxy/fabric/fabric_transport.h"
#include "proxy/transport_factory.h"
#include "runtime/base/env.h"
#include "runtime/base/status_macros.h"
#include "runtime/bootstrap.h"
#include "runtime/gpu_buffer.h"
#include "runtime/gpu_buffer_internal.h"
#include "runtime/protocol/signal.h"
#include "runtime/validate.h"

namespace llep {

using gpu_buffer_internal::CudaStatus;
using gpu_buffer_internal::TraceBytes;

namespace {

// What every rank publishes so its peers can map its region.
struct RegionBlob {
  uint32_t magic;
  uint32_t layout_version;
  int64_t total_bytes;
  int32_t device;
  int32_t pid;
  char host[160];       // topology.h HostIdentity()
  char pci_bus_id[32];  // this rank's GPU, so peers can ask CUDA whether they reach it
  cudaIpcMemHandle_t handle;
  uint32_t ok;  // 0: this rank could not set its region up; error says why
  char error[256];
};
constexpr uint32_t kRegionBlobMagic = 0x4C4C4550;  // "LLEP"

/// Whether this process's device can map `bus_id`'s memory. A device this process cannot see (CUDA_VISIBLE_DEVICES)
/// counts as reachable: CUDA IPC may still map it, and opening the handle reports it if not.
bool CanReach(int device, const char* bus_id) {
  int peer = -1;
  if (cudaDeviceGetByPCIBusId(&peer, bus_id) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  if (peer == device) return true;
  int ok = 0;
  return cudaDeviceCanAccessPeer(&ok, device, peer) == cudaSuccess && ok != 0;
}

// FIFO ring entries per proxy thread (fifo_ring.h): a launch pushes at most one command per message and destination.
constexpr uint32_t kGpuFifoEntries = 8192;

}  // namespace

GpuBuffer::GpuBuffer(const protocol::LlLayout& layout, Bootstrap& bootstrap, const GpuBufferOptions& options)
    : layout_(layout), bootstrap_(bootstrap), options_(options), rank_(bootstrap.rank()) {}

GpuBuffer::~GpuBuffer() { Release(); }

absl::StatusOr<std::unique_ptr<GpuBuffer>> GpuBuffer::Create(const protocol::LlShape& shape, Bootstrap& bootstrap,
                                                             const GpuBufferOptions& options) {
  LLEP_RETURN_IF_ERROR(ValidateShapeForGroup(shape, bootstrap.size()));
  if (options.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout must be positive");
  if (options.num_ctas < 0) return absl::InvalidArgumentError("num_ctas must be >= 0 (0 = one per SM)");
  std::unique_ptr<GpuBuffer> b(new GpuBuffer(protocol::ComputeLlLayout(shape), bootstrap, options));
  LLEP_RETURN_IF_ERROR(b->Init());
  return b;
}

absl::Status GpuBuffer::Init() {
  // Every rank takes part in the exchange even when its own setup failed, so a failure on one rank (e.g. out of
  // device memory) becomes an error naming it on every rank instead of peers waiting in a collective.
  const absl::Status local = InitLocal();
  return Exchange(local);
}

absl::Status GpuBuffer::InitLocal() {
  const protocol::LlShape& shape = layout_.shape;
  const int R = shape.num_ranks;
  if (options_.device >= 0) {
    LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  }
  LLEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device_));
  int sms = 0, smem_optin = 0;
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
  // Every CTA of a launch must be resident (ll_kernels.h): never more CTAs than SMs.
  num_ctas_ = options_.num_ctas == 0 ? sms : std::min(options_.num_ctas, sms);
  // ...and enough CTAs that none counts the routes of more than kMaxDestinationsPerCta ranks.
  const int min_ctas = (R + kernels::cuda::kMaxDestinationsPerCta - 1) / kernels::cuda::kMaxDestinationsPerCta;
  if (min_ctas > sms) {
    return absl::InvalidArgumentError(
        absl::StrCat(R, " ranks need ", min_ctas, " CTAs per launch; device ", device_, " has ", sms, " SMs"));
  }
  num_ctas_ = std::max(num_ctas_, min_ctas);
  const int64_t smem = std::max(kernels::cuda::DispatchSharedBytes(shape), kernels::cuda::CombineSharedBytes(shape));
  int64_t static_smem = 0;
  LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::LlKernelsStaticSharedBytes(&static_smem));
  if (smem + static_smem > smem_optin) {
    return absl::InvalidArgumentError(absl::StrCat("num_experts=", shape.num_experts, " with num_ranks=", R, " needs ",
                                                   smem + static_smem, " bytes of shared memory per CTA; device ",
                                                   device_, " allows ", smem_optin));
  }
  LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::ConfigureLlKernels(smem));
  // The driver's launch when it resolves (ll_kernels.h LlLaunchHandles); else every launch goes through the runtime.
  if (kernels::cuda::ResolveLlLaunch(&launch_handles_) != cudaSuccess) (void)cudaGetLastError();

  void* p = nullptr;
  LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, static_cast<size_t>(layout_.total_bytes)));
  region_ = static_cast<uint8_t*>(p);
  // Zeroed signal words read "never signalled" (signal.h), so the region needs no per-call cleaning.
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(region_, 0, static_cast<size_t>(layout_.total_bytes)));
  const auto ws = gpu_buffer_internal::Workspace::Of(shape, num_ctas_);
  LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, ws.bytes()));
  d_workspace_ = static_cast<uint64_t*>(p);
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_workspace_, 0, ws.bytes()));
  LLEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, sizeof(protocol::DeviceErrorRecords), cudaHostAllocMapped));
  h_errors_ = static_cast<protocol::DeviceErrorRecords*>(p);
  std::memset(h_errors_, 0, sizeof(protocol::DeviceErrorRecords));
  LLEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&p, h_errors_, 0));
  d_errors_ = static_cast<protocol::DeviceErrorRecords*>(p);
  if (options_.metrics) {
    metrics_layout_ = protocol::ComputeMetricsLayout(R, shape.num_local_experts(), options_.metrics_layers);
    const size_t bytes = static_cast<size_t>(metrics_layout_.num_bytes());
    LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
    d_metrics_ = static_cast<uint64_t*>(p);
    LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_metrics_, 0, bytes));
    LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, sizeof(kernels::cuda::OpStamps) * kernels::cuda::kStampSlots));
    d_stamps_ = static_cast<kernels::cuda::OpStamps*>(p);
    LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_stamps_, 0, sizeof(kernels::cuda::OpStamps) * kernels::cuda::kStampSlots));
    absl::MutexLock lock(&metrics_mu_);
    LLEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&metrics_stream_, cudaStreamNonBlocking));
    LLEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    h_metrics_ = static_cast<uint64_t*>(p);
  }
  if (options_.shrink) {
    const gpu_buffer_internal::ShrinkArea area{R, shape.num_local_experts()};
    LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, area.bytes()));
    d_shrink_ = static_cast<uint8_t*>(p);
    LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_shrink_, 0, area.bytes()));
    LLEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, 2 * sizeof(int32_t), cudaHostAllocDefault));
    h_mask_values_ = static_cast<int32_t*>(p);
    h_mask_values_[0] = 0;
    h_mask_values_[1] = 1;
  }
  if (options_.kernel_trace) {
    LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, TraceBytes(num_ctas_)));
    d_trace_ = static_cast<uint64_t*>(p);
    LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_trace_, 0, TraceBytes(num_ctas_)));
  }
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

namespace {

/// This rank's blob for the region exchange and whether the rank is fit to take part (`local`: its setup so far).
RegionBlob DescribeRegion(const absl::Status& local, int device, void* region, int64_t total_bytes, absl::Status* own) {
  RegionBlob mine{};
  mine.magic = kRegionBlobMagic;
  mine.layout_version = protocol::kLlLayoutVersion;
  mine.total_bytes = total_bytes;
  mine.device = device;
  mine.pid = static_cast<int32_t>(getpid());
  std::strncpy(mine.host, HostIdentity().c_str(), sizeof(mine.host) - 1);
  *own = local;
  if (own->ok()) {
    *own = CudaStatus(cudaDeviceGetPCIBusId(mine.pci_bus_id, sizeof(mine.pci_bus_id), device), "cudaDeviceGetPCIBusId");
  }
  if (own->ok()) *own = CudaStatus(cudaIpcGetMemHandle(&mine.handle, region), "cudaIpcGetMemHandle");
  mine.ok = own->ok() ? 1 : 0;
  std::strncpy(mine.error, std::string(own->message()).c_str(), sizeof(mine.error) - 1);
  return mine;
}

/// Every rank's blob (collective), checked: a rank that failed its setup or built a different buffer is an error here.
absl::StatusOr<std::vector<RegionBlob>> GatherRegionBlobs(Bootstrap& bootstrap, const RegionBlob& mine,
                                                          const absl::Status& own, int R) {
  LLEP_ASSIGN_OR_RETURN(std::vector<std::string> all,
                        bootstrap.AllGather(std::string(reinterpret_cast<const char*>(&mine), sizeof(mine))));
  if (!own.ok()) return own;
  std::vector<RegionBlob> blobs(R);
  for (int r = 0; r < R; ++r) {
    if (all[r].size() != sizeof(RegionBlob)) return absl::DataLossError(absl::StrCat("rank ", r, ": bad region blob"));
    std::memcpy(&blobs[r], all[r].data(), sizeof(RegionBlob));
    RegionBlob& peer = blobs[r];
    peer.host[sizeof(peer.host) - 1] = '\0';
    peer.pci_bus_id[sizeof(peer.pci_bus_id) - 1] = '\0';
    peer.error[sizeof(peer.error) - 1] = '\0';
    if (peer.magic == kRegionBlobMagic && !peer.ok) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", r, " could not create its GPU buffer: ", peer.error));
    }
    if (peer.magic != kRegionBlobMagic || peer.layout_version != protocol::kLlLayoutVersion ||
        peer.total_bytes != mine.total_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, " built a different buffer (", peer.total_bytes, " bytes, layout v", peer.layout_version,
          ") than this rank (", mine.total_bytes, " bytes, v", protocol::kLlLayoutVersion,
          "): every rank must use the same num_max_dispatch_tokens_per_rank, hidden and num_experts"));
    }
  }
  return blobs;
}

/// Topology (runtime/topology.h), collective: every rank reports which peers' GPUs it can map and how it splits
/// virtual nodes (`ranks_per_node`, or `split` if that could not be read), and all decide the paths from the same
/// data. The split travels with the row: every rank must split the same way, or one side of a pair would store over
/// NVLink while the other waits for the proxy.
absl::StatusOr<std::vector<std::vector<PeerPath>>> AgreeOnPeerPaths(Bootstrap& bootstrap,
                                                                    const std::vector<RegionBlob>& blobs,
                                                                    const std::vector<std::string>& host_ids,
                                                                    const std::string& my_host, int device,
                                                                    int ranks_per_node, const absl::Status& split) {
  const int R = static_cast<int>(blobs.size());
  std::string reach_row(R, '0');
  for (int r = 0; r < R; ++r) {
    if (host_ids[r] == my_host) reach_row[r] = CanReach(device, blobs[r].pci_bus_id) ? '1' : '0';
  }
  LLEP_ASSIGN_OR_RETURN(std::vector<std::string> rows,
                        bootstrap.AllGather(absl::StrCat(reach_row, "|", split.ok() ? ranks_per_node : -1)));
  LLEP_RETURN_IF_ERROR(split);
  std::vector<std::vector<bool>> reach(R, std::vector<bool>(R, false));
  for (int a = 0; a < R; ++a) {
    if (rows[a].size() < static_cast<size_t>(R) + 2 || rows[a][R] != '|') {
      return absl::DataLossError(absl::StrCat("rank ", a, ": bad reach row"));
    }
    for (int b = 0; b < R; ++b) reach[a][b] = rows[a][b] == '1';
    if (rows[a].substr(R + 1) != std::to_string(ranks_per_node)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", a, " splits nodes into ", rows[a].substr(R + 1), " ranks, this rank into ", ranks_per_node,
          " (LLEP_RANKS_PER_NODE / allow_nvlink_for_low_latency_mode must agree on every rank; 0 = by host)"));
    }
  }
  return DecidePeerPaths(host_ids, reach, ranks_per_node);
}

/// Whether every pair that talks through the proxy shares a host (virtual nodes: the shm transport serves them).
bool ProxyPairsShareHost(const std::vector<std::vector<PeerPath>>& paths, const std::vector<std::string>& host_ids) {
  for (size_t a = 0; a < paths.size(); ++a) {
    for (size_t b = 0; b < paths.size(); ++b) {
      if (paths[a][b] == PeerPath::kProxy && host_ids[a] != host_ids[b]) return false;
    }
  }
  return true;
}

}  // namespace

absl::Status GpuBuffer::Exchange(const absl::Status& local) {
  const int R = layout_.shape.num_ranks;
  // The LLEP_* options, read once for the whole setup; an error is reported through the exchanges, never by
  // returning before one (the other ranks would wait in it).
  env_ = base::ReadOptions();
  absl::Status own;
  const RegionBlob mine = DescribeRegion(local, device_, region_, layout_.total_bytes, &own);
  LLEP_ASSIGN_OR_RETURN(const std::vector<RegionBlob> blobs, GatherRegionBlobs(bootstrap_, mine, own, R));

  std::vector<std::string> host_ids(R);
  for (int r = 0; r < R; ++r) host_ids[r] = blobs[r].host;
  int ranks_per_node = options_.ranks_per_node;
  absl::Status split = absl::OkStatus();
  if (ranks_per_node < 0) {
    split = env_.status();
    ranks_per_node = env_.ok() ? env_->ranks_per_node : 0;
  }
  LLEP_ASSIGN_OR_RETURN(const std::vector<std::vector<PeerPath>> all_paths,
                        AgreeOnPeerPaths(bootstrap_, blobs, host_ids, mine.host, device_, ranks_per_node, split));
  paths_ = all_paths[rank_];

  peer_bases_.assign(R, nullptr);
  peer_bases_[rank_] = region_;
  absl::Status mapped_all = absl::OkStatus();
  for (int r = 0; r < R && mapped_all.ok(); ++r) {
    if (paths_[r] != PeerPath::kNvlink) continue;
    void* mapped = nullptr;
    mapped_all = CudaStatus(cudaIpcOpenMemHandle(&mapped, blobs[r].handle, cudaIpcMemLazyEnablePeerAccess),
                            absl::StrCat("mapping rank ", r, "'s region (device ", blobs[r].device, ") with CUDA IPC"));
    peer_bases_[r] = static_cast<uint8_t*>(mapped);
  }
  // Collective too: a mapping error goes through the proxy setup's exchange (SetUpProxy reports it on every rank).
  if (AnyProxyPath(all_paths)) LLEP_RETURN_IF_ERROR(SetUpProxy(mapped_all, ProxyPairsShareHost(all_paths, host_ids)));
  LLEP_RETURN_IF_ERROR(mapped_all);
  LLEP_RETURN_IF_ERROR(FillDeviceContext());
  // Nobody writes into a peer before every rank mapped every region and started its proxy.
  return bootstrap_.Barrier();
}

absl::Status GpuBuffer::FillDeviceContext() {
  const int R = layout_.shape.num_ranks;
  void* p = nullptr;
  LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, sizeof(uint8_t*) * R));
  d_peers_ = static_cast<uint8_t**>(p);
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_peers_, peer_bases_.data(), sizeof(uint8_t*) * R, cudaMemcpyHostToDevice));
  ctx_.layout = layout_;
  ctx_.rank = rank_;
  ctx_.peers = d_peers_;
  ctx_.local = region_;
  ctx_.proxy_region = d_proxy_region_;
  ctx_.fifos = d_fifos_;
  ctx_.done = d_workspace_;
  const auto ws = gpu_buffer_internal::Workspace::Of(layout_.shape, num_ctas_);
  ctx_.proxy_signals = d_workspace_ + ws.mirrors();
  ctx_.proxy_blocks = d_workspace_ + ws.blocks();
  ctx_.flags = reinterpret_cast<uint32_t*>(d_workspace_ + ws.flags());
  ctx_.calls =
      reinterpret_cast<kernels::cuda::LlCallState*>(reinterpret_cast<uint8_t*>(d_workspace_) + ws.call_state_bytes());
  ctx_.launches =
      reinterpret_cast<kernels::cuda::LlCtaLaunches*>(reinterpret_cast<uint8_t*>(d_workspace_) + ws.launches_bytes());
  ctx_.carried = reinterpret_cast<uint8_t*>(d_workspace_) + ws.carried_bytes();
  ctx_.expert_plans = reinterpret_cast<uint8_t*>(d_workspace_) + ws.expert_plans_bytes();
  ctx_.errors = d_errors_;
  ctx_.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.timeout));
  ctx_.trace = d_trace_;
  ctx_.metrics = d_metrics_;
  ctx_.stamps = d_stamps_;
  ctx_.metrics_layout = metrics_layout_;
  ctx_.grid = protocol::FastDivisor::Make(static_cast<uint32_t>(num_ctas_));
  ctx_.send_items = protocol::FastDivisor::Make(
      static_cast<uint32_t>(kernels::cuda::DispatchSendItemsPerToken(layout_.shape.hidden)));
  if (d_shrink_ != nullptr) {
    const gpu_buffer_internal::ShrinkArea area{layout_.shape.num_ranks, layout_.shape.num_local_experts()};
    ctx_.mask = reinterpret_cast<int32_t*>(d_shrink_);
    ctx_.verdicts = reinterpret_cast<unsigned long long*>(d_shrink_ + area.verdicts());
  }
  return absl::OkStatus();
}

namespace {

/// The libfabric provider the proxies use: the buffer's option, else LLEP_FABRIC_PROVIDER, else shared memory
/// between virtual nodes of one host and the first RDMA provider present between real nodes (TCP if none).
std::string ChooseProxyTransport(const std::string& option, const std::string& from_env, bool peers_share_host) {
  if (!option.empty()) return option;
  if (!from_env.empty()) return from_env;
  if (peers_share_host) return "shm";
  const std::vector<std::string> have = proxy::ListFabricProviders();
  for (const char* want : {"efa", "verbs;ofi_rxm"}) {
    if (std::find(have.begin(), have.end(), want) != have.end()) return want;
  }
  return "tcp;ofi_rxm";
}

/// Every rank's proxy fields ([error or empty, transport, one blob per thread]) checked for agreement and turned
/// into one blob per (thread, rank).
absl::StatusOr<std::vector<std::vector<std::string>>> AgreeOnProxyBlobs(const std::vector<std::string>& all,
                                                                        const std::string& transport, int threads) {
  const int R = static_cast<int>(all.size());
  std::vector<std::vector<std::string>> per_thread(threads, std::vector<std::string>(R));
  for (int r = 0; r < R; ++r) {
    LLEP_ASSIGN_OR_RETURN(std::vector<std::string> f, UnpackStringList(all[r]));
    if (f.size() < 2) return absl::DataLossError(absl::StrCat("rank ", r, ": bad proxy blob"));
    if (!f[0].empty()) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", r, " could not set up its proxy: ", f[0]));
    }
    if (f[1] != transport || static_cast<int>(f.size()) != 2 + threads) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", r, " uses transport '", f[1], "' with ", f.size() - 2,
                                                        " proxy threads, this rank '", transport, "' with ", threads,
                                                        ": all ranks must agree"));
    }
    for (int i = 0; i < threads; ++i) per_thread[i][r] = std::move(f[2 + i]);
  }
  return per_thread;
}

}  // namespace

absl::Status GpuBuffer::SetUpProxy(const absl::Status& before, bool peers_share_host) {
  const base::Options env = env_.ok() ? *env_ : base::Options{};  // a read error fails s below
  const std::string transport = ChooseProxyTransport(options_.transport, env.fabric_provider, peers_share_host);
  const int threads = options_.num_proxy_threads > 0 ? options_.num_proxy_threads : 1;
  std::vector<std::unique_ptr<proxy::Transport>> transports;
  std::vector<std::string> fields = {"", transport};  // [error or empty, transport name, one blob per thread]
  absl::Status s = before.ok() ? env_.status() : before;
  if (s.ok()) s = OpenProxyEnds(transport, threads, env.fabric_node, &transports, &fields);
  // Collective: a rank that failed still publishes (its error), so no peer waits for it.
  if (!s.ok()) fields = {std::string(s.message()).empty() ? "setup failed" : std::string(s.message()), transport};
  LLEP_ASSIGN_OR_RETURN(std::vector<std::string> all, bootstrap_.AllGather(PackStringList(fields)));
  if (!s.ok()) return s;
  LLEP_ASSIGN_OR_RETURN(auto per_thread, AgreeOnProxyBlobs(all, transport, threads));
  for (int i = 0; i < threads; ++i) LLEP_RETURN_IF_ERROR(transports[i]->Connect(per_thread[i]));
  return StartProxy(std::move(transports), env.proxy_spin);
}

absl::Status GpuBuffer::OpenProxyEnds(const std::string& transport, int threads, const std::string& fabric_node,
                                      std::vector<std::unique_ptr<proxy::Transport>>* transports,
                                      std::vector<std::string>* blobs) {
  if (static_cast<uint64_t>(layout_.total_bytes) > protocol::kCmdMaxOffset) {
    return absl::InvalidArgumentError(absl::StrCat("the ", layout_.total_bytes,
                                                   "-byte region is beyond the FIFO command's offset reach (",
                                                   protocol::kCmdMaxOffset + 1, " bytes)"));
  }
  void* h = nullptr;
  // Pinned, mapped into the GPU (the kernels stage and read here) and portable (any context of the process).
  LLEP_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&h, static_cast<size_t>(layout_.total_bytes), cudaHostAllocMapped | cudaHostAllocPortable));
  h_proxy_region_ = static_cast<uint8_t*>(h);
  std::memset(h_proxy_region_, 0, static_cast<size_t>(layout_.total_bytes));  // zero signal words: "none yet"
  void* d = nullptr;
  LLEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&d, h_proxy_region_, 0));
  d_proxy_region_ = static_cast<uint8_t*>(d);
  for (int i = 0; i < threads; ++i) {
    auto ring = std::make_unique<CudaFifoRing>();
    LLEP_CUDA_RETURN_IF_ERROR(ring->Init(kGpuFifoEntries));
    rings_.push_back(std::move(ring));
    LLEP_ASSIGN_OR_RETURN(auto t, proxy::CreateTransport(transport, fabric_node, rank_, layout_.shape.num_ranks));
    LLEP_RETURN_IF_ERROR(t->RegisterRegion(h_proxy_region_, static_cast<uint64_t>(layout_.total_bytes)));
    LLEP_ASSIGN_OR_RETURN(std::string blob, t->LocalBlob());
    blobs->push_back(std::move(blob));
    transports->push_back(std::move(t));
  }
  return absl::OkStatus();
}

absl::Status GpuBuffer::StartProxy(std::vector<std::unique_ptr<proxy::Transport>> transports, int spin) {
  const int R = layout_.shape.num_ranks;
  transport_name_ = transports[0]->Name();
  std::vector<proxy::ExternalRing> rings;
  for (const auto& ring : rings_) rings.push_back({ring->device, ring->host, ring->abort_word()});
  proxy::ProxyOptions po;
  po.fifo_entries = kGpuFifoEntries;
  // GPU hosts have cores to spare: poll without sleeping for ~1 s of idleness, so decode steps never wake a sleeper.
  po.spin_before_sleep = spin;
  LLEP_ASSIGN_OR_RETURN(
      proxy_, proxy::Proxy::Create(layout_, rank_, h_proxy_region_, std::move(transports), po, std::move(rings)));
  // The kernels push a peer's commands into the ring of the proxy thread that owns the pair (rank, peer).
  std::vector<protocol::FifoRingHandle> fifos(R);
  for (int d = 0; d < R; ++d) {
    if (d != rank_) fifos[d] = proxy_->ring(proxy::Proxy::ThreadFor(rank_, d, proxy_->num_threads()));
  }
  void* p = nullptr;
  LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, sizeof(protocol::FifoRingHandle) * R));
  d_fifos_ = static_cast<protocol::FifoRingHandle*>(p);
  LLEP_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(d_fifos_, fifos.data(), sizeof(protocol::FifoRingHandle) * R, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

proxy::ProxyStats GpuBuffer::proxy_stats() const { return proxy_ ? proxy_->stats() : proxy::ProxyStats{}; }

void GpuBuffer::Release() {
  if (device_ >= 0) (void)cudaSetDevice(device_);
  for (int r = 0; r < static_cast<int>(peer_bases_.size()); ++r) {
    if (r != rank_ && peer_bases_[r] != nullptr) (void)cudaIpcCloseMemHandle(peer_bases_[r]);
  }
  peer_bases_.clear();
  // The proxy threads stop before their rings and region go away. One wedged inside its transport (a peer died in
  // libfabric's shm) may still touch both: then they are leaked with the proxy instead of freed under it.
  if (proxy_ != nullptr && !proxy_->Stop()) {
    for (auto& ring : rings_) ring.release();
    h_proxy_region_ = nullptr;
  }
  proxy_.reset();
  rings_.clear();
  if (d_fifos_ != nullptr) (void)cudaFree(d_fifos_);
  if (h_proxy_region_ != nullptr) (void)cudaFreeHost(h_proxy_region_);
  d_fifos_ = nullptr;
  h_proxy_region_ = nullptr;
  d_proxy_region_ = nullptr;
  if (d_peers_ != nullptr) (void)cudaFree(d_peers_);
  if (d_workspace_ != nullptr) (void)cudaFree(d_workspace_);
  if (region_ != nullptr) (void)cudaFree(region_);
  if (h_errors_ != nullptr) (void)cudaFreeHost(h_errors_);
  if (d_trace_ != nullptr) (void)cudaFree(d_trace_);
  if (d_stamps_ != nullptr) (void)cudaFree(d_stamps_);
  if (d_shrink_ != nullptr) (void)cudaFree(d_shrink_);
  if (h_mask_values_ != nullptr) (void)cudaFreeHost(h_mask_values_);
  d_shrink_ = nullptr;
  h_mask_values_ = nullptr;
  {
    absl::MutexLock lock(&metrics_mu_);  // a snapshot in progress finishes first
    if (d_metrics_ != nullptr) (void)cudaFree(d_metrics_);
    if (metrics_stream_ != nullptr) (void)cudaStreamDestroy(metrics_stream_);
    if (h_metrics_ != nullptr) (void)cudaFreeHost(h_metrics_);
    metrics_stream_ = nullptr;
    h_metrics_ = nullptr;
  }
  d_trace_ = nullptr;
  d_metrics_ = nullptr;
  d_stamps_ = nullptr;
  d_peers_ = nullptr;
  d_workspace_ = nullptr;
  region_ = nullptr;
  h_errors_ = nullptr;
  d_errors_ = nullptr;
}

}  // namespace llep
