// `dispatch` and `combine` compiled for a buffer whose every peer is an NVLink peer and that masks no rank (no proxy
// region, no rank masking: LlDeviceContext::proxy_region and ::mask null), for launches with a send phase (what a
// CUDA graph replays, an eager call, a hook's send). Its receive-only compilation is ll_kernels_nvlink_recv.cu; the
// launchers (ll_kernels.cu) pick these whenever the buffer allows it.
//
// Why apart: the same phases, with HasProxy / HasMask (ll_device_common.cuh) false by construction, so the proxy's
// staging, command pushes and host-memory signals and the masking's verdicts are not in line on the paths a decode
// launch runs once from a cold instruction cache (kernels/SMALL_T_CODE.md: a jump over in-line code costs a fetch from
// far away). Compiled for sm_90a: the fused dispatch 9,600 -> 8,264 instructions and 121 -> 101 registers, the fused
// combine 6,400 -> 5,624 and 116 -> 110, the receive-only dispatch 3,352 -> 2,992 and combine 4,496 -> 4,152.
// Measured against the general kernels (one rank, three rounds at three placements, bench/RESULTS.md session 61): the
// fused dispatch 0.90-0.94x at T <= 32, the fused combine 0.91-0.98x, the hook dispatch send 0.90-0.95x, graph16
// 0.89-1.00x. The expert-side combine keeps its general compilation (ll_kernels.cu's LaunchCombine says why). The same
// names and signatures as ll_kernels.cu's kernels, internal linkage (ll_kernels_recv.cu says why).
#define LLEP_LL_NVLINK_ONLY 1
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
