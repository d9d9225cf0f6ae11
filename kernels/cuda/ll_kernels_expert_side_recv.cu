// The expert-side combine's receive-only kernel (a hook's receive): `combine` with CombineRecv<true> and the phase
// fixed to kPhaseRecv, as ll_kernels_recv.cu compiles the per-(token, expert) one (which says why the receive phase is
// compiled alone) and ll_kernels_expert_side.cu the expert-side one with a send phase (which says why apart).
#include "kernels/cuda/ll_run_phases.cuh"

namespace llep::kernels::cuda {

static __global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int /*phase*/) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, kPhaseRecv, smem, CombineSend<true>, CombineRecv<true, false>);
}

CombineKernelFn ReceiveOnlyExpertSideCombineKernel() { return combine; }

}  // namespace llep::kernels::cuda
