// The NVLink dispatch and combine kernels (see ll_kernels.h for the contract).
//
// Work split (G CTAs of 16 warps; every CTA resident):
//  dispatch send   CTA b owns tokens b, b+G, ... in rounds of up to 16. Each round is planned by the whole CTA
//                  (PlanRound: every thread compares one earlier token with the round's tokens, giving each
//                  token's row in its (expert, source) blocks and its message slot per destination: the
//                  deterministic plan of kernels/host/route_plan.h); meanwhile each warp's first payload chunk is
//                  already loading. Then warps encode 512-channel chunks once and store them to every destination
//                  of the token, and after the round one fence and one completion add per (token, destination).
//                  Before its tokens, CTA G-1-d (strided, so the CTAs without tokens when T < G) counts the
//                  tokens per local expert for destination d and writes that route-block prefix; after its own
//                  tokens it waits for d's messages and publishes d's signal.
//  dispatch recv   every CTA waits for all R signals, reads the route-block counts and computes the packed
//                  layout (blocks in source order); warps take messages (one per warp: header, payload and
//                  scales loaded together) and fan each payload out to its rows from registers. CTA 0 writes
//                  recv_count, layout_range and the statistics.
//  combine send    every CTA reads layout_range and computes, per (local expert, home rank), the position of the
//                  block in the home rank's receive area; warps copy one row each (flattened over all blocks),
//                  each followed by a fence and a completion add; CTA d publishes rank d's signal.
//  combine recv    every CTA counts the routed rows per expert, plans its first tokens (positions from the
//                  per-expert counts and the plan), then waits for all signals and reduces top-k rows in fp32 fma
//                  order, 256 channels per warp item, exactly as the CPU backend does.
// Signals: per destination, the CTA that knows the message count polls the completion counter and publishes the
// signal word (PublishWhenDone).
//
// Files (one translation unit): ll_device_common.cuh (constants, memory model, errors, proxy pushes, metrics stamps,
// signal waits and publishing), ll_routing.cuh (topk validation, token plans, scans, FP8 encoder), ll_dispatch.cuh
// and ll_combine.cuh (the phases), and this file (graph-safe call state, the two kernels, the launchers).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/ll_combine.cuh"
#include "kernels/cuda/ll_device_common.cuh"
#include "kernels/cuda/ll_dispatch.cuh"
#include "kernels/cuda/ll_kernels.h"
#include "kernels/cuda/ll_routing.cuh"

namespace llep::kernels::cuda {
namespace {

// ------------------------------------------------------------------------------------------ call state

/// Loads a call record bypassing L1 (the record was written by earlier launches, on any SM).
__device__ __forceinline__ LlCallRecord LoadRecord(const LlCallRecord* r) {
  LlCallRecord v;
  const uint4* src = reinterpret_cast<const uint4*>(r);
  uint4* dst = reinterpret_cast<uint4*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = __ldcg(src + i);
  return v;
}

/// a is b or a later sequence number.
__device__ __forceinline__ bool AtOrAfter(uint32_t a, uint32_t b) { return a == b || protocol::SignalIsNewer(a, b); }

/// Thread 0 of every CTA of a launch with a send phase: the operation's sequence number, after the in-flight rules
/// (LlCallState); 0 if a rule refuses the send (CTA 0 records why) or an earlier fatal error aborted the buffer.
__device__ uint32_t TakeCallSeq(const LlDeviceContext& c, LlOp op, unsigned long long* n_out) {
  LlCallState* s = c.calls;
  // Both records and the abort flag load while the atomic is in flight: one round trip on the critical path.
  const LlCallRecord r0 = LoadRecord(&s->record[0]), r1 = LoadRecord(&s->record[1]);
  const bool aborted = Aborted(c);
  const unsigned long long n = atomicAdd(&s->send_ctas, 1ull) / gridDim.x;
  *n_out = n;
  const uint32_t seq = protocol::DeviceCallSeq(n);
  const int h = protocol::HalfOfSeq(seq);
  const LlCallRecord& r = h == 0 ? r0 : r1;
  const uint32_t prev = static_cast<uint32_t>(r.sent[h]);
  const uint32_t sent_after = r.sent_after[static_cast<int>(op)][h];
  uint32_t code = protocol::kDeviceOk, detail = 0;
  if (prev != 0 && static_cast<uint32_t>(r.received[h] >> 32) != prev) {
    code = protocol::kDeviceInFlight;
    detail = prev;
  } else if (sent_after != 0 && (r.newest_received == 0 || !AtOrAfter(r.newest_received, sent_after))) {
    code = protocol::kDeviceRegionBusy;
    detail = sent_after;
  }
  if (code != protocol::kDeviceOk && blockIdx.x == 0) RecordError(c, code, op, -1, seq, detail);
  return code == protocol::kDeviceOk && !aborted ? seq : 0u;
}

/// Send n is done (last CTA, thread 0, after its send phase): the record the next send reads, with this send in it
/// (received at once for kPhaseBoth).
__device__ void TrackSend(const LlDeviceContext& c, LlOp op, int phase, uint32_t tag, unsigned long long n) {
  const uint32_t seq = protocol::DeviceCallSeq(n);
  const int h = protocol::HalfOfSeq(seq);
  LlCallRecord r = LoadRecord(&c.calls->record[h]);
  r.sent[h] = PackSent(tag, seq);
  if (phase == kPhaseBoth) {
    r.received[h] = PackReceived(seq, kReceivedInLaunch);
    r.sent_after[static_cast<int>(op)][h] = protocol::DeviceCallSeq(n + 1);
    if (r.newest_received == 0 || protocol::SignalIsNewer(seq, r.newest_received)) r.newest_received = seq;
  }
  c.calls->record[h ^ 1] = r;
}

/// Thread 0 of every CTA of a receive-only launch: the sequence number of the sent, unreceived operation `tag` names
/// (the older one if two do), marked received by this launch in the record the next send reads; 0 if none does
/// (protocol::kDeviceBadReceive recorded) or the buffer aborted. See LlCallState for why every CTA reaches the same
/// answer.
__device__ uint32_t TakeReceivedSeq(const LlDeviceContext& c, LlOp op, uint32_t tag) {
  LlCallState* s = c.calls;
  const LlCallRecord r0 = LoadRecord(&s->record[0]), r1 = LoadRecord(&s->record[1]);
  const bool aborted = Aborted(c);
  const unsigned long long next_send = __ldcg(&s->send_ctas) / gridDim.x;  // no send runs during this launch
  // The receive launch's index, never kReceivedInLaunch.
  const uint32_t launch = static_cast<uint32_t>((atomicAdd(&s->recv_ctas, 1ull) / gridDim.x) % kReceivedInLaunch);
  const LlCallRecord& r = (next_send & 1) == 0 ? r0 : r1;
  int half = -1;
  uint32_t seq = 0;
  for (int h = 0; h < protocol::kNumHalves; ++h) {
    const uint32_t sent_seq = static_cast<uint32_t>(r.sent[h]);
    const unsigned long long mark = r.received[h];
    const bool waiting =
        sent_seq != 0 && (static_cast<uint32_t>(mark >> 32) != sent_seq || static_cast<uint32_t>(mark) == launch);
    if ((r.sent[h] >> 32) == tag && waiting && (half < 0 || protocol::SignalIsNewer(seq, sent_seq))) {
      half = h;
      seq = sent_seq;
    }
  }
  if (aborted) return 0;
  if (half < 0) {
    if (blockIdx.x == 0) RecordError(c, protocol::kDeviceBadReceive, op, -1, 0, tag);
    return 0;
  }
  // Every CTA stores the same values (newest_received included: the maximum with seq either way).
  LlCallRecord* out = &s->record[next_send & 1];
  out->received[half] = PackReceived(seq, launch);
  out->sent_after[static_cast<int>(op)][half] = protocol::DeviceCallSeq(next_send);
  if (r.newest_received == 0 || protocol::SignalIsNewer(seq, r.newest_received)) out->newest_received = seq;
  return seq;
}

/// A launch of one operation: its send phase, its receive phase, or both (kPhaseBoth), with the call state and the
/// metrics stamps around them. The two public kernels differ only in their phase functions.
template <typename Params>
__device__ __forceinline__ void RunPhases(const Params& p, LlOp op, int phase, uint8_t* smem,
                                          void (*send)(const Params&, uint32_t, uint8_t*),
                                          void (*recv)(const Params&, uint32_t, uint8_t*)) {
  const LlDeviceContext& c = p.ctx;
  __shared__ uint32_t call_seq;
  __shared__ unsigned long long call_n;  // send launches: the launch's index (LlCallState)
  Trace(c, op, kTraceEntered);
  if (threadIdx.x == 0) {
    call_seq = (phase & kPhaseSend) ? TakeCallSeq(c, op, &call_n) : TakeReceivedSeq(c, op, p.call_tag);
  }
  __syncthreads();
  const uint32_t seq = call_seq;
  if (seq == 0) return;  // refused (recorded) or aborted: this launch does nothing
  if (phase & kPhaseSend) {
    StampSendStart(c, op, seq);
    send(p, seq, smem);
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) TrackSend(c, op, phase, p.call_tag, call_n);
  }
  if (phase & kPhaseRecv) {
    __syncthreads();
    StampRecvStart(c, seq);
    recv(p, seq, smem);
    StampRecvEnd(c, seq);
  }
}

}  // namespace

// The two public kernels. Names are part of the contract (ll_kernels.h): demangled `llep::kernels::cuda::dispatch`
// and `llep::kernels::cuda::combine`.
__global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kDispatch, phase, smem, DispatchSend, DispatchRecv);
}

__global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, phase, smem, CombineSend, CombineRecv);
}

// Metrics flush: a separate kernel so the two contract kernels keep their launch shape.
__global__ void bin_finished_ops(LlDeviceContext c) { BinFinishedOps(c, 0); }

cudaError_t FlushLlMetrics(const LlDeviceContext& ctx, cudaStream_t stream) {
  if (ctx.metrics == nullptr) return cudaSuccess;
  bin_finished_ops<<<1, 1, 0, stream>>>(ctx);
  return cudaGetLastError();
}

int64_t DispatchSharedBytes(const protocol::LlShape& s) {
  const int64_t send = DispatchScratchOffset(s) + static_cast<int64_t>(sizeof(PlanScratch));
  const int64_t recv = int64_t{4} * (4 + kWarps + s.num_ranks + 1 + 2 * int64_t{s.num_experts});
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

int64_t CombineSharedBytes(const protocol::LlShape& s) {
  const int64_t send = int64_t{4} * (kWarps + 4 * int64_t{s.num_experts} + s.num_ranks);
  const int64_t recv = protocol::AlignUp(int64_t{4} * (4 + kWarps + 2 * s.num_ranks + s.num_experts), 16) +
                       static_cast<int64_t>(kWarps * (sizeof(TokenPlan) + sizeof(CombineRecvPlan))) +
                       static_cast<int64_t>(sizeof(PlanScratch));
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

cudaError_t ConfigureLlKernels(int64_t bytes) {
  cudaError_t e = cudaFuncSetAttribute(dispatch, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(combine, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

namespace {

/// A launch with a send phase has CTAs that wait for other CTAs of the same launch (PublishWhenDone polls the
/// completion counter the other CTAs add to; a kPhaseBoth launch also waits for signals its own send phase
/// publishes). That needs every CTA resident at once, which only the cooperative attribute guarantees: without it, a
/// kernel on another stream (a GEMM, the other micro-batch's launch) can hold SMs while launched CTAs spin, and the
/// operation stalls until the timeout. A receive-only launch waits only for peers, so it launches plainly.
template <typename Params>
cudaError_t LaunchLl(void (*kernel)(Params, int), const Params& p, LlPhase phase, const LaunchConfig& cfg,
                     int64_t shared_bytes, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(cfg.num_ctas));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = (phase & kPhaseSend) != 0 ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p, static_cast<int>(phase));
}

}  // namespace

cudaError_t LaunchDispatch(const DispatchParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  return LaunchLl(dispatch, p, phase, cfg, DispatchSharedBytes(p.ctx.layout.shape), stream);
}

cudaError_t LaunchCombine(const CombineParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  return LaunchLl(combine, p, phase, cfg, CombineSharedBytes(p.ctx.layout.shape), stream);
}

}  // namespace llep::kernels::cuda
