// The combine send phase: the rows of each (local expert, home rank) block back to their tokens' ranks (CombineSend),
// and the expert-side combine's send, one reduced row per (token, rank) (CombineSendReduced,
// kernels/EXPERT_SIDE_COMBINE.md).
// Part of the kernels' device code (ll_run_phases.cuh includes the parts into each translation unit that compiles
// kernels, kernels/cuda/ll_kernels*.cu; each part reopens the same private namespace): split by phase so a reader can
// hold each part.
#pragma once

#include "kernels/cuda/ll_call_gate.cuh"
#include "kernels/cuda/ll_routing.cuh"

namespace llep::kernels::cuda {
namespace {

/// The expert-side combine's send (a dispatch that carried combine_weights; kernels/EXPERT_SIDE_COMBINE.md). Per
/// message that dispatch received (ExpertPlanArea, found by the handle's plan key), the message's rows are reduced in
/// its header's order with fp32 fma, rounded once to bf16 and stored at the token's position of the home rank's receive
/// area: one row per (token, rank) instead of one per (token, expert). Work items are (message, chunk group): 2^lg
/// groups of a message's 256-channel chunks, as many as keep one item per warp, so that at small T a message's chunks
/// spread over CTAs as in the receive; one group when the buffer has proxy peers (the message's warp then pushes its
/// staged row's write itself). The signal's value is the number of messages; the publisher waits for one completion
/// add per item.
__device__ __forceinline__ void CombineSendReduced(const CombineParams& p, CallGate& gate, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, H = L.shape.hidden, T = L.shape.max_tokens_per_rank;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  const ExpertPlanArea xp{R, T};
  int* msgs = reinterpret_cast<int*>(smem);  // [R] messages received from each home rank
  Trace(c, LlOp::kCombine, kTraceSendStart);
  uint8_t* const lane_peer = LanePeer(c);
  // The dispatch's slot: the header that names the handle's key; of two (a captured dispatch replayed into both
  // halves), the later call's.
  const int slot = KeptPlanSlot(Ld16(c.expert_plans + ExpertPlanArea::header(0)),
                                Ld16(c.expert_plans + ExpertPlanArea::header(1)), p.plan_key, p.num_tokens, p.num_topk);
  for (int d = tid; d < R; d += kThreads) {  // both slots' counts, loaded with the headers: one round trip
    const int a = reinterpret_cast<const int*>(c.expert_plans + xp.counts(0))[d];
    const int b = reinterpret_cast<const int*>(c.expert_plans + xp.counts(1))[d];
    msgs[d] = slot == 0 ? a : slot == 1 ? b : 0;
  }
  __syncthreads();
  const auto count = [&](int d) { return msgs[d]; };
  const MessageScan scan = ScanMessages(count, R);
  const int total = scan.total;
  const int chunks = (H + 255) / 256;
  const int lg = !HasProxy(c) ? SplitLog2(total, G * kWarps, 0, FloorLog2(static_cast<uint32_t>(chunks))) : 0;
  // An item's message: its home rank d, token t, selections n, and lane i's row and weight of selection i. The warp's
  // first item is loaded before the gate opens (the plan is an earlier launch's; nothing is written before the gate).
  struct Item {
    int d, t, n, row;
    float w;
  };
  const auto load = [&](int item) {
    const MessageRef ref = LocateMessage(count, R, item >> lg, scan);
    const uint8_t* const e = c.expert_plans + xp.entry(slot, ref.src, ref.j);
    const int2 meta = *reinterpret_cast<const int2*>(e);  // {token on d, selections}
    Item it{ref.src, meta.x, min(meta.y, kK), 0, 0.0f};
    if (lane < kK) {
      it.row = reinterpret_cast<const int*>(e + 16)[lane];
      it.w = reinterpret_cast<const float*>(e + 16 + 4 * kK)[lane];
    }
    return it;
  };
  const int first = warp * G + blockIdx.x;
  Item cur = first < (total << lg) ? load(first) : Item{0, 0, 0, 0, 0.0f};
  Trace(c, LlOp::kCombine, kTracePlanned);
  const uint32_t seq = gate.Open();
  if (seq == 0) return;
  const int half = protocol::HalfOfSeq(seq);
  // Gone (a later dispatch into the half replaced it): nothing is sent, every home rank gets a zero count and finds
  // its own mismatch; this rank says why.
  if (slot < 0 && blockIdx.x == 0 && tid == 0) {
    RecordError(c, protocol::kDeviceCombineMismatch, LlOp::kCombine, c.rank, seq, protocol::kCombinePlanGone);
  }
  // The rows to reduce: x [E_loc * R*T rows of H], or with zero_copy the staged rows (c_send of kZeroCopyHalf); an
  // entry's row is local expert * R*T + row either way.
  const uint8_t* const rows_base =
      p.zero_copy ? c.local + L.CombineSendOffset(kZeroCopyHalf, 0, 0) : reinterpret_cast<const uint8_t*>(p.x);
  const int64_t row_stride = p.zero_copy ? L.combine_stride : int64_t{2} * H;
  for (int item = first; item < (total << lg); item += G * kWarps) {
    if (item != first) cur = load(item);
    const int g = item & ((1 << lg) - 1), d = cur.d, t = cur.t, n = cur.n, row_l = cur.row;
    const float w_l = cur.w;
    uint8_t* const peer = PeerBase(c, lane_peer, d);
    const bool via_proxy = HasProxy(c) && peer == nullptr;
    uint8_t* const dst =
        !via_proxy ? peer + L.CombineRecvOffset(half, c.rank, t) : c.proxy_region + L.CombinePartOffset(half, d, t);
    for (int q = (g * chunks) >> lg; q < (((g + 1) * chunks) >> lg); ++q) {
      const int c0 = q * 256 + lane * 8;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int i0 = 0; i0 < n; i0 += 8) {  // eight rows' loads in flight, then their sums in order
        // A row not loaded is not summed either (the same test), so it needs no zero: written as `v[i] = test ?
        // Ld16(..) : zero`, ptxas loaded every row into one scratch register and copied it out, so each load waited
        // for the one before (kernels/SMALL_T_CODE.md rule 13): the send 1.3-1.7x as long (RESULTS session 62).
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = gpu::WarpShfl(row_l, (i0 + i) & 31);
          if (i0 + i < n && c0 < H) v[i] = Ld16(rows_base + int64_t{r} * row_stride + int64_t{c0} * 2);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float w = gpu::WarpShfl(w_l, (i0 + i) & 31);
          if (i0 + i < n && c0 < H) AccumulateBf16x8(v[i], w, acc);
        }
      }
      if (c0 < H) St16(dst + int64_t{c0} * 2, PackBf16x8(acc));
    }
    gpu::WarpSync();
    if (lane == 0) {
      FenceBeforeCount(via_proxy);
      if (via_proxy) {
        PushCmd(c, d,
                protocol::MakeWriteCmd(LlOp::kCombine, half, d, L.CombinePartOffset(half, d, t),
                                       L.CombineRecvOffset(half, c.rank, t), protocol::CombineRowBytes(H)),
                LlOp::kCombine, seq);
      }
      AddDone(c, LlOp::kCombine, half, d);
    }
  }
  __syncthreads();
  Trace(c, LlOp::kCombine, kTraceCounterDone);
  for (int d = FirstPublishedDst(G); tid == 0 && d < R; d += G) {
    const auto n = static_cast<uint32_t>(msgs[d]);
    PublishWhenDone(c, LlOp::kCombine, half, d, n, seq, n << lg, false);
  }
}

/// The per-(token, expert) combine's send. The block plan (from the handle's layout_range) is made while the call state
/// is read; the gate opens before the first row is copied.
__device__ __forceinline__ void CombineSendPerExpert(const CombineParams& p, CallGate& gate, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = static_cast<int>(L.local_experts.divisor), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows(), row_bytes = protocol::CombineRowBytes(H);
  uint32_t seq = kSeqPending;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  // Shared, indexed by block b = d * E_loc + le (destination-major: the home rank's receive area holds its blocks in
  // local-expert order): count and begin (row in the expert's packed block) from layout_range[le][d]; pos, the counts
  // scanned, which places each row at its destination and also numbers the rows the warps copy.
  int* warp_sums = reinterpret_cast<int*>(smem);
  int* cnt = warp_sums + kWarps;
  int* beg = cnt + E;
  int* pos = beg + E;
  Trace(c, LlOp::kCombine, kTraceSendStart);
  uint8_t* const lane_peer = LanePeer(c);

  // The block plan, while the gate thread reads the call state: thread t loads block t's range (t + kThreads, ...
  // beyond 512 blocks) and scans its count in registers, a warp scan and one barrier per kThreads blocks. It was the
  // gate's critical path: a CTA-wide scan of the counts in shared memory (five barriers and a runtime division) ended
  // the plan 0.8 us after the call state was read (recv_trace, bench/RESULTS.md session 53).
  int pos_total = 0;
#pragma unroll 1
  for (int b0 = 0; b0 < E; b0 += kThreads) {
    const int blk = b0 + tid;
    int n = 0;
    if (blk < E) {
      const int d = L.local_experts.Div(blk), le = blk - d * E_loc;
      const int q = le * R + d;  // layout_range is [E_loc][R]
      const int64_t v = p.layout_range[q];
      const int64_t count = protocol::LayoutRangeCount(v), b = protocol::LayoutRangeBegin(v);
      const bool ok = count <= T && b >= 0 && b + count <= rows;
      if (!ok) RecordError(c, protocol::kDeviceBadLayoutRange, LlOp::kCombine, d, seq, q);
      n = ok ? static_cast<int>(count) : 0;
      cnt[blk] = n;
      beg[blk] = ok ? static_cast<int>(b) : 0;
    }
    const int incl = WarpInclusiveScan(n);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int before = pos_total;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int sum = warp_sums[w];
      before += w < warp ? sum : 0;
      pos_total += sum;
    }
    if (blk < E) pos[blk] = before + incl - n;
    if (b0 + kThreads < E) __syncthreads();  // warp_sums is written again
  }
  Trace(c, LlOp::kCombine, kTracePlanned);
  if ((seq = gate.Open()) == 0) return;  // its barrier publishes cnt, beg and pos
  const int half = protocol::HalfOfSeq(seq);
  // Rows to destination d (its blocks are contiguous in pos order); rows_to: -1 where they are more than the home
  // rank's receive area holds, and none is sent (the publisher records why).
  const auto rows_for = [&](int d) { return (d + 1 < R ? pos[(d + 1) * E_loc] : pos_total) - pos[d * E_loc]; };
  const auto rows_to = [&](int d) {
    const int n = rows_for(d);
    return n <= L.combine_rows_per_src ? n : -1;
  };

  // Row m in pos order: its block, destination, local expert, index in the block and source bytes. One definition for
  // both loops below; inlined, their machine code is that of the two written out (scripts/cuda_sass_diff.sh).
  struct Row {
    int blk, d, le, i;
    int64_t src_row;
    const uint8_t* src;
  };
  const auto row_at = [&](int m) {
    Row r;
    r.blk = FindBlock(pos, E, m);
    r.d = L.local_experts.Div(r.blk);
    r.le = r.blk - r.d * E_loc;
    r.i = m - pos[r.blk];
    r.src_row = beg[r.blk] + r.i;
    r.src = !p.zero_copy ? reinterpret_cast<const uint8_t*>(p.x + (int64_t{r.le} * rows + r.src_row) * H)
                         : c.local + L.CombineSendOffset(kZeroCopyHalf, r.le, r.src_row);
    return r;
  };
  // Few rows (T=1 at decode: pos_total * kRowPieces <= G) on an NVLink-only buffer: each row is copied in kRowPieces
  // pieces of whole 512-byte words by as many CTAs, one pass each, instead of two dependent passes of one warp; a
  // piece counts one completion. Its own loop, before the row loop (which then runs no row), so the row loop's code
  // stays as it was: the pieces folded into that loop made every T slower, unsplit T=256 too
  // (bench/experiments/combine-send-row-pieces.patch). Like this, at T=1 on 4 x H200: combine kernel 11.6 -> 11.1 us,
  // hook combine send 7.2 -> 6.8 (0.98x DeepEP's), other T level (bench/RESULTS.md session 43).
  const bool pieces = !HasProxy(c) && pos_total * kRowPieces <= G;
  if (pieces) {
    const int64_t piece = protocol::AlignUp((row_bytes + kRowPieces - 1) / kRowPieces, 512);
    for (int q = warp * G + blockIdx.x; q < pos_total * kRowPieces; q += G * kWarps) {
      const auto [blk, d, le, i, src_row, src] = row_at(q / kRowPieces);
      uint8_t* const dst = PeerBase(c, lane_peer, d) + L.CombineRecvOffset(half, c.rank, pos[blk] - pos[blk - le] + i);
      const bool sent = rows_to(d) >= 0;
      const int64_t first = (q % kRowPieces) * piece, end = sent ? min(row_bytes, first + piece) : 0;
      for (int64_t base = first; base < end; base += kCopyPassBytes) {
        const int pass = static_cast<int>(min(end - base, kCopyPassBytes));
        uint4 v[kCopyRegs];
        LoadCopyPass(src + base, pass, v);
        StoreCopyPass(dst + base, pass, v);
      }
      gpu::WarpSync();
      if (lane == 0 && sent) {
        FenceBeforeCount(false);
        AddDone(c, LlOp::kCombine, half, d);
      }
    }
  }
  // Rows numbered in pos order (one scan before the gate, not a second one of the rows that are sent); the rows of
  // a destination whose total is refused (rows_to) are skipped (its signal says 0 rows, so none is counted). The skip
  // is a zero byte count, not a branch around the body: a `continue` here made ptxas spill.
  for (int m = warp * G + blockIdx.x; m < (pieces ? 0 : pos_total); m += G * kWarps) {
    const auto [blk, d, le, i, src_row, src] = row_at(m);
    const int64_t recv_off = L.CombineRecvOffset(half, c.rank, pos[blk] - pos[blk - le] + i);
    uint8_t* const peer = PeerBase(c, lane_peer, d);
    const bool via_proxy = HasProxy(c) && peer == nullptr;
    // A proxy peer's row is staged in c_send of this half (a zero-copy row is in kZeroCopyHalf of the GPU region).
    uint8_t* dst = !via_proxy ? peer + recv_off : c.proxy_region + L.CombineSendOffset(half, le, src_row);
    const int64_t bytes = rows_to(d) < 0 ? 0 : row_bytes;  // a refused destination: nothing sent, nothing counted
    for (int64_t base = 0; base < bytes; base += kCopyPassBytes) {
      const int pass = static_cast<int>(min(bytes - base, kCopyPassBytes));
      uint4 v[kCopyRegs];
      LoadCopyPass(src + base, pass, v);
      StoreCopyPass(dst + base, pass, v);
    }
    gpu::WarpSync();
    if (lane == 0 && bytes != 0) {
      FenceBeforeCount(via_proxy);
      if (via_proxy) {
        // One write per (local expert, destination) block, not per row: the block is contiguous in the staging and
        // at the destination (row stride on both sides), and messages, not bytes, bound proxy transports (per-row
        // writes measured in bench/RESULTS.md). The warp that stages the block's last row sends it; the acquire
        // of its count makes the other warps' fenced rows part of what its command releases.
        uint64_t* staged = c.proxy_blocks + int64_t{half} * E + blk;
        const uint64_t before = gpu::FetchAddAcqRelGpu(staged);
        if (before + 1 == static_cast<uint64_t>(cnt[blk])) {
          *staged = 0;  // the next combine on this half is a later launch (stream order)
          PushCmd(c, d,
                  protocol::MakeWriteCmd(LlOp::kCombine, half, d, L.CombineSendOffset(half, le, beg[blk]),
                                         recv_off - int64_t{i} * L.combine_stride,
                                         int64_t{cnt[blk] - 1} * L.combine_stride + row_bytes),
                  LlOp::kCombine, seq);
        }
      }
      AddDone(c, LlOp::kCombine, half, d);
    }
  }
  __syncthreads();
  Trace(c, LlOp::kCombine, kTraceCounterDone);
  // CTA G-2-d publishes rank d's signal (FirstPublishedDst): in a send+receive launch the CTAs that hold this rank's
  // tokens in the receive phase are other CTAs (just below the publishers where the grid has room,
  // CombineRecvSplit::AfterSend, else from CTA 0), so with T < G they go on to plan their tokens instead of polling
  // the counter first.
  for (int d = FirstPublishedDst(G); tid == 0 && d < R; d += G) {
    const int rows_d = rows_to(d);
    if (rows_d < 0) RecordError(c, protocol::kDeviceBadLayoutRange, LlOp::kCombine, d, seq, rows_for(d));
    const auto n = static_cast<uint32_t>(max(rows_d, 0));
    PublishWhenDone(c, LlOp::kCombine, half, d, n, seq, pieces ? n * kRowPieces : n, false);
  }
}

/// The combine's send phase as compiled into a kernel: kExpertSide for the expert-side combine (the dispatch carried
/// combine_weights), whose kernels are compiled apart (kernels/cuda/ll_kernels_expert_side.cu), so neither combine's
/// launch carries the other's code in line (kernels/SMALL_T_CODE.md).
template <bool kExpertSide>
__device__ __forceinline__ void CombineSend(const CombineParams& p, CallGate& gate, uint8_t* smem) {
  if constexpr (kExpertSide) {
    CombineSendReduced(p, gate, smem);
  } else {
    CombineSendPerExpert(p, gate, smem);
  }
}

}  // namespace
}  // namespace llep::kernels::cuda
