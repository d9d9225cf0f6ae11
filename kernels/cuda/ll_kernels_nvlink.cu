// `dispatch` and `combine` compiled for a buffer whose every peer is an NVLink peer and that masks no rank (no proxy
// region, no rank masking: LlDeviceContext::proxy_region and ::mask null) and for a top-k of at most 8, for launches
// with a send phase (what a CUDA graph replays, an eager call, a hook's send). Its receive-only compilation is
// ll_kernels_nvlink_recv.cu; the launchers (ll_kernels.cu) pick these whenever the buffer and the call allow it.
//
// Why apart: the same phases, with HasProxy / HasMask (ll_device_common.cuh) false by construction, so the proxy's
// staging, command pushes and host-memory signals and the masking's verdicts are not in line on the paths a decode
// launch runs once from a cold instruction cache (kernels/SMALL_T_CODE.md: a jump over in-line code costs a fetch from
// far away), and with the routing code planning for top-8 only (kRouteK, ll_routing.cuh: no top-16 plan beside it).
// Compiled for sm_90a: the fused dispatch 9,600 -> 8,264 instructions (121 -> 101 registers) without the proxy and
// the masking, 7,184 (96) with top-8 routing too; the fused combine 6,400 -> 5,624 -> 4,968; the receive-only dispatch
// 3,352 -> 2,992, combine 4,496 -> 4,152 -> 3,496. Measured (one rank, same-run rounds at several placements,
// bench/RESULTS.md session 61): against the general kernels the fused dispatch 0.90-0.95x at T <= 32, the fused
// combine 0.91-0.98x, the hook dispatch send 0.90-0.95x, graph16 0.89-1.01x; top-8 routing on top of that the fused
// dispatch 0.92-0.95x at T = 32 and 0.94-0.97x at T = 256, level at T = 8 (0.98-1.04x), graph16 0.91-0.99x at T = 1
// and 0.94-0.99x at T = 32. The expert-side combine keeps its general compilation (ll_kernels.cu's LaunchCombine says
// why). The same names and signatures as ll_kernels.cu's kernels, internal linkage (ll_kernels_recv.cu says why).
#define LLEP_LL_NVLINK_ONLY 1
#define LLEP_LL_TOPK_8 1
#include "kernels/cuda/ll_run_phases.cuh"

namespace llep::kernels::cuda {

static __global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kDispatch, phase, smem, DispatchSend, DispatchRecv<true>);
}

static __global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, phase, smem, CombineSend<false>, CombineRecv<false, true>);
}

DispatchKernelFn NvlinkOnlyDispatchKernel() { return dispatch; }
CombineKernelFn NvlinkOnlyCombineKernel() { return combine; }

}  // namespace llep::kernels::cuda
