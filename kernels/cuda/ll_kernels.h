// The NVLink low-latency kernels: llep::kernels::cuda::dispatch and llep::kernels::cuda::combine.
// Layer: kernels/cuda; host-includable (no torch, no abseil). runtime/gpu_buffer.cc fills the parameter blocks
// and calls the launchers; the kernels implement the same protocol as the CPU backend (kernels/host/ll_host.h)
// on the same region layout (runtime/protocol/ll_layout.h), and GPU tests compare the two bit for bit.
//
// One kernel name per operation, the phase a runtime argument: the send and the receive phase of a receive hook are
// two launches of that name, so profilers that look for `::dispatch` / `::combine` see one row each
// (shared/spec/deepep-ll-api.md §8.1). No other kernel carries those words. A receive-only launch runs a second
// compilation of the same kernel (kernels/cuda/ll_kernels_recv.cu: internal linkage, the same name and signature,
// the receive phase compiled alone, which is faster: that file says by how much). At decode sizes a launch's time is
// its code path's; kernels/SMALL_T_CODE.md gives the measured rules the device code follows for it.
//
// Two kinds of peer, mixed freely in one launch (runtime/topology.h decides):
//  - NVLink peers: same-host ranks whose regions are mapped into this process (CUDA IPC); `peers[r]` is rank r's
//    region base as this GPU sees it (`peers[rank]` is the local region). Data goes with plain stores, then one
//    release store of the signal word per (operation, destination) after every warp's data is done.
//  - Proxy peers (`peers[r] == nullptr`): the send phase stages data in `proxy_region` (pinned host memory mapped
//    into the GPU, laid out like every region: d_payload / d_route_s / c_send of the call's half) and, after a system
//    fence, pushes one FIFO write command per message and one signal command per destination into `fifos[r]`
//    (runtime/protocol/fifo_cmd.h). The CPU proxy posts them as RDMA writes with immediates into the peer's
//    proxy_region; the peer's proxy publishes the signal word there only after every announced write arrived
//    (proxy/arrival_counter.h), so the receive phase reads a proxy source's signal, route block, payloads and combine
//    rows from proxy_region instead of the local region. (A NIC that registers GPU memory through dma-buf could
//    receive into the GPU region itself; the only path run today is this host-staged one.)
//
// Errors never trap: a kernel that finds a bad expert id, an inconsistent message or a silent peer records the
// first such event in `error` (mapped host memory the host reads without synchronising) and skips the work it
// cannot do safely. Bad ids are treated as -1 consistently by every phase, so the buffer stays usable; a
// timeout or a sequence overrun leaves the protocol state unknown and the host refuses further calls.
#pragma once

#include <cstdint>

#include "runtime/protocol/device_error.h"
#include "runtime/protocol/fifo_ring.h"
#include "runtime/protocol/gpu_api.h"
#include "runtime/protocol/ll_call.h"
#include "runtime/protocol/ll_layout.h"
#include "runtime/protocol/metrics_layout.h"

namespace llep::kernels::cuda {

/// Which part of an operation a launch runs.
enum LlPhase : int { kPhaseSend = 1, kPhaseRecv = 2, kPhaseBoth = 3 };

/// Channels of one dispatch send work item (16 per lane). A token is ceil(H / kDispatchChunk) payload items and one
/// header item (LlDeviceContext::send_items).
inline constexpr int kDispatchChunk = 512;
__host__ __device__ constexpr int DispatchSendItemsPerToken(int hidden) {
  return (hidden + kDispatchChunk - 1) / kDispatchChunk + 1;
}

/// Diagnostic timeline (LLEP_KERNEL_TRACE=1, off otherwise): thread 0 of every CTA stores the global timer (ns) at
/// these points of each launch into trace[(op * num_ctas + cta) * kTracePoints + point], so the last launch of
/// each operation leaves its timeline (the benchmark prints it). Points a CTA does not pass keep older values.
enum TracePoint : int {
  kTraceSendStart = 0,  ///< send phase entered
  kTraceCounted,        ///< dispatch: route-block counts written (counting CTAs)
  kTracePlanned,        ///< first token round planned (dispatch) / block positions computed (combine)
  kTraceStored,         ///< payload stores issued (all rounds / rows of the CTA)
  kTraceCounterDone,    ///< fences and completion counters of the CTA done
  kTracePublished,      ///< signal(s) of the CTA's destinations published (publishing CTAs)
  kTraceRecvStart,      ///< receive phase entered
  kTraceSignals,        ///< every source's signal seen
  kTraceRecvPlanned,    ///< receive layout / token plan ready
  kTraceRecvEnd,        ///< receive phase done
  kTraceEncoded,        ///< dispatch: warp 0's first payload chunk loaded and encoded (before its stores)
  kTraceFenced,         ///< dispatch: thread 0's fence (FenceBeforeCount) after the first round's stores
  kTraceEntered,        ///< the CTA started (before the call state): the launch's ramp, for receive-only launches too
  kTraceOpened,         ///< the gate opened: the call is known to the CTA (ll_call_gate.cuh)
  kTraceCallRead,       ///< the gate thread has read the call state (while the other warps started the phase)
  kTracePolled,         ///< publishing CTAs: the last destination's completion counter read full (before its signal)
  kTracePoints = 16,
};

/// Metrics (runtime/protocol/metrics_layout.h), when on: the kernels add to the counter block themselves, so graph
/// replays keep counting with no host work. An operation's latencies come from %globaltimer stamps in a ring of
/// kStampSlots entries indexed by seq % kStampSlots: CTA 0 stores the phase starts and the end of its wait; the
/// publishing CTAs and every CTA at the end of its receive work store their time with a max-reduction (no reset is
/// needed between uses of a slot: a later operation's times are larger). Every stamp is a store or a fire-and-forget
/// reduction: none loads first, so none delays its CTA. The latencies are binned by the receive phase of a later
/// operation (the binning CTA's BinsMetrics threads, a slot each), when every launch before it has finished, or by
/// FlushLlMetrics. The ring of 4 is enough: a send on slot s % 4 needs call s - 2 received (the in-flight rule), whose
/// receive launch came after call s - 4's and bins it.
struct OpStamps {
  uint64_t send_start;  ///< send phase entered (CTA 0)
  uint64_t send_end;    ///< the rank's last signal publish (StampLatest)
  uint64_t recv_start;  ///< receive phase entered (CTA 0)
  uint64_t wait_end;    ///< every source's signal seen (CTA 0)
  uint64_t recv_end;    ///< the last CTA's receive work end (StampLatest)
  uint32_t seq;         ///< the call that owns the slot (its send stamped it)
  uint32_t state;       ///< OpStampState
  uint32_t op;          ///< protocol::LlOp
  uint32_t recv_seq;    ///< the call whose receive stamped recv_start: seq once the owner's receive started
};
static_assert(sizeof(OpStamps) == 56, "host zero-fills kStampSlots of these");
enum OpStampState : uint32_t { kStampEmpty = 0, kStampSent = 1, kStampBinned = 2 };
inline constexpr int kStampSlots = 4;

/// Graph-safe call state, in device memory (zeroed once by the host). Which call sequence number, and so which half,
/// an operation uses is decided here on the device, never baked into a launch: every replay of every captured graph
/// stays consistent however many low-latency calls a graph holds and however graphs sharing one buffer interleave
/// (DeepEP keeps this parity on the host, so a graph with an odd number of calls corrupts its replays: DeepEP#93).
/// Only stream-ordered launches of one buffer touch it: those with a send phase on the buffer's grid (G CTAs,
/// LlDeviceContext::grid), receive-only ones on G' <= G (ReceiveOnlyCtas).
///  - Sequence: CTA b of a launch with a send phase counts it in its own LlCtaLaunches (LlDeviceContext::launches[b]),
///    so the count it finds is the launch's index n on this buffer and protocol::DeviceCallSeq(n) its sequence number.
///    Every such launch runs all G CTAs (the launchers refuse another grid) in stream order, so every CTA finds the
///    same n: one load and one store per CTA, read while the phase's first work runs (kernels/cuda/ll_call_gate.cuh).
///    (One counter all CTAs added to took an atomic on one address per CTA and a division by the grid.) A receive
///    launch of G' CTAs counts itself in the CTAs b, b + G', ... each of its CTAs b stands for, so all G counts agree.
///  - Pairing a receive launch with its send: the host gives every send a tag that is unique among the sends it
///    issued (DispatchParams::call_tag) and bakes the same tag into the receive launch (the hook), in a graph or
///    not. A receive launch looks its tag up among the operations sent and not yet received (the older one if a
///    graph holding the send was replayed twice) and marks it received by its own index (LlCtaLaunches::recvs). A mark
///    made by its own launch does not hide the operation from a CTA, so all CTAs agree whatever order they run in.
///    A tag, unlike a slot number, cannot pair a receive with another graph's operation.
///  - The host's in-flight rules (runtime/call_sequence.h), applied again here because the host cannot see replays:
///    a send needs the previous operation in its half received (protocol::kDeviceInFlight), and the previous operation
///    in its region (kind, half) received before some operation that was then sent and received
///    (protocol::kDeviceRegionBusy: peers may still read the region). Every CTA checks them before its first store, so
///    a refused send writes nothing. A receive launch whose tag names no waiting operation records
///    protocol::kDeviceBadReceive and does nothing. All three are fatal (the buffer must be rebuilt) and every later
///    launch on the buffer does nothing.
///  - The rules' state is a record of the calls so far, copied on write: sends read record[n % 2] (n's half, since
///    DeviceCallSeq keeps n's parity) and the send's last CTA writes the updated record[(n + 1) % 2] after its send
///    phase, so no CTA of a launch reads what its own launch changed. Receive launches between send n and n + 1 mark
///    record[(n + 1) % 2], the one the next send reads.
struct LlCallRecord {
  unsigned long long sent[2];      ///< per half: PackSent(tag, seq) of the last operation sent into it; 0 = none
  unsigned long long received[2];  ///< per half: PackReceived(seq, receive launch) of the last one received
  uint32_t sent_after[2][2];       ///< [op][half]: first seq sent after the region's last receive; 0 = none yet
  uint32_t newest_received;        ///< newest seq received so far; 0 = none
  uint32_t reserved[3];
};
static_assert(sizeof(LlCallRecord) == 64, "a send's first thread loads both records as eight 16-byte words");
struct alignas(128) LlCallState {
  LlCallRecord record[2];  ///< the call record before send n is record[n % 2]
};
/// One CTA's count of the launches on the buffer (LlCallState: each CTA counts for itself, one per launch; a smaller
/// receive-only grid's CTAs count for the CTAs it leaves out).
struct LlCtaLaunches {
  unsigned long long sends;  ///< launches with a send phase this CTA started
  unsigned long long recvs;  ///< receive-only launches this CTA started
};
/// Marks an operation that was received by its own (kPhaseBoth) launch.
inline constexpr uint32_t kReceivedInLaunch = 0xFFFFFFFFu;
__host__ __device__ constexpr unsigned long long PackSent(uint32_t tag, uint32_t seq) {
  return protocol::JoinHalves(tag, seq);
}
__host__ __device__ constexpr unsigned long long PackReceived(uint32_t seq, uint32_t launch) {
  return protocol::JoinHalves(seq, launch);
}

/// The dispatch's plan of this rank's tokens, kept for the combine receive (device memory, zeroed at creation;
/// LlDeviceContext::carried). A combine receive must know where each of its (token, slot) rows comes back: its position
/// among the rows this rank routed to the slot's rank, in (local expert, token) order. Counting it means every CTA
/// loading every token's top-k row and comparing it with its own tokens' (7 of a 14 us receive at T=128,
/// bench/RESULTS.md session 18); the dispatch send has it already (TokenPlan::row, and the per-destination counts of
/// its counting CTAs). Slot h holds the plan of the last dispatch sent in half h:
///  - header: {plan key (64 bits, DispatchCall::plan_key; 0 = none kept), the dispatch's seq, num_tokens | K << 24};
///  - prefix[E] (int32): for expert g on rank d, the rows this rank routed to d's local experts below g's;
///  - entries[T * kMaxTopK] (int32): token t slot k's row in its (expert, source) block, at t*K + k (the slot's expert
///    the combine takes from its own topk_idx);
///  - weights[T * kMaxTopK] (fp32): the combine_weights a dispatch carried (kMsgFlagWeights), at t*K + k, so that its
///    expert-side combine can check that its topk_weights are those the experts' ranks reduced with.
/// The key comes with the handle (CombineCall::plan_key), so a combine finds its own dispatch's plan, or the later of
/// two (a captured dispatch replayed into both halves); when it is gone (a later dispatch of the same half replaced
/// it, the handle has no key, more tokens than one round per CTA: T > kWarps * CTAs), the combine counts.
struct CarriedPlanArea {
  int64_t E, T;
  static constexpr int64_t kHeaderBytes = 16;
  LLEP_HD static constexpr int64_t header(int slot) { return kHeaderBytes * slot; }
  LLEP_HD constexpr int64_t prefix(int slot) const { return 2 * kHeaderBytes + int64_t{4} * E * slot; }
  LLEP_HD constexpr int64_t entries(int slot) const {
    return protocol::AlignUp(prefix(2), 16) + int64_t{4} * T * protocol::kMaxTopK * slot;
  }
  LLEP_HD constexpr int64_t weights(int slot) const { return entries(2) + int64_t{4} * T * protocol::kMaxTopK * slot; }
  LLEP_HD constexpr int64_t bytes() const { return weights(2); }
};

/// Warps of every low-latency kernel's CTA (kWarps of ll_device_common.cuh); host code sizes work splits with it.
inline constexpr int kWarpsPerCta = 16;
/// The per-(token, expert) combine send's pieces per row when it has few rows (CombineSendPerExpert): with rows *
/// kRowPieces <= G on an NVLink-only buffer row m's piece j is on CTA m * kRowPieces + j, else row m on CTA m % G.
inline constexpr int kRowPieces = 4;
/// Tokens per CTA a dispatch keeps its plan for (one round: one per warp), so a dispatch of more than this times the
/// CTAs keeps none (and cannot carry combine_weights: GpuBuffer::Dispatch refuses them).
inline constexpr int kMaxCarriedPlanTokensPerCta = kWarpsPerCta;

/// The messages a dispatch receive placed, kept on the expert rank for an expert-side combine
/// (kernels/EXPERT_SIDE_COMBINE.md; device memory, zeroed at creation; LlDeviceContext::expert_plans). Its combine send
/// reduces each message's rows into one partial row for the message's home rank, so it must know, per message, the
/// token, the rows the dispatch wrote and their weights; the route blocks that carried them belong to the peers (their
/// next dispatch into the half rewrites them, possibly while this rank's combine runs). Slot h holds the last dispatch
/// received in half h, written by that receive (the entries by each message's first item, the rest by the handle's
/// CTA), read by a later launch (stream order):
///  - header: as CarriedPlanArea's (key 0 when the dispatch carried no combine_weights);
///  - counts[R] (int32): messages received from each source (0 for a masked one);
///  - entry[src][j] (kEntryBytes): {token index on src, selections n, 0, 0}, rows[kMaxTopK] (int32: local expert *
///    R*T + row of recv_x, header order), weights[kMaxTopK] (fp32, the same order).
/// A combine finds its dispatch's slot by the handle's plan key, as CarriedPlanArea; gone (a later dispatch into the
/// half replaced it) is the caller's error (kDeviceCombineMismatch, kCombinePlanGone), not a fallback.
struct ExpertPlanArea {
  int64_t R, T;
  static constexpr int64_t kHeaderBytes = 16;
  static constexpr int64_t kEntryBytes = 16 + 8 * int64_t{protocol::kMaxTopK};
  LLEP_HD static constexpr int64_t header(int slot) { return kHeaderBytes * slot; }
  LLEP_HD constexpr int64_t counts(int slot) const {
    return 2 * kHeaderBytes + protocol::AlignUp(int64_t{4} * R, 16) * slot;
  }
  LLEP_HD constexpr int64_t entry(int slot, int src, int j) const {
    return counts(2) + ((int64_t{slot} * R + src) * T + j) * kEntryBytes;
  }
  LLEP_HD constexpr int64_t bytes() const { return entry(2, 0, 0); }
};

/// Per-rank state every launch needs. POD, passed by value.
struct LlDeviceContext {
  protocol::LlLayout layout;
  int rank = 0;
  uint8_t* const* peers =
      nullptr;               ///< device array [R]: NVLink peers' region bases in this address space, null = proxy
  uint8_t* local = nullptr;  ///< this rank's region base (== peers[rank], without the load)
  uint8_t* proxy_region = nullptr;  ///< device alias of the host-staged region of proxy traffic; null = no proxy peers
  const protocol::FifoRingHandle* fifos = nullptr;  ///< device array [R]: the command ring serving proxy peer r
  uint64_t* done = nullptr;  ///< device [2 halves][2 ops][R]: completion counters (self-resetting)
  /// device [2 halves][2 ops][R]: proxy sources' signal words as CTA 0 saw them in proxy_region, so the other CTAs
  /// poll device memory instead of all of them reading host memory over PCIe (bench/RESULTS.md)
  uint64_t* proxy_signals = nullptr;
  /// device [2 halves][E]: rows staged per combine block (local expert, proxy destination); the warp that stages a
  /// block's last row sends the whole block as one write and resets the counter
  uint64_t* proxy_blocks = nullptr;
  uint32_t* flags = nullptr;          ///< device [2]: [0] recoverable record claimed, [1] abort (fatal record claimed)
  LlCallState* calls = nullptr;       ///< device: the in-flight rule's call records
  LlCtaLaunches* launches = nullptr;  ///< device [num_ctas]: launch counts per CTA (graph-safe sequence numbers)
  protocol::DeviceErrorRecords* errors = nullptr;  ///< device pointer to the mapped host error records
  uint64_t timeout_ns = 0;                         ///< receive wait limit per signal
  uint64_t* trace = nullptr;    ///< optional [num_ctas][2 ops][kTracePoints] timeline (TracePoint); null = off
  uint64_t* metrics = nullptr;  ///< optional counter block (metrics_layout.h); null = metrics off
  OpStamps* stamps = nullptr;   ///< [kStampSlots] latency stamps; set with metrics
  protocol::MetricsLayout metrics_layout;
  /// Rank masking (DeepEP's enable_shrink), null when off. mask: device int32 [R], 1 = masked (not waited on; its
  /// tokens count 0 in a dispatch receive and its experts' top-k terms are dropped from a combine). A source silent
  /// for timeout_ns is masked instead of failing the call. verdicts: device [2 halves][2 ops][R] words
  /// PackSignal(seq, value | kMaskedVerdict) by which every CTA of a receive agrees on each source (WaitAllSources).
  int32_t* mask = nullptr;
  unsigned long long* verdicts = nullptr;
  uint8_t* carried = nullptr;  ///< device CarriedPlanArea{E, T}: the dispatches' token plans kept for their combines
  uint8_t* expert_plans = nullptr;  ///< device ExpertPlanArea{R, T}: the messages received, for expert-side combines
  /// Divisors fixed per buffer, so kernels divide by multiplying (fast_div.h) instead of running runtime integer
  /// divisions from a cold instruction cache: the send launches' grid (num_ctas; LaunchDispatch / LaunchCombine refuse
  /// another, and a receive-only launch more CTAs: `launches` has one entry per CTA), for a CTA's share of the
  /// tokens; and DispatchSendItemsPerToken(hidden), for a dispatch send's work item -> (token, chunk).
  protocol::FastDivisor grid;
  protocol::FastDivisor send_items;
};

/// A verdict's value for a masked source (signal values are at most T or the combine rows per source, far below).
inline constexpr uint32_t kMaskedVerdict = 0xFFFFFFFFu;

/// A launch's parameters: the call as the caller described it (runtime/protocol/ll_call.h, device pointers), plus
/// what the runtime adds.
struct DispatchParams : protocol::DispatchCall {
  LlDeviceContext ctx;
  uint32_t call_tag = 0;  ///< unique per host send (never 0); a split operation's receive launch carries it too
};

/// floor(log2(x)), x >= 1.
LLEP_HD int FloorLog2(uint32_t x) { return 31 - __builtin_clz(x); }
/// ceil(log2(x)), x >= 1.
LLEP_HD int CeilLog2(uint32_t x) { return x <= 1 ? 0 : FloorLog2(x - 1) + 1; }

/// The position of the n-th (from 0) set bit of a 16-bit mask with more than n bits set: four halving steps of
/// popcounts and selects (the loop unrolls; no branch), so a warp's lanes each find a different bit at once — the
/// dispatch send's header gathers a destination's selections from the lanes that hold them. CUDA's __fns answers the
/// same question; this form is the same code on HIP and is tested on the host (work_split_test.cu).
LLEP_HD int NthSetBit16(uint32_t mask, int n) {
  int pos = 0;
  for (int w = 8; w >= 1; w >>= 1) {
    const int c = __builtin_popcount((mask >> pos) & ((1u << w) - 1u));
    const bool up = n >= c;
    n -= up ? c : 0;
    pos += up ? w : 0;
  }
  return pos;
}

/// How often a phase splits each of `total` messages (2^lg parts, lo <= lg, and lg <= cap unless lo is above it): the
/// most parts that keep total << lg within `budget` (its CTAs or warps), at least 2^lo. The closed form of
/// `lg = lo; while (lg < cap && (total << (lg + 1)) <= budget) ++lg;`, a loop a small-T launch ran once per warp
/// from a cold instruction cache (the dispatch receive's segments, the expert-side combine send's chunks;
/// bench/RESULTS.md session 36).
LLEP_HD int SplitLog2(int total, int budget, int lo, int cap) {
  int fit = cap;
  if (total > 0) {
    fit = budget >= 1 ? FloorLog2(static_cast<uint32_t>(budget)) - FloorLog2(static_cast<uint32_t>(total)) : -1;
    if (fit > 0 && (total << fit) > budget) --fit;  // total << fit <= 2 * budget: no overflow
  }
  const int lg = cap < fit ? cap : fit;
  return lg > lo ? lg : lo;
}

/// 16-byte registers per lane a dispatch receive's copy holds (a segment's 512-byte slices; 8 KiB per warp would be
/// kCopyRegs): half of them, so the kernel has the registers for the receive's row resolution without spilling.
inline constexpr int kRecvCopyRegs = 8;
/// 512-byte slices of a dispatch receive's row copy: the payload's channel bytes (FP8: H, its scales stored apart;
/// BF16: 2H).
LLEP_HD int DispatchRecvSlices(int hidden, bool fp8) { return ((fp8 ? hidden : 2 * hidden) + 511) >> 9; }
/// log2 of the fewest segments a dispatch receive splits a message's `slices` (DispatchRecvSlices) into: each at most
/// kRecvCopyRegs slices (one copy pass), a power of two. DispatchRecv splits further while the items fit its CTAs
/// (SplitLog2); ReceiveOnlyCtas sizes a hook's receive grid by these items.
LLEP_HD int DispatchRecvMinSplitLog2(int slices) {
  return CeilLog2(static_cast<uint32_t>((slices + kRecvCopyRegs - 1) / kRecvCopyRegs));
}

/// How a combine receive deals its tokens to CTAs, from (hidden, num_tokens, CTAs): PlanCombineRecvSplit on the host,
/// once per call, so the receive divides by multiplying (fast_div.h) instead of running five runtime integer divisions
/// from a cold instruction cache in every CTA. A token's 256-channel chunks are split over `segs` CTAs when there are
/// fewer tokens than CTAs: CTA b takes token slot b % G_tok and segment b / G_tok (G_tok = num_ctas / segs), segment
/// s its chunks [s * chunks / segs, (s + 1) * chunks / segs), i.e. seg_chunks_lo or seg_chunks_lo + 1 of them.
struct CombineRecvSplit {
  int num_ctas = 0;                     ///< the launch's grid the split was made for (LaunchCombine checks it)
  int chunks = 0;                       ///< ceil(hidden / 256)
  protocol::FastDivisor token_ctas;     ///< G_tok
  protocol::FastDivisor segs;           ///< segments per token
  protocol::FastDivisor seg_chunks_lo;  ///< floor(chunks / segs)
  protocol::FastDivisor seg_chunks_hi;  ///< floor(chunks / segs) + 1

  /// CTA b's share of a call with num_tokens tokens.
  struct Cta {
    int slot, seg;                    ///< its tokens slot, slot + G_tok, ...; segment seg (>= segs: none)
    int ch_lo, ch_count;              ///< its chunks of each token
    int num_tokens;                   ///< how many tokens it reduces
    protocol::FastDivisor per_token;  ///< ch_count as a divisor (work item -> token of the round)
  };
  LLEP_HD Cta ForCta(int b, int num_tokens) const {
    Cta c;
    const int g_tok = static_cast<int>(token_ctas.divisor);
    c.seg = token_ctas.Div(b);
    c.slot = b - c.seg * g_tok;
    c.ch_lo = segs.Div(c.seg * chunks);
    c.ch_count = segs.Div((c.seg + 1) * chunks) - c.ch_lo;
    c.num_tokens = c.seg < static_cast<int>(segs.divisor) && num_tokens > c.slot
                       ? token_ctas.Div(num_tokens - c.slot + g_tok - 1)
                       : 0;
    // Scalars picked with selects, not a pointer to one of the two: that would put the divisors in local memory.
    const bool hi = c.ch_count == static_cast<int>(seg_chunks_hi.divisor);
    c.per_token.divisor = hi ? seg_chunks_hi.divisor : seg_chunks_lo.divisor;
    c.per_token.multiplier = hi ? seg_chunks_hi.multiplier : seg_chunks_lo.multiplier;
    c.per_token.shift = hi ? seg_chunks_hi.shift : seg_chunks_lo.shift;
    return c;
  }
  /// After a send phase (a fused launch), CTA b's index for ForCta, with num_ranks ranks. The combine's send gives its
  /// rows (or their pieces) to CTAs 0, 1, ... (kRowPieces) and the publishers are CTAs G-2-d (FirstPublishedDst), so a
  /// CTA that starts its receive early, with nothing sent, is one below the publishers: the tokens go there, from CTA
  /// G-2-R down, a token's segments side by side (at T = 1 on one rank the token's two segments were on CTAs 0 and 66,
  /// and CTA 0, which had sent rows first, saw the signals 0.6-0.8 us after a CTA that had not and was the launch's
  /// last CTA but one: recv_trace, bench/RESULTS.md session 57). Only where the sending CTAs, the tokens' and the
  /// publishers fit in the grid side by side, the sending CTAs estimated from num_tokens * num_topk rows (a balanced
  /// routing; the expert-side send has fewer): where they do not, every order puts tokens on CTAs that sent, and the
  /// moved order measured 1.02-1.05x at T = 16 (one rank, bench/RESULTS.md session 58). A bijection of [0, num_ctas).
  LLEP_HD int AfterSend(int b, int num_ranks, int num_tokens, int num_topk) const {
    const int n_segs = static_cast<int>(segs.divisor), g_tok = static_cast<int>(token_ctas.divisor);
    const int64_t rows = int64_t{num_tokens} * num_topk;
    const int64_t senders = rows * kRowPieces <= num_ctas ? rows * kRowPieces : rows;
    const int64_t token_ctas_used = int64_t{num_tokens < g_tok ? num_tokens : g_tok} * n_segs;
    if (senders + token_ctas_used + num_ranks + 2 > num_ctas) return b;
    const int top = num_ctas - 2 - num_ranks;  // >= 0: the test above
    int k = top - b;
    if (k < 0) k += num_ctas;
    if (k >= g_tok * n_segs) return k;  // no token's segment: the indices the first g_tok * n_segs leave
    const int slot = segs.Div(k);
    return slot + (k - slot * n_segs) * g_tok;
  }
};
CombineRecvSplit PlanCombineRecvSplit(int hidden, int num_tokens, int num_ctas);
/// A combine receive's work items per token: 256-channel chunks (8 channels a lane), one per warp of its CTA, so a
/// token's chunks are split over at most CombineRecvSegsPerToken CTAs (PlanCombineRecvSplit, ReceiveOnlyCtas).
inline int CombineRecvChunks(int hidden) { return (hidden + 255) / 256; }
inline int CombineRecvSegsPerToken(int hidden) { return (CombineRecvChunks(hidden) + kWarpsPerCta - 1) / kWarpsPerCta; }

/// The grid of a receive-only launch (a hook's receive), from the buffer's grid `num_ctas` (the send launches'): fewer
/// CTAs where a small T leaves most of them without a message or token. Such a CTA still reads the call state, marks
/// the launch, peeks the signals and meets the barriers, and the launch ends with its last CTA. Tiers from a sweep of
/// LLEP_NUM_CTAS (a quarter / half / all of 132 CTAs; at T=128, where every CTA has work, half was 10-20 % slower).
/// Measured against the whole grid (bench/RESULTS.md session 47, H200, DeepEP beside), settled receives: EP2 dispatch
/// 5.3-5.6 -> 4.4-4.5 us at T=1, 5.3-5.4 -> 4.7-4.9 at T=8, combine 5.8 -> 5.5 and 6.0 -> 5.6, T=32 0.3-0.4 us
/// shorter; EP4 dispatch 4.6-4.7 -> 4.2 and 5.2-5.4 -> 4.4-4.5, combine 5.7-5.8 -> 5.4 and 5.9 -> 5.6; level where
/// the grid stays whole (T >= 128). Half up to 128 messages, not 64 (session 51, EP4 T=32, 128 messages): settled
/// dispatch receive 5.1 us against 5.3-5.9 on the whole grid, combine 5.6-5.7 against 6.0-6.2.
/// The work is estimated from this rank's call: its messages, min(R, top-k) per token (in decode its peers send about
/// as many; a peer sending more only makes this receive slower, never wrong); a dispatch receive's items (`fp8`: its
/// payload's size) take the whole grid where that gives each its own CTA and half would not (below); a combine
/// receive also keeps its tokens' chunk split (CombineRecvSegsPerToken CTAs a token) and two tokenless CTAs for the
/// count check and the metrics binning. At least 4 CTAs (the dispatch receive's handle and binning CTAs apart from its
/// items), at most num_ctas.
/// The kernels keep the per-CTA launch counts of the whole grid (TakeReceiveCall), so launches of any grids may follow
/// each other. GpuBuffer decides it once per operation, when it sends (GpuPendingOp::recv_ctas).
inline int ReceiveOnlyCtas(int num_ctas, int num_ranks, int num_topk, int num_tokens, int hidden, bool combine,
                           bool fp8) {
  const int64_t messages = int64_t{num_ranks < num_topk ? num_ranks : num_topk} * num_tokens;
  int64_t g = messages <= 4 ? num_ctas / 4 : messages <= 128 ? num_ctas / 2 : num_ctas;
  if (!combine && messages > 4 && messages <= 128) {
    // A dispatch receive's items, its messages in their fewest segments (DispatchRecvMinSplitLog2), that overflow half
    // the grid but fit the whole one (less its handle and binning CTAs) take the whole one: an item per CTA, 4 warps
    // sharing its rows, instead of two or more items per CTA one warp each. Settled dispatch receive at T = 32 (FP8:
    // 128 items), 2 ranks sharing one H200 (the kernel alone there): 0.96-0.97x, 4.8 -> 4.6 us, L2 cold 0.96-0.98x,
    // three rounds (bench/RESULTS.md session 64; 4 warps per item on half the grid measured 0.99-1.00x). Half again
    // above the whole grid's items (session 51: EP4 T = 32, 256 items).
    const int64_t items = messages << DispatchRecvMinSplitLog2(DispatchRecvSlices(hidden, fp8));
    if (items > num_ctas / 2 - 2 && items <= num_ctas - 2) g = num_ctas;
  }
  if (combine) {
    const int64_t busy = (int64_t{num_tokens} + 2) * CombineRecvSegsPerToken(hidden);
    if (g < busy) g = busy;
  }
  if (g < 4) g = 4;
  return static_cast<int>(g < num_ctas ? g : num_ctas);
}

/// As DispatchParams; with zero_copy the rows are in c_send of kZeroCopyHalf and x is not read.
struct CombineParams : protocol::CombineCall {
  LlDeviceContext ctx;
  uint32_t call_tag = 0;   ///< as DispatchParams::call_tag
  CombineRecvSplit split;  ///< PlanCombineRecvSplit(hidden, num_tokens, the launch's CTAs)
};

/// The GPU backend's zero-copy combine rows (DeepEP's get_next_low_latency_combine_buffer) live in c_send of this half
/// for every call: the half is a device decision, so the host could not name "the next call's" staging, and a fixed
/// address is what a captured graph needs. The NVLink kernels read combine rows straight from x otherwise, so nothing
/// else uses that area; rows for a call are written after the previous combine's send launch (stream order).
inline constexpr int kZeroCopyHalf = 0;

/// What launching the kernels (the two, and their receive-only compilations) through the CUDA driver takes
/// (ResolveLlLaunch, once per buffer): the driver's cuLaunchKernelEx with the kernel's function handle costs 2.8-2.9 µs
/// of host time per launch on an H100 host against 3.4-3.7 µs for the runtime's cudaLaunchKernelEx with the kernel's
/// host stub (bench/launch_cost_bench.cu, bench/RESULTS.md session 32): on every decode step's dispatch, combine and
/// receive hook. Opaque pointers, so this header needs no driver header; all null (HIP, a driver without the entry
/// point) means the runtime's launch.
struct LlLaunchHandles {
  void* launch = nullptr;           ///< the driver's cuLaunchKernelEx
  void* dispatch = nullptr;         ///< CUfunction of `dispatch` in the current device's context
  void* combine = nullptr;          ///< CUfunction of `combine`
  void* dispatch_recv = nullptr;    ///< CUfunction of the receive-only `dispatch` (ll_kernels_recv.cu)
  void* combine_recv = nullptr;     ///< CUfunction of the receive-only `combine`
  void* combine_es = nullptr;       ///< CUfunction of the expert-side `combine` (ll_kernels_expert_side.cu)
  void* combine_es_recv = nullptr;  ///< CUfunction of the expert-side receive-only `combine`
  // The per-(token, expert) four compiled for a buffer of NVLink peers only that masks no rank (ll_kernels_nvlink.cu,
  // ll_kernels_nvlink_recv.cu).
  void* dispatch_nv = nullptr;
  void* combine_nv = nullptr;
  void* dispatch_nv_recv = nullptr;
  void* combine_nv_recv = nullptr;
};
/// Resolves the handles for the current device (after cudaSetDevice). An error leaves *out all null (runtime launches).
cudaError_t ResolveLlLaunch(LlLaunchHandles* out);

/// Launch geometry. Every CTA of a launch with a send phase must be resident at once (a publishing CTA waits for the
/// other CTAs' completion adds; a kPhaseBoth launch's receive waits on signals other CTAs publish), so those launches
/// are cooperative (a grid that cannot be co-resident is refused with cudaErrorCooperativeLaunchTooLarge instead of
/// stalling behind a concurrent kernel); and a CTA counts the routes of at most kMaxDestinationsPerCta destinations,
/// so num_ctas must be at least ceil(R / kMaxDestinationsPerCta). num_ctas is the buffer's grid (ctx.grid) for those
/// launches, at most that for a receive-only one (ReceiveOnlyCtas; a combine's split made for it).
struct LaunchConfig {
  int num_ctas = 0;
  const LlLaunchHandles* handles = nullptr;  ///< the driver's launch (ResolveLlLaunch); null: the runtime's
};
inline constexpr int kMaxDestinationsPerCta = 64;

/// Dynamic shared memory a launch needs for this shape; the host checks it against the device limit once.
int64_t DispatchSharedBytes(const protocol::LlShape& shape);
int64_t CombineSharedBytes(const protocol::LlShape& shape);
/// Raises the kernels' dynamic shared-memory limit to `bytes` (call once per device before launching).
cudaError_t ConfigureLlKernels(int64_t bytes);
/// The kernels' static shared memory (call state copy, peeked signals, ...), which the dynamic part shares the
/// per-block limit with.
cudaError_t LlKernelsStaticSharedBytes(int64_t* bytes);

/// Bins the latencies of every operation whose receive phase has been launched before this call (stream order) into
/// ctx.metrics: what a metrics snapshot runs first so the last operation's latencies are in it. A no-op when metrics
/// are off. One thread; the kernel's name (bin_finished_ops) carries neither "dispatch" nor "combine".
cudaError_t FlushLlMetrics(const LlDeviceContext& ctx, cudaStream_t stream);

cudaError_t LaunchDispatch(const DispatchParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream);
cudaError_t LaunchCombine(const CombineParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream);

}  // namespace llep::kernels::cuda
