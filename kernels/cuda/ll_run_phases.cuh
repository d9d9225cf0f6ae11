// The kernels' body (RunPhases) and the declarations of the kernels compiled apart, shared by the translation units
// that compile the kernels: kernels/cuda/ll_kernels.cu (the kernels every launch with a send phase runs, the
// launchers), kernels/cuda/ll_kernels_recv.cu (the same kernels compiled for a receive-only launch), those two again
// for a buffer of NVLink peers only (ll_kernels_nvlink*.cu) and the expert-side combine's (ll_kernels_expert_side*.cu).
// Each includes the phase parts; the device code of one is not shared with another.
#pragma once

#include "kernels/cuda/ll_call_gate.cuh"
#include "kernels/cuda/ll_combine_recv.cuh"
#include "kernels/cuda/ll_combine_send.cuh"
#include "kernels/cuda/ll_device_common.cuh"
#include "kernels/cuda/ll_dispatch_recv.cuh"
#include "kernels/cuda/ll_dispatch_send.cuh"
#include "kernels/cuda/ll_kernels.h"
#include "kernels/cuda/ll_routing.cuh"

namespace llep::kernels::cuda {

using DispatchKernelFn = void (*)(DispatchParams, int);
using CombineKernelFn = void (*)(CombineParams, int);

/// The kernels a receive-only launch (kPhaseRecv: a hook's receive) runs, from ll_kernels_recv.cu: the same names and
/// signatures as the kernels of ll_kernels.cu, the receive phase compiled alone (ll_kernels.h says why).
DispatchKernelFn ReceiveOnlyDispatchKernel();
CombineKernelFn ReceiveOnlyCombineKernel();
/// The expert-side combine's kernels (CombineParams::expert_reduced), from ll_kernels_expert_side.cu and
/// ll_kernels_expert_side_recv.cu: the same name and signature, its phases compiled apart from the other combine's.
CombineKernelFn ExpertSideCombineKernel();
CombineKernelFn ReceiveOnlyExpertSideCombineKernel();
/// The per-(token, expert) kernels compiled for a buffer of NVLink peers only that masks no rank (HasProxy / HasMask
/// false by construction), from ll_kernels_nvlink.cu (launches with a send phase) and ll_kernels_nvlink_recv.cu
/// (receive-only): the same names and signatures.
DispatchKernelFn NvlinkOnlyDispatchKernel();
CombineKernelFn NvlinkOnlyCombineKernel();
DispatchKernelFn NvlinkOnlyReceiveDispatchKernel();
CombineKernelFn NvlinkOnlyReceiveCombineKernel();

namespace {

/// A launch of one operation: its send phase, its receive phase, or both (kPhaseBoth), behind the call gate
/// (ll_call_gate.cuh: each phase opens it where it first needs the call), with the metrics stamps around them. Every
/// kernel is this body with its operation's phase functions: the phase a runtime argument in ll_kernels.cu, fixed to
/// kPhaseRecv in ll_kernels_recv.cu.
/// kPendingBeforeOpen = false: the launch's phases record no error before they open the gate, so the gate skips its
/// constructor's barrier (CallGate; the receive-only dispatch, ll_kernels_recv.cu).
template <bool kPendingBeforeOpen = true, typename Params>
__device__ __forceinline__ void RunPhases(const Params& p, LlOp op, int phase, uint8_t* smem,
                                          void (*send)(const Params&, CallGate&, uint8_t*),
                                          bool (*recv)(const Params&, CallGate&, uint8_t*)) {
  const LlDeviceContext& c = p.ctx;
  Trace(c, op, kTraceEntered);
  CallGate gate(c, op, phase, p.call_tag, kPendingBeforeOpen);
  if (phase & kPhaseSend) {
    send(p, gate, smem);
    if (gate.Open() == 0) return;  // refused (recorded) or aborted: this launch did nothing
    // Not thread 0: a CTA's thread 0 (or, counting without tokens, its last warp's lane 0: DispatchSend) may poll a
    // completion counter to publish a signal (FirstPublishedDst), and the record store need not wait for that (it only
    // has to land before the launch ends).
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 32) TrackSend(c, op, phase, p.call_tag, gate.launch_index());
  }
  if (phase & kPhaseRecv) {
    if (phase & kPhaseSend) {
      __syncthreads();  // the receive phase reuses the send phase's shared memory
      const uint32_t seq = gate.Open();
      if (threadIdx.x == 0) StampRecvStart(c, seq, NowNs());
    }
    const bool stamps = recv(p, gate, smem);
    // Every receive phase opens the gate before it returns, so the call is known here: reading it, not calling
    // Open() again, keeps Open()'s code (which the compiler cannot prove is not needed) off the phase's tail, a jump
    // over ~0.7 KiB at the end of every receive (ncu source counters, bench/RESULTS.md session 38).
    // Only CTAs that had receive work stamp its end (the dispatch; every combine CTA still does, see CombineRecv): at
    // small T most have none. Measured with the stamps still atomics: the dispatch receive 0.3-0.6 us shorter at
    // T = 8-32 with metrics on and off alike (its code changed too; bench/RESULTS.md session 48).
    if (gate.is_open() && gate.error_seq() != 0) StampRecvEnd(c, gate.error_seq(), stamps);
  }
}

}  // namespace
}  // namespace llep::kernels::cuda
