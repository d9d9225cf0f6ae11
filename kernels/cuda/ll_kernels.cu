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
//  dispatch recv   every CTA loads the route-block counts (tagged with their call, so before it knows the call,
//                  with the signal peek), waits for all R signals and computes the packed layout (blocks in
//                  source order); the last CTA writes recv_count, layout_range and the
//                  statistics. Warps locate messages by a warp scan (header, payload segment and scales loaded
//                  together; a message split over several CTAs at small T) and fan each payload out to its rows
//                  from registers (with one item per CTA, its rows split over 4 warps); the items go to the
//                  CTAs before G-2 (G-1 writes the handle, G-2 bins the metrics).
//  combine send    every CTA reads layout_range and computes, per (local expert, home rank), the position of the
//                  block in the home rank's receive area; warps copy one row each (flattened over all blocks),
//                  each followed by a fence and a completion add; CTA G-1-d publishes rank d's signal.
//  combine recv    every CTA plans its first tokens: each slot's row position in its expert rank's return area,
//                  counted by comparing with every token's selections (no per-expert histogram); the last CTA
//                  counts the rows routed per rank for the check. Then it waits for all signals and reduces top-k
//                  rows in fp32 fma order, 256 channels per warp item, exactly as the CPU backend does; with
//                  fewer tokens than CTAs a token's chunks are split over CTAs, one item per warp.
// Each phase runs its first, call-independent work while the call state is read (ll_call_gate.cuh).
// Signals: per destination, the CTA that knows the message count polls the completion counter and publishes the
// signal word (PublishWhenDone).
//
// Files: ll_device_common.cuh (constants, memory model, errors, proxy pushes, metrics stamps, signal waits and
// publishing), ll_call_gate.cuh (the graph-safe call state, read while a phase's first work runs), ll_routing.cuh
// (topk validation, token plans, scans, bf16 sums, FP8 encoder), ll_dispatch_send.cuh, ll_dispatch_recv.cuh,
// ll_combine_send.cuh and ll_combine_recv.cuh (the phases), ll_run_phases.cuh (a launch's phases behind the gate),
// this file (the two kernels, the launchers), ll_kernels_recv.cu (the same two kernels compiled for a receive-only
// launch: ll_kernels.h), those two again for a buffer of NVLink peers only that masks no rank (ll_kernels_nvlink*.cu,
// picked by the launchers: ll_kernels_nvlink.cu says why) and ll_kernels_expert_side*.cu (the expert-side combine's).
// Six translation units, each including the parts. The same sources build for AMD GPUs with
// hipcc (LLEP_GPU=hip): runtime/protocol/gpu_port.h maps the device intrinsics, runtime/protocol/gpu_api.h the runtime
// API; kernels/HIP_PORT.md.
#include <algorithm>

#include "kernels/cuda/ll_kernels.h"
#include "kernels/cuda/ll_run_phases.cuh"

// The driver's launch (ResolveLlLaunch): its types; the entry point comes from the runtime. (LLEP_GPU_HIP is set by
// runtime/protocol/gpu_port.h, included above.)
#if !defined(LLEP_GPU_HIP)
#include <cuda.h>
#endif

namespace llep::kernels::cuda {

// The two public kernels. Names are part of the contract (ll_kernels.h): demangled `llep::kernels::cuda::dispatch`
// and `llep::kernels::cuda::combine`.
__global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kDispatch, phase, smem, DispatchSend, DispatchRecv<true>);
}

__global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, phase, smem, CombineSend<false>, CombineRecv<false, true>);
}

// Metrics flush: a separate kernel so the two contract kernels keep their launch shape.
__global__ void bin_finished_ops(LlDeviceContext c) { BinFinishedOps(c, 0); }

cudaError_t FlushLlMetrics(const LlDeviceContext& ctx, cudaStream_t stream) {
  if (ctx.metrics == nullptr) return cudaSuccess;
  bin_finished_ops<<<1, 1, 0, stream>>>(ctx);
  return cudaGetLastError();
}

int64_t DispatchSharedBytes(const protocol::LlShape& s) {
  const int64_t send = DispatchScratchOffset(s.num_local_experts()) + static_cast<int64_t>(sizeof(PlanScratch));
  const int64_t recv = DispatchRecvSharedBytes(s);
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

int64_t CombineSharedBytes(const protocol::LlShape& s) {
  const int64_t send = int64_t{4} * (kWarps + 3 * int64_t{s.num_experts});  // CombineSend: warp sums, cnt, beg, pos
  const int64_t recv = CombineRecvPlansOffset(s) +
                       static_cast<int64_t>(kWarps * (sizeof(TokenPlan) + sizeof(CombineRecvPlan))) +
                       static_cast<int64_t>(sizeof(PlanScratch));
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

namespace {
/// Every kernel launched, as the untyped pointers both CUDA's and HIP's attribute calls take: this file's two, their
/// receive-only compilations (ll_kernels_recv.cu), the expert-side combine's two (ll_kernels_expert_side*.cu), then
/// the first four compiled for NVLink-only buffers (ll_kernels_nvlink*.cu), in LlLaunchHandles' order. fn(index,
/// kernel) for each, until one fails.
constexpr int kNumKernels = 10;
template <typename Fn>
cudaError_t ForEachKernel(Fn&& fn) {
  const void* const all[kNumKernels] = {reinterpret_cast<const void*>(dispatch),
                                        reinterpret_cast<const void*>(combine),
                                        reinterpret_cast<const void*>(ReceiveOnlyDispatchKernel()),
                                        reinterpret_cast<const void*>(ReceiveOnlyCombineKernel()),
                                        reinterpret_cast<const void*>(ExpertSideCombineKernel()),
                                        reinterpret_cast<const void*>(ReceiveOnlyExpertSideCombineKernel()),
                                        reinterpret_cast<const void*>(NvlinkOnlyDispatchKernel()),
                                        reinterpret_cast<const void*>(NvlinkOnlyCombineKernel()),
                                        reinterpret_cast<const void*>(NvlinkOnlyReceiveDispatchKernel()),
                                        reinterpret_cast<const void*>(NvlinkOnlyReceiveCombineKernel())};
  for (int i = 0; i < kNumKernels; ++i) {
    const cudaError_t e = fn(i, all[i]);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
}  // namespace

cudaError_t ConfigureLlKernels(int64_t bytes) {
  return ForEachKernel([&](int, const void* k) {
    return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  });
}

cudaError_t LlKernelsStaticSharedBytes(int64_t* bytes) {
  *bytes = 0;
  return ForEachKernel([&](int, const void* k) {
    cudaFuncAttributes a{};
    const cudaError_t e = cudaFuncGetAttributes(&a, k);
    *bytes = std::max(*bytes, static_cast<int64_t>(a.sharedSizeBytes));
    return e;
  });
}

#if defined(LLEP_GPU_HIP)
cudaError_t ResolveLlLaunch(LlLaunchHandles* out) {
  *out = LlLaunchHandles{};  // HIP: hipLaunchCooperativeKernel / hipLaunchKernel (LaunchLl)
  return cudaSuccess;
}
#else
using DriverLaunchFn = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);

cudaError_t ResolveLlLaunch(LlLaunchHandles* out) {
  *out = LlLaunchHandles{};
  LlLaunchHandles h;
  cudaDriverEntryPointQueryResult found{};
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", &h.launch, 12000, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || h.launch == nullptr) return e;
  void** const handles[kNumKernels] = {&h.dispatch,         &h.combine,         &h.dispatch_recv, &h.combine_recv,
                                       &h.combine_es,       &h.combine_es_recv, &h.dispatch_nv,   &h.combine_nv,
                                       &h.dispatch_nv_recv, &h.combine_nv_recv};
  e = ForEachKernel([&](int i, const void* k) {
    cudaFunction_t f = nullptr;
    const cudaError_t r = cudaGetFuncBySymbol(&f, k);
    *handles[i] = f;
    return r;
  });
  if (e != cudaSuccess) return e;
  *out = h;
  return cudaSuccess;
}
#endif

namespace {

/// A launch with a send phase has CTAs that wait for other CTAs of the same launch (PublishWhenDone polls the
/// completion counter the other CTAs add to; a kPhaseBoth launch also waits for signals its own send phase
/// publishes). That needs every CTA resident at once, which only the cooperative attribute guarantees: without it, a
/// kernel on another stream (a GEMM, the other micro-batch's launch) can hold SMs while launched CTAs spin, and the
/// operation stalls until the timeout. A receive-only launch waits only for peers, so it launches plainly, and runs
/// the operation's receive-only compilation (recv_kernel, recv_driver_fn: ll_kernels_recv.cu).
template <typename Params>
cudaError_t LaunchLl(void (*kernel)(Params, int), void (*recv_kernel)(Params, int), void* driver_fn,
                     void* recv_driver_fn, const Params& p, LlPhase phase, const LaunchConfig& cfg,
                     int64_t shared_bytes, cudaStream_t stream) {
  // The buffer's grid (ctx.grid, one launch count per CTA), or for a receive-only launch at most that many CTAs
  // (ReceiveOnlyCtas: its CTAs count the launch for the rest, TakeReceiveCall).
  const auto buffer_grid = static_cast<int64_t>(p.ctx.grid.divisor);
  if (phase == kPhaseRecv ? cfg.num_ctas < 1 || cfg.num_ctas > buffer_grid : cfg.num_ctas != buffer_grid) {
    return cudaErrorInvalidValue;
  }
  if (phase == kPhaseRecv) {
    kernel = recv_kernel;
    driver_fn = recv_driver_fn;
  }
#if defined(LLEP_GPU_HIP)
  // HIP 5.2 has no launch-attribute API: the cooperative launch is its own call.
  int phase_arg = static_cast<int>(phase);
  void* args[] = {const_cast<Params*>(&p), &phase_arg};
  const dim3 grid(static_cast<unsigned>(cfg.num_ctas)), block(kThreads);
  if ((phase & kPhaseSend) != 0) {
    return hipLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, block, args,
                                      static_cast<unsigned>(shared_bytes), stream);
  }
  return hipLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, args, static_cast<size_t>(shared_bytes),
                         stream);
#else
  const int cooperative = (phase & kPhaseSend) != 0 ? 1 : 0;
  if (cfg.handles != nullptr && driver_fn != nullptr) {
    CUlaunchConfig dc = {};
    dc.gridDimX = static_cast<unsigned>(cfg.num_ctas);
    dc.gridDimY = dc.gridDimZ = 1;
    dc.blockDimX = kThreads;
    dc.blockDimY = dc.blockDimZ = 1;
    dc.sharedMemBytes = static_cast<unsigned>(shared_bytes);
    dc.hStream = reinterpret_cast<CUstream>(stream);
    CUlaunchAttribute dattr[1];
    dattr[0].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    dattr[0].value.cooperative = cooperative;
    dc.attrs = dattr;
    dc.numAttrs = 1;
    int phase_arg = static_cast<int>(phase);
    void* args[] = {const_cast<Params*>(&p), &phase_arg};
    const auto launch = reinterpret_cast<DriverLaunchFn>(cfg.handles->launch);
    if (launch(&dc, static_cast<CUfunction>(driver_fn), args, nullptr) == CUDA_SUCCESS) return cudaSuccess;
    // Nothing was queued: the runtime's launch below reports the error in the runtime's terms (or, if the driver's
    // failure was its own, launches).
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(cfg.num_ctas));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = cooperative;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p, static_cast<int>(phase));
#endif
}

}  // namespace

namespace {
/// Whether a launch runs the NVLink-only compilations (ll_kernels_nvlink.cu): every peer of the buffer mapped (no
/// proxy region), no rank masking, and a top-k of at most 8 (the routing code they carry: kRouteK, ll_routing.cuh).
/// Their code is the general kernels' with those branches known untaken, so the choice changes no result, only the
/// code a launch fetches.
bool NvlinkOnly(const LlDeviceContext& c, int num_topk) {
  return c.proxy_region == nullptr && c.mask == nullptr && num_topk <= 8;
}
}  // namespace

cudaError_t LaunchDispatch(const DispatchParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  const LlLaunchHandles* h = cfg.handles;
  const int64_t smem = DispatchSharedBytes(p.ctx.layout.shape);
  if (NvlinkOnly(p.ctx, p.num_topk)) {
    return LaunchLl(NvlinkOnlyDispatchKernel(), NvlinkOnlyReceiveDispatchKernel(),
                    h != nullptr ? h->dispatch_nv : nullptr, h != nullptr ? h->dispatch_nv_recv : nullptr, p, phase,
                    cfg, smem, stream);
  }
  return LaunchLl(dispatch, ReceiveOnlyDispatchKernel(), h != nullptr ? h->dispatch : nullptr,
                  h != nullptr ? h->dispatch_recv : nullptr, p, phase, cfg, smem, stream);
}

CombineRecvSplit PlanCombineRecvSplit(int hidden, int num_tokens, int num_ctas) {
  CombineRecvSplit s;
  s.num_ctas = num_ctas;
  s.chunks = CombineRecvChunks(hidden);
  const int segs = std::max(1, std::min(CombineRecvSegsPerToken(hidden), num_ctas / std::max(num_tokens, 1)));
  s.token_ctas = protocol::FastDivisor::Make(static_cast<uint32_t>(num_ctas / segs));
  s.segs = protocol::FastDivisor::Make(static_cast<uint32_t>(segs));
  s.seg_chunks_lo = protocol::FastDivisor::Make(static_cast<uint32_t>(std::max(1, s.chunks / segs)));
  s.seg_chunks_hi = protocol::FastDivisor::Make(static_cast<uint32_t>(s.chunks / segs + 1));
  return s;
}

cudaError_t LaunchCombine(const CombineParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  // A split made for another grid than the receive phase's (a send-only launch does not read it).
  if ((phase & kPhaseRecv) != 0 && p.split.num_ctas != cfg.num_ctas) return cudaErrorInvalidValue;
  const LlLaunchHandles* h = cfg.handles;
  const int64_t smem = CombineSharedBytes(p.ctx.layout.shape);
  // The expert-side combine's own compilation (ll_kernels_expert_side.cu), also on NVLink-only buffers: compiled for
  // them as the other kernels are, its fused launch was 1.08-1.10x at T = 128 (one rank; bench/RESULTS.md session 61)
  // and, once its send's loads were in flight, level (0.97-1.02x, session 62): not worth a second pair of kernels.
  if (p.expert_reduced) {
    return LaunchLl(ExpertSideCombineKernel(), ReceiveOnlyExpertSideCombineKernel(),
                    h != nullptr ? h->combine_es : nullptr, h != nullptr ? h->combine_es_recv : nullptr, p, phase, cfg,
                    smem, stream);
  }
  if (NvlinkOnly(p.ctx, p.num_topk)) {
    return LaunchLl(NvlinkOnlyCombineKernel(), NvlinkOnlyReceiveCombineKernel(), h != nullptr ? h->combine_nv : nullptr,
                    h != nullptr ? h->combine_nv_recv : nullptr, p, phase, cfg, smem, stream);
  }
  return LaunchLl(combine, ReceiveOnlyCombineKernel(), h != nullptr ? h->combine : nullptr,
                  h != nullptr ? h->combine_recv : nullptr, p, phase, cfg, smem, stream);
}

}  // namespace llep::kernels::cuda
