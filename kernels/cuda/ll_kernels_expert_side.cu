// The expert-side combine's kernel (the dispatch carried combine_weights; kernels/EXPERT_SIDE_COMBINE.md): `combine`
// compiled with CombineSend<true> / CombineRecv<true>, for launches with a send phase. Its receive-only compilation
// is ll_kernels_expert_side_recv.cu (one kernel of this name per translation unit).
//
// Why apart: compiled into the one `combine`, the expert-side phases sat in line in every per-(token, expert) combine
// (10,920 instructions instead of 7,400 without them), and a combine that never ran them paid for them: with them
// compiled out, the fused combine was 0.93-0.98x at every T in every round, 11.0 -> 10.4 us at T=1 (2 x H200,
// bench/RESULTS.md session 50). The same name and signature as ll_kernels.cu's `combine`, internal linkage
// (ll_kernels_recv.cu says why); the launcher picks it by CombineParams::expert_reduced.
#include "kernels/cuda/ll_run_phases.cuh"

namespace llep::kernels::cuda {

static __global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, phase, smem, CombineSend<true>, CombineRecv<true, true>);
}

CombineKernelFn ExpertSideCombineKernel() { return combine; }

}  // namespace llep::kernels::cuda
