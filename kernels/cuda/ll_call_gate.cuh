// The graph-safe call state of a launch (LlCallState in ll_kernels.h), read while the phase's first work runs.
// Part of the kernels' device code (included by the phase parts, which ll_run_phases.cuh includes into ll_kernels.cu
// and ll_kernels_recv.cu; each part reopens the same private namespace): split by concern so a reader can hold each
// part.
//
// Why a gate: which call a launch runs (its sequence number, so its half) is decided on the device by the CTA's launch
// count and two record loads per CTA, a global round trip (~1.5 us per launch on H100, bench/RESULTS.md). Much of a
// phase does not depend on it: reading topk_idx and the handle, planning tokens and blocks, loading payloads. So one
// thread of the last warp reads the call state as the CTA starts (CallGate's constructor) while the other warps run
// that work; the phase opens the gate (CallGate::Open, CTA-wide) before anything that needs the call or that writes
// outside the CTA: a refused send still writes nothing, and an error found before the gate is opened is recorded
// with the call's number once it is known (PendingError). (Measured against thread 0 holding the reads in flight in
// registers, which spilled, and against cp.async copies into shared memory, which the CTA barrier after them waited
// for: bench/RESULTS.md.)
#pragma once

#include "kernels/cuda/ll_signals.cuh"

namespace llep::kernels::cuda {
namespace {

/// The parts of a call record the rules read (LlCallState), loaded bypassing L1 (earlier launches wrote them, on any
/// SM). Scalars picked with selects, never an array indexed by a runtime half: that would put them in local memory.
struct RecordView {
  unsigned long long sent0, sent1, received0, received1;
  uint32_t sent_after0, sent_after1;  ///< the launch's op, per half
  uint32_t newest_received;
  __device__ unsigned long long sent(int h) const { return h == 0 ? sent0 : sent1; }
  __device__ unsigned long long received(int h) const { return h == 0 ? received0 : received1; }
  __device__ uint32_t sent_after(int h) const { return h == 0 ? sent_after0 : sent_after1; }
};

__device__ __forceinline__ RecordView LoadRecordView(const LlCallRecord* r, LlOp op) {
  const uint4 sent = gpu::LoadCg(reinterpret_cast<const uint4*>(&r->sent[0]));
  const uint4 received = gpu::LoadCg(reinterpret_cast<const uint4*>(&r->received[0]));
  const uint2 after = gpu::LoadCg(reinterpret_cast<const uint2*>(&r->sent_after[static_cast<int>(op)][0]));
  const auto u64 = [](uint32_t lo, uint32_t hi) -> unsigned long long { return protocol::JoinHalves(hi, lo); };
  return RecordView{u64(sent.x, sent.y),
                    u64(sent.z, sent.w),
                    u64(received.x, received.y),
                    u64(received.z, received.w),
                    after.x,
                    after.y,
                    gpu::LoadCg(&r->newest_received)};
}

/// record[second] of the two views (selects, see RecordView).
__device__ __forceinline__ RecordView PickRecord(bool second, const RecordView& a, const RecordView& b) {
  return RecordView{second ? b.sent0 : a.sent0,
                    second ? b.sent1 : a.sent1,
                    second ? b.received0 : a.received0,
                    second ? b.received1 : a.received1,
                    second ? b.sent_after0 : a.sent_after0,
                    second ? b.sent_after1 : a.sent_after1,
                    second ? b.newest_received : a.newest_received};
}

/// The record a launch with a send phase found before its send (record[n % 2]), kept in shared memory by its last
/// CTA's gate thread for TrackSend: no CTA of the launch writes that record (receives are stream-ordered after their
/// send, LlCallState), so TrackSend need not load it again (a global round trip on the last CTA's way to its receive
/// phase) nor build its copy in local memory (a record indexed by a runtime half: the fused kernels' whole 64-byte
/// stack frame, now none). Hook dispatch send 0.94-0.97x at T <= 8 (EP2), the rest level (bench/RESULTS.md session 63).
__shared__ __align__(16) LlCallRecord g_record;

/// a is b or a later sequence number.
__device__ __forceinline__ bool AtOrAfter(uint32_t a, uint32_t b) { return a == b || protocol::SignalIsNewer(a, b); }

/// A launch with a send phase (the gate thread of every CTA): the operation's sequence number, after the in-flight
/// rules (LlCallState); 0 if a rule refuses the send (CTA 0 records why) or an earlier fatal error aborted the buffer.
/// *n_out is the launch's index n.
__device__ uint32_t TakeSendCall(const LlDeviceContext& c, LlOp op, unsigned long long* n_out) {
  LlCallState* s = c.calls;
  LlCtaLaunches* mine = c.launches + blockIdx.x;
  // Both records, the abort flag and the CTA's launch count load together: one round trip.
  const RecordView r0 = LoadRecordView(&s->record[0], op), r1 = LoadRecordView(&s->record[1], op);
  const bool aborted = Aborted(c);
  const unsigned long long n = gpu::LoadCg(&mine->sends);
  // The last CTA (TrackSend's) also loads both whole records, in the same round trip, and keeps record[h].
  const bool tracks = blockIdx.x == gridDim.x - 1;
  uint4 whole[2][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    whole[0][i] = tracks ? gpu::LoadCg(reinterpret_cast<const uint4*>(&s->record[0]) + i) : uint4{};
    whole[1][i] = tracks ? gpu::LoadCg(reinterpret_cast<const uint4*>(&s->record[1]) + i) : uint4{};
  }
  mine->sends = n + 1;  // read by this CTA of the next launch (stream order)
  *n_out = n;
  const uint32_t seq = protocol::DeviceCallSeq(n);
  const int h = protocol::HalfOfSeq(seq);
  if (tracks) {
#pragma unroll
    for (int i = 0; i < 4; ++i) reinterpret_cast<uint4*>(&g_record)[i] = h == 1 ? whole[1][i] : whole[0][i];
  }
  const RecordView r = PickRecord(h == 1, r0, r1);  // the record before send n is record[n % 2] == record[h]
  const uint32_t prev = static_cast<uint32_t>(r.sent(h));
  const uint32_t sent_after = r.sent_after(h);
  uint32_t code = protocol::kDeviceOk, detail = 0;
  if (prev != 0 && protocol::HighHalf(r.received(h)) != prev) {
    code = protocol::kDeviceInFlight;
    detail = prev;
  } else if (sent_after != 0 && (r.newest_received == 0 || !AtOrAfter(r.newest_received, sent_after))) {
    code = protocol::kDeviceRegionBusy;
    detail = sent_after;
  }
  if (code != protocol::kDeviceOk && blockIdx.x == 0) RecordError(c, code, op, -1, seq, detail);
  return code == protocol::kDeviceOk && !aborted ? seq : 0u;
}

/// Send n is done (last CTA, thread 32, after its send phase): the record the next send reads, with this send in it
/// (received at once for kPhaseBoth).
__device__ void TrackSend(const LlDeviceContext& c, LlOp op, int phase, uint32_t tag, unsigned long long n) {
  const uint32_t seq = protocol::DeviceCallSeq(n);
  const int h = protocol::HalfOfSeq(seq);
  LlCallRecord& r = g_record;  // record[h] as the gate thread found it (TakeSendCall); Open()'s barrier published it
  r.sent[h] = PackSent(tag, seq);
  if (phase == kPhaseBoth) {
    r.received[h] = PackReceived(seq, kReceivedInLaunch);
    r.sent_after[static_cast<int>(op)][h] = protocol::DeviceCallSeq(n + 1);
    if (r.newest_received == 0 || protocol::SignalIsNewer(seq, r.newest_received)) r.newest_received = seq;
  }
  uint4* const out = reinterpret_cast<uint4*>(&c.calls->record[h ^ 1]);
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = reinterpret_cast<const uint4*>(&r)[i];
}

/// A receive-only launch (the gate thread of every CTA): the sequence number of the sent, unreceived operation `tag`
/// names (the older one if two do), marked received by this launch in the record the next send reads; 0 if none does
/// (protocol::kDeviceBadReceive recorded) or the buffer aborted. See LlCallState for why every CTA reaches the same
/// answer.
__device__ uint32_t TakeReceiveCall(const LlDeviceContext& c, LlOp op, uint32_t tag) {
  LlCallState* s = c.calls;
  LlCtaLaunches* mine = c.launches + blockIdx.x;
  const RecordView r0 = LoadRecordView(&s->record[0], op), r1 = LoadRecordView(&s->record[1], op);
  const bool aborted = Aborted(c);
  const unsigned long long next_send = gpu::LoadCg(&mine->sends);  // no send runs during this launch
  const unsigned long long recvs = gpu::LoadCg(&mine->recvs);
  // A receive-only launch may run fewer CTAs than the buffer's grid (ReceiveOnlyCtas): CTA b counts the launch for
  // CTAs b + G', b + 2 G', ... too, so every CTA's count stays the same for the next launch, whatever its grid.
  for (uint32_t b = blockIdx.x; b < c.grid.divisor; b += gridDim.x) c.launches[b].recvs = recvs + 1;
  // The receive launch's index, never kReceivedInLaunch.
  const uint32_t launch = static_cast<uint32_t>(recvs % kReceivedInLaunch);
  const RecordView r = PickRecord((next_send & 1) != 0, r0, r1);
  int half = -1;
  uint32_t seq = 0;
#pragma unroll
  for (int h = 0; h < protocol::kNumHalves; ++h) {
    const uint32_t sent_seq = static_cast<uint32_t>(r.sent(h));
    const unsigned long long mark = r.received(h);
    const bool waiting = sent_seq != 0 && (protocol::HighHalf(mark) != sent_seq || protocol::LowHalf(mark) == launch);
    if (protocol::HighHalf(r.sent(h)) == tag && waiting && (half < 0 || protocol::SignalIsNewer(seq, sent_seq))) {
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
  LlCallRecord* out = &c.calls->record[next_send & 1];
  out->received[half] = PackReceived(seq, launch);
  out->sent_after[static_cast<int>(op)][half] = protocol::DeviceCallSeq(next_send);
  if (r.newest_received == 0 || protocol::SignalIsNewer(seq, r.newest_received)) out->newest_received = seq;
  return seq;
}

/// The thread that reads the call state: lane 0 of the last warp, the warp with the least early work in every phase
/// (work is dealt from warp 0; PeekSignals uses the two warps before it).
constexpr int kGateThread = kThreads - 32;

/// What the gate thread found, for the CTA.
struct GateShared {
  uint32_t seq;
  unsigned long long n;  ///< send launches: the launch's index
};
__shared__ GateShared g_gate;

/// A launch's call state (file comment). Constructed by every thread as the CTA starts: after one CTA barrier (the
/// pending-error slot is clear; none when pending_before_open is false, below), the gate thread reads the call state
/// while the other warps start the phase. Open() is CTA-wide and returns the call's sequence number, 0 when the launch
/// must do nothing (refused, recorded, or aborted); it may be called any number of times. pending_before_open = false:
/// no thread records a pending error before Open() (the receive-only dispatch), so the slot's clear needs no barrier of
/// its own (Open()'s orders it) and the call state's loads start as the CTA does.
class CallGate {
 public:
  __device__ CallGate(const LlDeviceContext& c, LlOp op, int phase, uint32_t tag, bool pending_before_open = true)
      : c_(c), op_(op), phase_(phase) {
    if (threadIdx.x == 0) g_pending_error.code = 0;
    if (threadIdx.x == kGateThread) entered_ns_ = NowNs();
    if (pending_before_open) __syncthreads();
    if (threadIdx.x == kGateThread) {
      g_gate.seq = (phase & kPhaseSend) ? TakeSendCall(c, op, &g_gate.n) : TakeReceiveCall(c, op, tag);
      TraceThis(c, op, kTraceCallRead);
    }
  }

  __device__ uint32_t Open() {
    if (seq_ != kSeqPending) return seq_;
    __syncthreads();
    seq_ = g_gate.seq;
    // The gate thread, not thread 0: warp 0 holds the CTA's first token or message while the gate's warp has none
    // (the stamps are stores; a pending error is recorded with atomics).
    if (threadIdx.x == kGateThread && seq_ != 0) {
      // Every thread's pending error was stored before the barrier.
      if (g_pending_error.code != 0) {
        RecordError(c_, g_pending_error.code, static_cast<LlOp>(g_pending_error.op), g_pending_error.peer, seq_,
                    g_pending_error.detail);
      }
      if (phase_ & kPhaseSend) {
        StampSendStart(c_, op_, seq_, entered_ns_);
      } else {
        StampRecvStart(c_, seq_, entered_ns_);
      }
      TraceThis(c_, op_, kTraceOpened);
    }
    return seq_;
  }

  /// The call is known (every thread agrees: Open() ended with a barrier).
  __device__ bool is_open() const { return seq_ != kSeqPending; }

  /// The number errors are recorded with now: the call's once open, else kSeqPending (kept, recorded by Open()). A
  /// phase that runs after another one opened the gate (the receive of a send+receive launch) must use this, not
  /// kSeqPending: Open() records pending errors only the first time.
  __device__ uint32_t error_seq() const { return seq_; }

  /// After Open() of a send launch: the launch's index (LlCallState).
  __device__ unsigned long long launch_index() const { return g_gate.n; }

 private:
  const LlDeviceContext& c_;
  LlOp op_;
  int phase_;
  uint32_t seq_ = kSeqPending;
  uint64_t entered_ns_ = 0;  ///< the gate thread
};

}  // namespace
}  // namespace llep::kernels::cuda
