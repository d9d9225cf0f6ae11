// The receive-only kernels (a hook's receive) for a buffer of NVLink peers only that masks no rank and a top-k of at
// most 8: ll_kernels_recv.cu's two compiled as ll_kernels_nvlink.cu compiles the launches with a send phase (which
// says why), with HasProxy / HasMask false by construction and top-8 routing (kRouteK).
#define LLEP_LL_NVLINK_ONLY 1
#define LLEP_LL_TOPK_8 1
#include "kernels/cuda/ll_run_phases.cuh"

namespace llep::kernels::cuda {

static __global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchParams p, int /*phase*/) {
  extern __shared__ __align__(16) uint8_t smem[];
  // As ll_kernels_recv.cu's: no barrier before the call state's loads (SMALL_T_CODE.md 7).
  RunPhases</*kPendingBeforeOpen=*/false>(p, LlOp::kDispatch, kPhaseRecv, smem, DispatchSend, DispatchRecv<false>);
}

static __global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int /*phase*/) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, kPhaseRecv, smem, CombineSend<false>, CombineRecv<false, false>);
}

DispatchKernelFn NvlinkOnlyReceiveDispatchKernel() { return dispatch; }
CombineKernelFn NvlinkOnlyReceiveCombineKernel() { return combine; }

}  // namespace llep::kernels::cuda
