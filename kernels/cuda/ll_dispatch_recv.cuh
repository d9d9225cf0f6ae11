// The dispatch receive phase: signals, packed layout, payload fan-out to rows, scales (DispatchRecv).
// Part of the kernels' device code (ll_run_phases.cuh includes the parts into each translation unit that compiles
// kernels, kernels/cuda/ll_kernels*.cu; each part reopens the same private namespace): split by phase so a reader can
// hold each part.
#pragma once

#include "kernels/cuda/ll_call_gate.cuh"
#include "kernels/cuda/ll_routing.cuh"
#include "runtime/protocol/dispatch_msg.h"

namespace llep::kernels::cuda {
namespace {

/// Route-count words a dispatch receive loads early, one per thread (never the gate thread, which is reading the
/// call state then).
constexpr int kMaxEarlyRouteCounts = kGateThread;

/// Dispatch receive's shared memory: failed[4], msg_count[R], then the route-count words [2 halves][E] (loaded early,
/// or written by the table).
__host__ __device__ int64_t DispatchRecvWordsOffset(const protocol::LlShape& s) {
  return protocol::AlignUp(int64_t{4} * (4 + s.num_ranks), 16);
}
__host__ __device__ int64_t DispatchRecvSharedBytes(const protocol::LlShape& s) {
  return DispatchRecvWordsOffset(s) + int64_t{16} * s.num_experts;
}

/// FP8: a lane's scale word of the payload slices [q0, q0 + nq) (512 channels each, nq <= 8): the fp32 scale_inv of
/// group w = 4 q0 + lane, or for packed UE8M0 word w = q0 + lane (the exponents of groups 4w .. 4w + 3). `per_row` is
/// the words per local expert and row of recv_scales (H/128 or H/512); w < 0 for a lane without a word.
struct ScaleWord {
  uint32_t bits = 0;
  int w = -1;
};
__device__ __forceinline__ ScaleWord LoadScaleWord(const float* scales, int per_row, int q0, int nq, bool ue8m0) {
  const int lane = threadIdx.x % 32;
  ScaleWord s;
  const int w = ue8m0 ? q0 + lane : 4 * q0 + lane;
  if (lane < (ue8m0 ? nq : 4 * nq) && w < per_row) {
    s.w = w;
    if (ue8m0) {
      const float4 f = *reinterpret_cast<const float4*>(scales + 4 * w);
      s.bits = uint32_t{Ue8m0FromScaleInv(f.x)} | uint32_t{Ue8m0FromScaleInv(f.y)} << 8 |
               uint32_t{Ue8m0FromScaleInv(f.z)} << 16 | uint32_t{Ue8m0FromScaleInv(f.w)} << 24;
    } else {
      s.bits = __float_as_uint(scales[w]);
    }
  }
  return s;
}

/// Whether the dispatch receive loads the route counts early (DispatchRecv): all sources NVLink peers (a proxy
/// source's block is in host memory, read once, after its signal) and one word per thread.
__device__ __forceinline__ bool DispatchRecvEarlyCounts(const LlDeviceContext& c) {
  return !HasProxy(c) && c.layout.shape.num_experts <= kMaxEarlyRouteCounts;
}

/// The dispatch receive (one launch; every CTA):
///  1. waits for every source's signal (its message count; the peeked words when they are there already);
///  2. reads the route counts (words[half][src][le]; local expert le's block holds the rows of source 0, then of
///     source 1, ...). The last CTA (tokenless at small T) checks them all and writes the handle (recv_count,
///     layout_range, statistics). When the peek found every signal, the other CTAs skip steps 1-2: the early words
///     are the counts; after a send phase (kAfterSend: a launch a graph replays) they skip step 2;
///  3. copies messages (one per (token, rank)) to their rows. A warp finds its message's source by a warp scan over
///     the message counts, not a CTA-wide scan (two barriers fewer on the way to the first copy), and each selection's
///     lane its row by summing the counts of the sources before the message's. With one item per CTA (small T) 4 of
///     the CTA's warps share its rows.
/// Tried (bench/RESULTS.md session 17): each selection's lane loading the counts it needs from global memory after
/// the header (a dependent load: as slow as the table), and the first message's loads issued before the table (held
/// in registers or as L1 prefetches, the kernel spilled: 1.10-1.15x).
/// Returns whether this CTA stamps the receive's end (metrics): it copied a message, or wrote the handle, or the
/// receive failed (its stamp as before), or it is CTA 0. A CTA with none of these has no part in the receive's
/// latency. CTA 0 always: it stamped the wait's end, so the receive's end is never before it (BinFinishedOp drops such
/// a slot), also when no CTA had a message.
/// kAfterSend: the receive phase of a launch with a send phase (ll_kernels.cu); false in the receive-only
/// compilation (ll_kernels_recv.cu), whose code this flag leaves as it was.
template <bool kAfterSend>
__device__ __forceinline__ bool DispatchRecv(const DispatchParams& p, CallGate& gate, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = static_cast<int>(L.local_experts.divisor), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows();
  const bool fp8 = p.mode.use_fp8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  const bool writes_handle = blockIdx.x == G - 1;
  // Shared: failed flag, msg_count[R] (messages per source, -1 masked), then the route-count words [half][src][le]:
  // loaded early (DispatchRecvEarlyCounts), and where the table is built, its checked counts tagged with the call.
  int* failed = reinterpret_cast<int*>(smem);
  int* msg_count = failed + 4;
  auto* words = reinterpret_cast<uint64_t*>(smem + DispatchRecvWordsOffset(L.shape));
  // Route-count word le of source sr's block for half h (in the source's region). Callers pass (sr, le): the item's
  // reload of a word (rare, but in line on its path) does not divide by E_loc to find the source again.
  const auto count_word = [&](int h, int sr, int le) {
    return reinterpret_cast<const uint64_t*>(SrcBase(c, sr) + L.RouteRecvOffset(h, sr)) + le;
  };

  Trace(c, LlOp::kDispatch, kTraceRecvStart);
  // Nothing before gate.Open() below records an error (the receive-only dispatch's gate relies on it:
  // ll_kernels_recv.cu).
  if (tid == 0) *failed = 0;
  const bool was_open = gate.is_open();
  // The route counts are tagged with their call (protocol::PackRouteCount), so thread i < E loads word i now, with
  // the signal peek and while the call state is read: for both halves in a receive-only launch (the half is not known
  // yet), for the call's half after a send phase. Usually (a hook's receive runs after its send finished everywhere)
  // the layout table below then needs no load after the signals (signals -> table 1.05 -> 0.70 us at T=1, recv_trace;
  // bench/RESULTS.md session 19). A word not tagged with the call is loaded again after the signals.
  const bool early = DispatchRecvEarlyCounts(c);
  const int known_half = was_open ? protocol::HalfOfSeq(gate.error_seq()) : -1;
  uint64_t early0 = 0, early1 = 0;
  if (early && tid < E) {
    const int sr = L.local_experts.Div(tid), le = tid - sr * E_loc;
    if (known_half != 1) early0 = gpu::LoadRelaxedSys(count_word(0, sr, le));
    if (known_half != 0) early1 = gpu::LoadRelaxedSys(count_word(1, sr, le));
  }
  const bool peeked = !was_open && PeekSignals(c, LlOp::kDispatch);  // after the loads above: all in flight together
  if (early && tid < E) {
    words[tid] = early0;
    words[E + tid] = early1;
  }
  const uint32_t seq = gate.Open();  // its barrier also publishes *failed = 0, unless the gate was open already
  if (seq == 0) return false;
  if (was_open) __syncthreads();
  const int half = protocol::HalfOfSeq(seq);
  // Usually (a hook's receive) the peek found every source's signal and the early words hold the route counts: then
  // a CTA other than the handle's waits for nothing and builds no table ("direct"), and each selection's lane sums
  // the counts it needs itself (route_count below). The wait, the table and their barriers took CTAs from the gate's
  // opening to their first message in 1.9 us of a 7 us receive at T=1 (recv_trace, bench/RESULTS.md session 21). The
  // handle's CTA builds the table as before: it writes recv_count and layout_range and checks every count of the call.
  // The metrics' binning CTA takes the signal path too: ReceiveSignals bins.
  // After a send phase there is no peek (the gate was open), so every CTA waits for the signals; then only the
  // handle's CTA builds the table (and a CTA without early counts or with rank masking), the others resolve rows as
  // the direct path does, a lane reloading a word not yet tagged with the call. Together with the handle's CTA not
  // publishing (FirstPublishedDst, ll_signals.cuh), the fused dispatch 0.93-0.98x at T = 1-256, one rank; the table in
  // every CTA had been 0.5 us of its receive at T = 1 (bench/RESULTS.md sessions 56-58).
  const bool table = !kAfterSend || writes_handle || !early || HasMask(c);
  const bool direct = !kAfterSend && peeked && early && !HasMask(c) && !writes_handle && !BinningCta(c, false) &&
                      AllSignalsPeeked(c, half, seq, T);
  if (!direct) {
    ReceiveSignals(c, LlOp::kDispatch, half, seq, T, p.wait_recv_cost_stats, msg_count, failed, peeked, kAfterSend);
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceSignals);
    if (*failed) return true;
    if (table) {
      // The layout table. A masked source (msg_count -1, rank masking) sends nothing: its route block is stale, not
      // read. A word still not tagged with the call after the source's signal is a stale or overwritten block:
      // rejected.
      for (int i = tid; i < E; i += kThreads) {
        const int sr = L.local_experts.Div(i);
        uint32_t n = 0;
        if (msg_count[sr] >= 0) {
          uint64_t w = early ? words[half * E + i] : 0;
          if (protocol::RouteCountSeq(w) != seq) w = gpu::LoadRelaxedSys(count_word(half, sr, i - sr * E_loc));
          n = protocol::RouteCountSeq(w) == seq ? protocol::RouteCountValue(w) : ~0u;
        }
        if (n > static_cast<uint32_t>(T)) failed[0] = 1 + sr;  // one source recorded, once, after the barrier
        words[half * E + i] = protocol::PackRouteCount(seq, n);
      }
      __syncthreads();
      if (*failed) {
        if (tid == 0) RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, *failed - 1, seq, -1);
        return true;
      }
      if (writes_handle) {
        // The expert-side plan's header and message counts (ExpertPlanArea; its entries come with the messages). Every
        // dispatch writes the header, so a dispatch without combine_weights also retires the half's older plan.
        const ExpertPlanArea xp{R, T};
        const uint64_t key = p.carries_weights ? p.plan_key : 0;
        if (tid == 0)
          StorePlanHeader(c.expert_plans + ExpertPlanArea::header(half), key, seq, p.num_tokens, p.num_topk);
        for (int sr = tid; key != 0 && sr < R; sr += kThreads) {
          reinterpret_cast<int*>(c.expert_plans + xp.counts(half))[sr] = max(msg_count[sr], 0);
        }
        for (int le = tid; le < E_loc; le += kThreads) {
          int acc = 0;
          for (int sr = 0; sr < R; ++sr) {
            const int n = static_cast<int>(protocol::RouteCountValue(words[half * E + sr * E_loc + le]));
            p.layout_range[int64_t{le} * R + sr] = protocol::PackLayoutRange(n, acc);
            acc += n;
          }
          p.recv_count[le] = acc;
          if (p.cumulative_local_expert_recv_stats != nullptr)
            atomicAdd(&p.cumulative_local_expert_recv_stats[le], acc);
          if (c.metrics != nullptr)
            AddMetric(c, c.metrics_layout.expert_recv_tokens(p.layer, le), static_cast<uint64_t>(acc));
        }
      }
    }
  } else {
    Trace(c, LlOp::kDispatch, kTraceSignals);
  }
  StampWaitEnd(c, seq);
  // Messages per source, and route count (src, le) of the call: ~0u for a word not tagged with it (a bad message).
  const auto messages = [&](int src) {
    return direct ? static_cast<int>(protocol::SignalValue(g_peeked_signals[half][src])) : msg_count[src];
  };
  const auto route_count = [&](int src, int le) -> uint32_t {
    const int i = src * E_loc + le;
    const uint64_t w = words[half * E + i];
    if (protocol::RouteCountSeq(w) == seq) return protocol::RouteCountValue(w);
    // Only without a table (the table tags every word).
    const uint64_t again = gpu::LoadRelaxedSys(count_word(half, src, le));
    return protocol::RouteCountSeq(again) == seq ? protocol::RouteCountValue(again) : ~0u;
  };
  Trace(c, LlOp::kDispatch, kTraceRecvPlanned);

  // A message (one per (token, rank)) carries up to top-k rows. When there are fewer messages than CTAs, several
  // CTAs copy one message: its payload's 512-byte slices (a 16-byte store per lane) split into segments, each
  // with the FP8 scales of its channels. One warp storing all of a message's rows was the longest step of a small-T
  // receive (recv_trace at T=1: 2.9 us for the payload's 8 rows, then 1.4 us for their scales), and so was one item
  // storing a message's scales (6.4 us at T=1 against 4.8 for the payload items, session 21). Segments target one item
  // per CTA, not per warp: splitting down to a warp per slice at T=128 (1 rank) cost the dispatch kernel 7 %
  // (re-read headers, more warps fetching cold code), bench/RESULTS.md session 14.
  const MessageScan scan = ScanMessages(messages, R);
  const int total = scan.total;
  // A payload's bytes and its segments' offsets in 32 bits (H <= protocol::kMaxHidden: at most 128 KiB): 64-bit
  // arithmetic is two instructions for one on a path the small-T receive runs once, cold.
  static_assert(int64_t{2} * protocol::kMaxHidden + 511 <= INT32_MAX, "a payload's byte offsets fit 32 bits");
  const int bytes = fp8 ? H : 2 * H;
  const int slices = DispatchRecvSlices(H, fp8);
  // 2^lg segments per message: the fewest with at most kRecvCopyRegs slices each (one copy pass, its loads issued
  // with the header's), doubled while they stay within the slices and one item per CTA (SplitLog2). A power of two, so
  // an item splits into (message, segment) and a segment into slices by shifts: the runtime divisions did that in ~100
  // instructions, run once per item from a cold instruction cache (bench/RESULTS.md session 22).
  // Items go to the CTAs before G-2 (all of them below 4): CTA G-1 builds the table and writes the handle and CTA G-2
  // bins the metrics (BinningCta) before their first item could start; after a send phase CTA G-2 publishes rank 0's
  // signal instead and starts its receive last (FirstPublishedDst).
  const int G_items = G >= 4 ? G - 2 : G;
  const int lg0 = DispatchRecvMinSplitLog2(slices);
  const int lg = SplitLog2(total, G_items, lg0, FloorLog2(static_cast<uint32_t>(slices)));
  const int items = total << lg;
  // With at most one item per CTA (T <= 32 at EP2) 2^lw = 4 of the CTA's warps share its item: each loads and checks
  // the item and stores every 4th of its selections' rows, so the rows are stored in parallel instead of one after
  // another by one warp (T=1, EP2: 16 items of ~4 rows; one warp -> all 16 warps took the receive 6.0-6.4 -> 5.9 us,
  // bench/RESULTS.md session 35). 4 warps rather than 16: every warp of the item loads its header, segment and scales
  // (the lines come from the CTA's L1 after the first), so 16 warps were 16 copies of the loads and of the cold code's
  // fetches for ~4 rows: 16 -> 4 warps took the receive-only launch 5.3-5.9 -> 5.0-5.2 us at T=1 (session 37). With
  // several items per CTA (T >= 128) every warp has an item already: no gain measured there, only repeated loads.
  static_assert(kWarps % 4 == 0, "lw: the item's warps divide the CTA's");
  const int lw = items <= G_items ? 2 : 0;
  const int sub = warp & ((1 << lw) - 1);  // which of the item's warps this is
  const bool ue8m0 = p.mode.use_ue8m0;
  // recv_scales words per (local expert, row): H/512 or H/128 (num_packed_ue8m0, num_scales), as a shift: the
  // compiler turned the two constant divisions into one runtime division by the selected divisor.
  static_assert(protocol::kChannelsPerScale == 128 && protocol::kChannelsPerPackedUe8m0 == 512);
  const int scales_per_row = static_cast<int>(static_cast<unsigned>(H) >> (ue8m0 ? 9 : 7));
  for (int item = blockIdx.x < G_items ? (warp >> lw) * G_items + blockIdx.x : items; item < items;
       item += G_items * (kWarps >> lw)) {
    const int m = item >> lg, s = item & ((1 << lg) - 1);
    const int q0 = (s * slices) >> lg, nq = (((s + 1) * slices) >> lg) - q0;  // the segment's slices
    const int lo = q0 * 512, seg_bytes = min(bytes - lo, nq * 512);
    const MessageRef ref = LocateMessage(messages, R, m, scan);
    const int src = ref.src, j = ref.j;
    const uint8_t* in = SrcBase(c, src);
    const uint8_t* hdr = in + L.RouteHeaderOffset(L.RouteRecvOffset(half, src), j);
    const uint8_t* payload = in + L.DispatchRecvOffset(half, src, j, fp8);
    // The header, the segment's bytes and its scales (and for the expert-side plan the message's weights row):
    // independent loads, issued together.
    const uint32_t word = lane < 20 ? reinterpret_cast<const uint32_t*>(hdr)[lane] : 0u;
    const bool lead = s == 0 && sub == 0;  // the message's first item's first warp records errors, writes src_info
    const bool keeps = p.carries_weights && lead;  // and keeps the message's plan entry
    const uint32_t weight =
        keeps && lane < kK
            ? reinterpret_cast<const uint32_t*>(in + L.RouteWeightsOffset(L.RouteRecvOffset(half, src), j))[lane]
            : 0u;
    uint4 v[kRecvCopyRegs];
    LoadCopyPass(payload + lo, seg_bytes, v);
    const ScaleWord sw = fp8 ? LoadScaleWord(reinterpret_cast<const float*>(payload + protocol::Fp8ScalesOffset(H)),
                                             scales_per_row, q0, nq, ue8m0)
                             : ScaleWord{};
    const int src_token = static_cast<int>(gpu::WarpShfl(word, 0));
    const uint32_t w1 = gpu::WarpShfl(word, 1);
    const int num_sel = static_cast<int>(w1 & 0xFFFF);
    const uint32_t flags = gpu::WarpShfl(word, 3);
    const bool ok = (w1 >> 16) == protocol::kDispatchMsgVersion && gpu::WarpShfl(word, 2) == seq &&
                    ((flags & protocol::kMsgFlagFp8) != 0) == fp8 &&
                    ((flags & protocol::kMsgFlagWeights) != 0) == p.carries_weights && num_sel >= 1 && num_sel <= kK &&
                    src_token >= 0 && src_token < T;
    if (!ok) {
      if (lane == 0 && lead) RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, src, seq, j);
      continue;
    }
    // Lane i < num_sel resolves selection i to its output row; rejected selections are recorded and skipped. The row
    // inside the local expert's packed block: the rows of the sources before src, then src's row r. Every lane runs
    // the sum over the same sources (a lane without a selection reads expert 0's counts and drops them): the warp stays
    // converged, where a loop of the selection lanes alone ended diverged and its warp vote below took the compiler's
    // out-of-line re-convergence path (ncu source counters, bench/RESULTS.md session 38).
    const uint32_t sel = gpu::WarpShfl(word, (4 + lane) & 31);
    const bool has_sel = lane < num_sel;
    const int sel_le = static_cast<int>(protocol::SelectionExpert(sel));
    const uint32_t r = protocol::SelectionRow(sel);
    bool bad = has_sel && sel_le >= E_loc;
    const int count_le = has_sel && !bad ? sel_le : 0;
    uint32_t before = 0, n = 0;
    if constexpr (kAfterSend) {
      // After a send phase only the handle's CTA has a table, and the early words are often stale (a source's counts
      // arrive after the CTA's receive started), so route_count reloads. The warp's lanes share the reloads: 2^ls
      // lanes per source (8, or 16 for a message with more than 8 selections), lane (s, i) loading source s's count
      // of selection i's expert, so a pass loads 32 >> ls sources' words at once where one lane would load them one
      // after another (a message from source s waited for s + 1 reloads); lane i sums them from shuffles.
      static_assert(kK <= 16, "a message's selections on lanes 0-15: lane i of every 2^ls-lane group is selection i");
      const int ls = num_sel > 8 ? 4 : 3, i = lane & ((1 << ls) - 1);
      const int le_i = gpu::WarpShfl(count_le, i);
#pragma unroll 1
      for (int s_base = 0; s_base <= src; s_base += 32 >> ls) {
        const int s = s_base + (lane >> ls);
        const uint32_t w = s <= src ? route_count(s, le_i) : 0u;
#pragma unroll 1
        for (int u = 0; u < (32 >> ls) && s_base + u <= src; ++u) {
          before += n;
          n = gpu::WarpShfl(w, (u << ls) | i);
          bad |= has_sel && n > static_cast<uint32_t>(T);
        }
      }
    } else {
#pragma unroll 1
      for (int s0 = 0; s0 <= src; ++s0) {
        before += n;
        n = route_count(s0, count_le);
        bad |= has_sel && n > static_cast<uint32_t>(T);
      }
    }
    bad |= has_sel && r >= n;
    int64_t my_row = -1;
    int my_le = 0, my_rr = 0;
    if (has_sel && !bad) {
      my_le = sel_le;
      my_rr = static_cast<int>(before + r);
      my_row = int64_t{my_le} * rows + my_rr;
      if (lead) p.src_info[my_row] = src_token;
    }
    if (gpu::WarpAny(bad) && lane == 0 && lead) {
      RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, src, seq, j);
    }
    if (keeps) {  // the message's entry of the expert-side plan (ExpertPlanArea): token, rows and weights
      uint8_t* const e = c.expert_plans + ExpertPlanArea{R, T}.entry(half, src, j);
      if (lane == 0) *reinterpret_cast<int2*>(e) = make_int2(src_token, num_sel);
      if (lane < num_sel) {
        reinterpret_cast<int*>(e + 16)[lane] = static_cast<int>(my_row);
        reinterpret_cast<uint32_t*>(e + 16 + 4 * kK)[lane] = weight;
      }
    }
    // This warp's rows: the selections with a row whose rank among them is sub modulo 2^lw.
    const unsigned with_row = gpu::WarpBallot(my_row >= 0);
    const unsigned targets =
        gpu::WarpBallot(my_row >= 0 && (__popc(with_row & ((1u << lane) - 1)) & ((1 << lw) - 1)) == sub);
    // The segment goes through registers: loaded once, stored to every selection's row, with its scale words
    // (fp32: [E_loc, H/128, R*T]; packed UE8M0: int32 [E_loc, H/512, R*T], byte g % 4 of word g / 4 = group g).
    for (unsigned t = targets; t != 0; t &= t - 1) {
      const int i_sel = __ffs(t) - 1;
      const int64_t row = gpu::WarpShfl(my_row, i_sel);
      StoreCopyPass(static_cast<uint8_t*>(p.recv_x) + row * bytes + lo, seg_bytes, v);
      const int le = gpu::WarpShfl(my_le, i_sel), rr = gpu::WarpShfl(my_rr, i_sel);
      if (sw.w >= 0) static_cast<uint32_t*>(p.recv_scales)[(int64_t{le} * scales_per_row + sw.w) * rows + rr] = sw.bits;
    }
  }
  if (c.trace != nullptr) {
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceRecvEnd);
  }
  return blockIdx.x == 0 || writes_handle || (blockIdx.x < G_items && static_cast<int>(blockIdx.x) < items);
}

}  // namespace
}  // namespace llep::kernels::cuda
