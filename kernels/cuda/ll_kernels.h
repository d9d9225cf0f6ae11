// The NVLink low-latency kernels: llep::kernels::cuda::dispatch and llep::kernels::cuda::combine.
// Layer: kernels/cuda; host-includable (no torch, no abseil). runtime/gpu_buffer.cc fills the parameter blocks
// and calls the launchers; the kernels implement the same protocol as the CPU backend (kernels/host/ll_host.h)
// on the same region layout (runtime/protocol/ll_layout.h), and GPU tests compare the two bit for bit.
//
// One kernel symbol per operation, the phase a runtime argument: the send and the receive phase of a receive
// hook are two launches of the same symbol, so profilers that look for `::dispatch` / `::combine` see one row
// each (shared/spec/deepep-ll-api.md §8.1). No other kernel carries those words.
//
// Peers are same-host ranks whose regions are mapped into this process (CUDA IPC); `peers[r]` is rank r's
// region base as this GPU sees it (`peers[rank]` is the local region). Data goes with plain stores, then one
// release store of the signal word per (operation, destination) after every warp's data is done.
//
// Errors never trap: a kernel that finds a bad expert id, an inconsistent message or a silent peer records the
// first such event in `error` (mapped host memory the host reads without synchronising) and skips the work it
// cannot do safely. Bad ids are treated as -1 consistently by every phase, so the buffer stays usable; a
// timeout or a sequence overrun leaves the protocol state unknown and the host refuses further calls.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "runtime/protocol/ll_layout.h"
#include "runtime/protocol/metrics_layout.h"

namespace llep::kernels::cuda {

/// Which part of an operation a launch runs.
enum LlPhase : int { kPhaseSend = 1, kPhaseRecv = 2, kPhaseBoth = 3 };

/// Error codes the kernels record (GpuErrorInfo::code). 0 = no error.
enum GpuErrorCode : uint32_t {
  kGpuOk = 0,
  kGpuBadExpertId = 1,      ///< topk_idx outside [-1, num_experts): detail = the id; treated as -1
  kGpuBadLayoutRange = 2,   ///< combine handle's layout_range inconsistent: detail = the entry; rows skipped
  kGpuTimeout = 3,          ///< a peer did not signal in time: peer = that rank
  kGpuSequenceOverrun = 4,  ///< a signal from a later call arrived first: too many operations in flight
  kGpuBadMessage = 5,       ///< a received header is inconsistent: peer = its source, detail = message index
};

/// First error a kernel hit. Lives in mapped, pinned host memory. The right to write it is claimed with an
/// atomicCAS on a device-memory word (LlDeviceContext::flags), the fields are written, and `code` is stored
/// last, so the host never reads a code with the fields of another error.
struct GpuErrorInfo {
  uint32_t code;
  uint32_t op;     ///< protocol::LlOp
  int32_t peer;    ///< rank the error concerns, or -1
  uint32_t seq;    ///< call sequence number
  int64_t detail;  ///< code-specific value
};

/// Diagnostic timeline (LLEP_KERNEL_TRACE=1, off otherwise): thread 0 of every CTA stores the global timer (ns) at
/// these points of each launch into trace[(op * num_ctas + cta) * kTracePoints + point], so the last launch of
/// each operation leaves its timeline (the benchmark prints it). Points a CTA does not pass keep older values.
enum TracePoint : int {
  kTraceSendStart = 0,  ///< send phase entered
  kTraceCounted,        ///< dispatch: route-block counts written (counting CTAs)
  kTracePlanned,        ///< first token round planned (dispatch) / block positions computed (combine)
  kTraceStored,         ///< payload stores issued (all rounds / rows of the CTA)
  kTraceCounterDone,    ///< fences and completion counters of the CTA done
  kTracePublished,      ///< signal(s) of the CTA's destinations published (publishing CTAs)
  kTraceRecvStart,      ///< receive phase entered
  kTraceSignals,        ///< every source's signal seen
  kTraceRecvPlanned,    ///< receive layout / token plan ready
  kTraceRecvEnd,        ///< receive phase done
  kTraceEncoded,        ///< dispatch: warp 0's first payload chunk loaded and encoded (before its stores)
  kTraceFenced,         ///< dispatch: thread 0's system fence after the first round's stores returned
  kTracePoints = 16,
};

/// Metrics (runtime/protocol/metrics_layout.h), when on: the kernels add to the counter block themselves, so graph
/// replays keep counting with no host work. An operation's latencies come from %globaltimer stamps in a ring of
/// kStampSlots entries indexed by seq % kStampSlots: CTA 0 stores the phase starts and the end of its wait; the
/// publishing CTAs and every CTA at the end of its receive work store their time with a max-reduction (no reset is
/// needed between uses of a slot: a later operation's times are larger). The latencies are binned by the receive
/// phase of a later operation (the last CTA's last thread, while the others wait for signals), when every launch before
/// it has finished, or by FlushLlMetrics. The ring of 4 is enough: a send on slot s % 4 needs call s - 2 received (the
/// in-flight rule), whose receive launch came after call s - 4's and bins it.
struct OpStamps {
  uint64_t send_start;  ///< send phase entered (CTA 0)
  uint64_t send_end;    ///< max over the rank's signal publishes
  uint64_t recv_start;  ///< receive phase entered (CTA 0)
  uint64_t wait_end;    ///< every source's signal seen (CTA 0)
  uint64_t recv_end;    ///< max over CTAs of the receive work's end
  uint32_t seq;         ///< the call that owns the slot
  uint32_t state;       ///< OpStampState
  uint32_t op;          ///< protocol::LlOp
  uint32_t reserved;
};
static_assert(sizeof(OpStamps) == 56, "host zero-fills kStampSlots of these");
enum OpStampState : uint32_t { kStampEmpty = 0, kStampSent = 1, kStampReceiving = 2, kStampBinned = 3 };
inline constexpr int kStampSlots = 4;

/// Per-rank state every launch needs. POD, passed by value.
struct LlDeviceContext {
  protocol::LlLayout layout;
  int rank = 0;
  uint8_t* const* peers = nullptr;  ///< device array [R]: every rank's region base in this address space
  uint8_t* local = nullptr;         ///< this rank's region base (== peers[rank], without the load)
  uint64_t* done = nullptr;         ///< device [2 halves][2 ops][R]: completion counters (self-resetting)
  uint32_t* flags = nullptr;        ///< device [2]: [0] error record claimed, [1] abort (a fatal error happened)
  GpuErrorInfo* error = nullptr;    ///< device pointer to the mapped host error record
  uint64_t timeout_ns = 0;          ///< receive wait limit per signal
  uint64_t* trace = nullptr;        ///< optional [2 ops][num_ctas][kTracePoints] timeline (TracePoint); null = off
  uint64_t* metrics = nullptr;      ///< optional counter block (metrics_layout.h); null = metrics off
  OpStamps* stamps = nullptr;       ///< [kStampSlots] latency stamps; set with metrics
  protocol::MetricsLayout metrics_layout;
};

struct DispatchParams {
  LlDeviceContext ctx;
  uint32_t seq = 0;  ///< call sequence number: picks the half, stamps the signals
  protocol::DispatchMode mode;
  const uint16_t* x = nullptr;        ///< bf16 [num_tokens, H]
  const int64_t* topk_idx = nullptr;  ///< [num_tokens, num_topk]
  int num_tokens = 0;
  int num_topk = 0;
  void* recv_x = nullptr;               ///< fp8 uint8 / bf16 [E_loc, R*T, H]
  void* recv_scales = nullptr;          ///< fp32 [E_loc, H/128, R*T] or packed ue8m0 int32 [E_loc, H/512, R*T]
  int32_t* recv_count = nullptr;        ///< [E_loc]
  int32_t* src_info = nullptr;          ///< [E_loc, R*T]
  int64_t* layout_range = nullptr;      ///< [E_loc, R]: count | begin << 32
  int32_t* cumulative_stats = nullptr;  ///< optional [E_loc], accumulated
  int64_t* wait_stats = nullptr;        ///< optional [R]: ns waited per source, accumulated
};

struct CombineParams {
  LlDeviceContext ctx;
  uint32_t seq = 0;
  const uint16_t* x = nullptr;            ///< bf16 [E_loc, R*T, H]; null = zero-copy (rows in c_send of the half)
  const int64_t* layout_range = nullptr;  ///< the dispatch handle's [E_loc, R]
  const int64_t* topk_idx = nullptr;      ///< this rank's routing [num_tokens, num_topk]
  const float* topk_weights = nullptr;    ///< [num_tokens, num_topk]
  int num_tokens = 0;
  int num_topk = 0;
  uint16_t* out = nullptr;        ///< bf16 [num_tokens, H]
  int64_t* wait_stats = nullptr;  ///< optional [R], ns, accumulated
};

/// Launch geometry. Every CTA of a launch must be resident at once (the receive phase of a kPhaseBoth launch
/// waits on signals other CTAs produce), so num_ctas must not exceed the SM count; and a CTA counts the routes of at
/// most kMaxDestinationsPerCta destinations, so num_ctas must be at least ceil(R / kMaxDestinationsPerCta).
struct LaunchConfig {
  int num_ctas = 0;
};
inline constexpr int kMaxDestinationsPerCta = 64;

/// Dynamic shared memory a launch needs for this shape; the host checks it against the device limit once.
int64_t DispatchSharedBytes(const protocol::LlShape& shape);
int64_t CombineSharedBytes(const protocol::LlShape& shape);
/// Raises the kernels' dynamic shared-memory limit to `bytes` (call once per device before launching).
cudaError_t ConfigureLlKernels(int64_t bytes);

/// Bins the latencies of every operation whose receive phase has been launched before this call (stream order) into
/// ctx.metrics: what a metrics snapshot runs first so the last operation's latencies are in it. A no-op when metrics
/// are off. One thread; the kernel's name (bin_finished_ops) carries neither "dispatch" nor "combine".
cudaError_t FlushLlMetrics(const LlDeviceContext& ctx, cudaStream_t stream);

cudaError_t LaunchDispatch(const DispatchParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream);
cudaError_t LaunchCombine(const CombineParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream);

}  // namespace llep::kernels::cuda
