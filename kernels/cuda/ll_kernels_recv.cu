// The kernels a receive-only launch runs (a hook's receive, kPhaseRecv): `dispatch` and `combine` compiled again
// with the phase fixed, from the same phase parts as kernels/cuda/ll_kernels.cu (ll_run_phases.cuh).
//
// Why a second compilation: a receive-only launch of the one kernel runs the receive branch of code compiled for the
// send phase too (the dispatch: 120 registers and the send's live ranges; the receive alone needs 104). Compiled alone,
// the receive phase was 3-4 us faster at T >= 128 on 2 x H100, the same run against the one kernel (hook dispatch
// receive 11.0-11.8 -> 7.9-8.3 us at T=128, 15.0 -> 11.0 at T=256; combine receive 11.6-12.0 -> 10.7-10.8 at T=128)
// and level or faster below; an inlined receive-only copy inside the one kernel gained nothing, so it is the separate
// compilation, not the fixed phase, that counts. The price: the hook's send launch 0.1-0.5 us slower at T <= 128
// (bench/RESULTS.md session 37).
//
// Why the same names: profiler-based benchmarks (DeepEP's among them) need exactly one kernel named `dispatch` and
// one named `combine`, and find a hook's send and receive as launches of that name (shared/spec/deepep-ll-api.md
// section 8.1). These two have internal linkage and the signatures of ll_kernels.cu's kernels, so their names (mangled
// and demangled) are those kernels' names; the host reaches them through ReceiveOnlyDispatchKernel /
// ReceiveOnlyCombineKernel, and the launchers pick them for kPhaseRecv. The `phase` argument is kept for the identical
// signature; it is always kPhaseRecv here.
#include "kernels/cuda/ll_run_phases.cuh"

namespace llep::kernels::cuda {

static __global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchParams p, int /*phase*/) {
  extern __shared__ __align__(16) uint8_t smem[];
  // DispatchRecv records no error before its gate opens: no barrier before the call state's loads (SMALL_T_CODE.md 7).
  RunPhases</*kPendingBeforeOpen=*/false>(p, LlOp::kDispatch, kPhaseRecv, smem, DispatchSend, DispatchRecv<false>);
}

static __global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int /*phase*/) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, kPhaseRecv, smem, CombineSend<false>, CombineRecv<false, false>);
}

#if defined(LLEP_LL_NVLINK_ONLY)  // compiled again through ll_kernels_nvlink_recv.cu
DispatchKernelFn NvlinkOnlyReceiveDispatchKernel() { return dispatch; }
CombineKernelFn NvlinkOnlyReceiveCombineKernel() { return combine; }
#else
DispatchKernelFn ReceiveOnlyDispatchKernel() { return dispatch; }
CombineKernelFn ReceiveOnlyCombineKernel() { return combine; }
#endif

}  // namespace llep::kernels::cuda
