// The combine receive phase: the deterministic fp32 top-k reduction of the returned rows (CombineRecv), or of the
// expert ranks' reduced rows for an expert-side combine (kernels/EXPERT_SIDE_COMBINE.md).
// Part of the kernels' device code (ll_run_phases.cuh includes the parts into each translation unit that compiles
// kernels, kernels/cuda/ll_kernels*.cu; each part reopens the same private namespace): split by phase so a reader can
// hold each part.
#pragma once

#include "kernels/cuda/ll_call_gate.cuh"
#include "kernels/cuda/ll_routing.cuh"

namespace llep::kernels::cuda {
namespace {

/// The combine receive's thread that reads the carried plans' headers (it waits for them): warp 14, which holds a
/// token of the first round only from T = 15 * G on; never the gate thread (warp 15), which reads the call state.
constexpr int kCarriedHeaderThread = kThreads - 64;

/// Offset of the combine receive's token plans in its shared memory (after failed[4], got[R], routed[R], the carried
/// route prefixes [2][E]).
__host__ __device__ int64_t CombineRecvPlansOffset(const protocol::LlShape& s) {
  return protocol::AlignUp(int64_t{4} * (4 + 2 * int64_t{s.num_ranks} + 2 * int64_t{s.num_experts}), 16);
}

struct CombineRecvPlan {
  const uint8_t* row[kK];  ///< the returned row (local region, or proxy_region for a proxy source), null = skipped
  float weight[kK];
};

/// acc[i] += weight[k] * row_k[c0 + i] over the token's slots in top-k order (fp32 fma, skipped slots add
/// nothing, as the CPU backend): eight slots at a time, their rows' loads issued together, then the sums in order, so
/// a top-k above 8 (up to kMaxTopK) runs the same code twice (one more round trip) instead of an inline 16-slot copy
/// that every top-8 receive jumped over (kernels/SMALL_T_CODE.md). The order of the sums is the same either way.
__device__ __forceinline__ void ReduceChunk(const CombineRecvPlan& rp, int K, int c0, float (&acc)[8]) {
  static_assert(kK <= 16, "at most two passes of 8 slots");
#pragma unroll 1
  for (int k0 = 0; k0 < K; k0 += 8) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint8_t* row = k0 + k < K ? rp.row[k0 + k] : nullptr;
      v[k] = row != nullptr ? Ld16(row + int64_t{c0} * 2) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (k0 + k >= K || rp.row[k0 + k] == nullptr) continue;
      AccumulateBf16x8(v[k], rp.weight[k0 + k], acc);
    }
  }
}

/// The combine receive's plan of one round (tokens first_t + w * stride, w < n), part 1 (a CTA-wide call, then a
/// barrier): out[w].id[k] is slot k's validated expert (-1 = none), and the round's route keys and zeroed row counters
/// go to sc for CountCombineRows. v: the lane's topk value (loaded by the caller, -1 outside the round's slots).
/// Returns the lane's id (warp w < n, lane k < K; -1 elsewhere).
__device__ __forceinline__ int PlanCombineIds(const LlDeviceContext& c, int64_t v, int n, int K, uint32_t seq,
                                              PlanScratch* sc, TokenPlan* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (warp >= n) return -1;
  const int id = WarpTokenExpertOf(c, v, LlOp::kCombine, seq);
  if (lane < kK) {
    sc->key[warp][lane] = RouteKey(id, c.layout.shape.num_experts, c.layout.local_experts);
    sc->row[warp][lane] = 0;
    out[warp].id[lane] = id;
  }
  return id;
}

/// Part 2, when the dispatch's plan is not at hand (CarriedPlanArea): out[w].row[k] is the row's position in the area
/// its expert rank d returns rows into, i.e. how many selections of this rank's tokens routed to d come before it in
/// the order d returns them: local expert by local expert, tokens in order within one (CombineSend's blocks, the
/// dispatch's packed layout). PlanRound's method over all T tokens instead of the earlier ones: every thread takes a
/// token t' (its keys, a repeated id dropped as the validation rule does) and counts its selections on the slot's
/// rank with a lower local expert, or the same one when t' is earlier; the counts meet through warp reductions and
/// shared atomics. (This replaced a per-expert histogram over E and its scan: 2.9 us of a 12 us receive at T=1,
/// bench/RESULTS.md.)
template <int kMaxK>
__device__ void CountCombineRows(const LlDeviceContext& c, const int64_t* topk, int num_tokens, int first_t, int stride,
                                 int n, int K, PlanScratch* sc, TokenPlan* out) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int E = c.layout.shape.num_experts;
  for (int base = 0; base < num_tokens; base += kThreads) {
    if (base + warp * 32 >= num_tokens) break;  // warp-uniform; later bases are further out
    const int tp = base + tid;
    uint32_t q[kMaxK];
    LoadRouteKeys(topk, tp, num_tokens, K, E, c.layout.local_experts, q);
    // Counted per selection, not "any slot": a repeated id is dropped, as the validation rule does.
#pragma unroll
    for (int j = 1; j < kMaxK; ++j) {
      bool repeated = false;
#pragma unroll
      for (int i = 0; i < j; ++i) repeated |= q[i] == q[j];
      if (repeated) q[j] = kNoKey;
    }
    for (int w = 0; w < n; ++w) {
      const uint32_t tie = tp < first_t + w * stride ? 1u : 0u;  // an earlier token's equal key counts too
      // Not unrolled: a receive runs this once per launch, and its cost at small T was instruction fetch (recv_trace:
      // 6 us in the one CTA that plans a token, unrolled over the slots).
#pragma unroll 1
      for (int k = 0; k < K; ++k) {
        const uint32_t key = sc->key[w][k];
        if (key == kNoKey) continue;  // uniform over the CTA
        // Keys on the slot's rank below it (plus an equal one from an earlier token) are those in [lo, key + tie):
        // one unsigned compare per slot, no branches (the short-circuit form compiled to a branch per slot, and with
        // every warp running it this loop took 4.2 us of the receive at every T: recv_trace). kNoKey is above every
        // key's range, so it never counts.
        const uint32_t lo = key & 0xFFFF0000u, span = key - lo + tie;
        int before = 0;
#pragma unroll
        for (int j = 0; j < kMaxK; ++j) before += q[j] - lo < span ? 1 : 0;
        const int r = gpu::WarpSum(before);
        if (lane == 0 && r != 0) atomicAdd(&sc->row[w][k], r);
      }
    }
  }
  __syncthreads();
  if (warp < n && lane < kK) out[warp].row[lane] = sc->row[warp][lane];
}

/// Rows this rank routed to each rank (validated ids), into routed[R] (zeroed by the caller, then a barrier); for an
/// expert-side combine (kExpertSide), tokens with a selection on each rank (one partial row each): a slot counts
/// unless an earlier slot of the token selected an expert on the same rank. An earlier pass's slot is re-read from
/// the row (cached): any value in [0, E) there names its rank, kept or dropped as a repeat of a kept one.
template <bool kExpertSide>
__device__ void CountRoutedRows(const CombineParams& p, uint32_t seq, int* routed) {
  const LlDeviceContext& c = p.ctx;
  const protocol::FastDivisor& e_loc = c.layout.local_experts;
  const int E = c.layout.shape.num_experts, K = p.num_topk;
  for (int t = threadIdx.x; t < p.num_tokens; t += kThreads) {
    ForTokenIdsByEight(c, p.topk_idx, t, K, LlOp::kCombine, seq, [&](const int(&ids)[8], int k0) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (ids[k] < 0) continue;
        const int d = e_loc.Div(ids[k]);
        bool again = false;  // an earlier slot on the same rank (expert-side: one row per rank)
        if constexpr (kExpertSide) {
#pragma unroll
          for (int j = 0; j < k; ++j) again |= ids[j] >= 0 && e_loc.Div(ids[j]) == d;
          const int64_t* r = p.topk_idx + static_cast<int64_t>(t) * K;
#pragma unroll 1
          for (int j = 0; j < k0; ++j) again |= r[j] >= 0 && r[j] < E && e_loc.Div(static_cast<int>(r[j])) == d;
        }
        if (!again) atomicAdd(&routed[d], 1);
      }
    });
  }
}

/// An expert-side combine's plan of token t (one warp; the round's ids validated in plan.id): the partial rows of the
/// distinct ranks of t's selections in ascending rank order, weight 1 (the experts' ranks applied the weights), then
/// null slots; a masked rank's row is dropped (null), as its top-k terms are otherwise.
__device__ __forceinline__ void PlanReducedRows(const LlDeviceContext& c, const TokenPlan& plan, int K, int t, int half,
                                                const int* got, CombineRecvPlan& rp) {
  const int lane = threadIdx.x % 32;
  const int g = lane < K ? plan.id[lane] : -1;
  const int dk = g >= 0 ? c.layout.local_experts.Div(g) : -1;
  // Every lane takes part in every shuffle (a shuffle inside a short-circuit hung the warp: session 29).
  bool first = dk >= 0;  // the lowest slot of its rank
  for (int j = 0; j < K; ++j) {
    const int dj = gpu::WarpShfl(dk, j);
    first &= !(j < lane && dj == dk);
  }
  int pos = 0;  // distinct ranks below dk
  for (int j = 0; j < K; ++j) {
    const int dj = gpu::WarpShfl(dk, j), fj = gpu::WarpShfl(first ? 1 : 0, j);
    pos += fj != 0 && dj < dk ? 1 : 0;
  }
  const int distinct = __popc(gpu::WarpBallot(first));
  if (first) {
    rp.row[pos] = got[dk] < 0 ? nullptr : SrcBase(c, dk) + c.layout.CombineRecvOffset(half, dk, t);
    rp.weight[pos] = 1.0f;
  }
  if (lane >= distinct && lane < K) rp.row[lane] = nullptr;
}

/// Plans its tokens and loads their weights while the call state is read, opens the gate, waits for the expert ranks'
/// signals, then reduces. A token's row positions come from its dispatch's plan (CarriedPlanArea: one round of loads
/// with the token's ids) or, when that is not at hand, are counted over all tokens (CountCombineRows). The last CTA
/// (tokenless at small T, so off the critical path) also counts the rows routed to each rank and checks that every
/// expert rank returned exactly those; every CTA checks that the rows it reads exist.
/// Returns whether this CTA stamps the receive's end (metrics): every CTA (see the end). kExpertSide: the expert-side
/// combine's compilation (CombineSend).
/// kAfterSend: the receive phase of a launch with a send phase (ll_kernels.cu, ll_kernels_expert_side.cu); false in
/// the receive-only compilations, whose code it leaves as it was.
template <bool kExpertSide, bool kAfterSend>
__device__ __forceinline__ bool CombineRecv(const CombineParams& p, CallGate& gate, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, H = L.shape.hidden, E = L.shape.num_experts;
  const int K = p.num_topk;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  const bool checks_counts = blockIdx.x == G - 1;
  // Shared: failed, the carried plan's half (-1: none), got[R] (rows each source announced), routed[R] (the checking
  // CTA), the carried route prefixes [2][E], token plans, row plans.
  int* failed = reinterpret_cast<int*>(smem);
  int* carried_half = failed + 1;
  int* got = failed + 4;
  int* routed = got + R;
  int* prefix = routed + R;
  auto* plans = reinterpret_cast<TokenPlan*>(smem + CombineRecvPlansOffset(L.shape));
  auto* rplans = reinterpret_cast<CombineRecvPlan*>(plans + kWarps);
  auto* scratch = reinterpret_cast<PlanScratch*>(rplans + kWarps);

  Trace(c, LlOp::kCombine, kTraceRecvStart);
  uint32_t seq = gate.error_seq();
  // failed[2]: an expert-side combine's own check failed (1: weights differ, 2: the dispatch's plan is gone).
  constexpr bool reduced = kExpertSide;  // the kernel's compilation (CombineSend)
  if (tid == 0) failed[0] = failed[2] = 0;
  // The dispatch's plans of both halves (CarriedPlanArea): the route prefixes and the headers load here, each round's
  // entries with its ids, all in one round trip; the headers by one thread of a warp that holds no token below
  // T = 15 * G (it waits for them). A header names the handle's dispatch by its plan key; of two (a captured dispatch
  // replayed into both halves), the later call's.
  const CarriedPlanArea area = CarriedArea(c);
  const int* carried_prefix = reinterpret_cast<const int*>(c.carried + area.prefix(0));  // [2][E]
  // The prefixes (2E words, one per thread at E = 256) are loaded by every warp but the gate's, whose gate thread is
  // reading the call state (CallGate): there the warp's load was issued after that read (SASS of 363c464), and the
  // plan's first barrier waits for it. The gate warp's words go to the first warps as a second load. Measured: hook
  // combine receive 6.5-6.8 -> 5.8-6.0 us at T=1 (bench/RESULTS.md session 46; the trace did not show the mechanism).
  // The fused kernel runs this too: choosing by gate.is_open() made it spill.
  constexpr int kPrefixThreads = kGateThread;
  const int first_prefix = tid < kPrefixThreads && tid < 2 * E ? carried_prefix[tid] : 0;
  const int second_prefix =
      tid < kPrefixThreads && kPrefixThreads + tid < 2 * E ? carried_prefix[kPrefixThreads + tid] : 0;
  if (tid == kCarriedHeaderThread) {
    *carried_half = KeptPlanSlot(Ld16(c.carried + CarriedPlanArea::header(0)),
                                 Ld16(c.carried + CarriedPlanArea::header(1)), p.plan_key, p.num_tokens, K);
  }
  const bool peeked = !gate.is_open() && PeekSignals(c, LlOp::kCombine);
  for (int d = tid; checks_counts && d < R; d += kThreads) routed[d] = 0;  // counted after the first round's plan
  // Tokens b, b + G_tok, ... of CTA b's token slot b % G_tok; its segment b / G_tok reduces that share of each token's
  // 256-channel chunks. One segment (every chunk) unless there are fewer tokens than CTAs: then a token's chunks are
  // split over up to `segs` CTAs, each planning the token itself (in parallel), so that no warp reduces more than one
  // chunk — at T=1 one CTA's 16 warps took two dependent rounds of row loads for the 28 chunks of H=7168. Measured
  // (bench/RESULTS.md session 17): receive launch -7 to -10 % at T <= 32 but +4 to +9 % at T >= 128, where nothing
  // is split (not this arithmetic; cause not found); session 18's branch-free plan took 10-24 % off every T. The split
  // comes from the host (CombineRecvSplit): multiplications here, no integer divisions.
  const int G_tok = static_cast<int>(p.split.token_ctas.divisor);
  // After a send phase the CTAs take the tokens in another order (CombineRecvSplit::AfterSend).
  const int b = static_cast<int>(blockIdx.x);
  const CombineRecvSplit::Cta cta =
      p.split.ForCta(kAfterSend ? p.split.AfterSend(b, R, p.num_tokens, p.num_topk) : b, p.num_tokens);
  const int slot = cta.slot, ch_lo = cta.ch_lo, seg_chunks = cta.ch_count, my_tokens = cta.num_tokens;
  for (int round = 0; round < my_tokens || round == 0; round += kWarps) {
    const int n = max(0, min(kWarps, my_tokens - round));
    const bool mine = warp < n && lane < K;  // the lane holds slot `lane` of the round's token `warp`
    const int64_t t_slot = int64_t{slot + (round + warp) * G_tok} * K + lane;
    // The weights, the carried entries of both halves and the ids load together: one round trip, not three (the CTAs
    // that plan a token spent ~3 us on each dependent load at T=1: recv_trace).
    const float weight = mine ? p.topk_weights[t_slot] : 0.0f;
    int row0 = 0, row1 = 0;
    uint32_t kept0 = 0, kept1 = 0;  // expert-side: the combine_weights the dispatch carried, to check weight against
    if (mine) {
      row0 = reinterpret_cast<const int*>(c.carried + area.entries(0))[t_slot];
      row1 = reinterpret_cast<const int*>(c.carried + area.entries(1))[t_slot];
      if (reduced) {
        kept0 = reinterpret_cast<const uint32_t*>(c.carried + area.weights(0))[t_slot];
        kept1 = reinterpret_cast<const uint32_t*>(c.carried + area.weights(1))[t_slot];
      }
    }
    const int64_t v = mine ? p.topk_idx[t_slot] : -1;
    const int id = PlanCombineIds(c, v, n, K, seq, scratch, plans);
    if (round == 0) {
      if (tid < kPrefixThreads) {
        if (tid < 2 * E) prefix[tid] = first_prefix;
        if (kPrefixThreads + tid < 2 * E) prefix[kPrefixThreads + tid] = second_prefix;
        for (int i = tid + 2 * kPrefixThreads; i < 2 * E; i += kPrefixThreads) prefix[i] = carried_prefix[i];
      }
    }
    __syncthreads();
    // Positions from the dispatch's plan when a header names this handle's key and shape (its rows are where that
    // dispatch put them); counted from this topk_idx otherwise.
    const int h = *carried_half;
    const bool count = h < 0 && !reduced;
    if (!count && !reduced && mine && id >= 0) plans[warp].row[lane] = prefix[h * E + id] + (h == 0 ? row0 : row1);
    // Expert-side: the experts' ranks reduced with the weights the dispatch carried; the combine must pass the same
    // (bit for bit, every slot: as the CPU backend), and the plan must still be the handle's dispatch's.
    if (reduced && mine && (h < 0 || __float_as_uint(weight) != (h == 0 ? kept0 : kept1))) {
      failed[2] = h < 0 ? 2 : 1;
    }
    if (count && n > 0) {
      if (kRouteK == 8 || K <= 8) {  // kRouteK: this compilation plans for a top-k of at most 8 (ll_routing.cuh)
        CountCombineRows<8>(c, p.topk_idx, p.num_tokens, slot + round * G_tok, G_tok, n, K, scratch, plans);
      } else {
        CountCombineRows<kK>(c, p.topk_idx, p.num_tokens, slot + round * G_tok, G_tok, n, K, scratch, plans);
      }
    }
    if (mine) rplans[warp].weight[lane] = weight;
    __syncthreads();
    if (round == 0) {
      // The checking CTA counts the rows routed to each rank from this call's topk_idx (not from a kept plan: a
      // topk_idx that is not the dispatch's still shows up as a count mismatch). After the plan, so that its loads
      // do not delay the plan's; the barriers before the signals' order the zeroing above and the adds.
      if (checks_counts) CountRoutedRows<kExpertSide>(p, seq, routed);
      Trace(c, LlOp::kCombine, kTraceRecvPlanned);
      if ((seq = gate.Open()) == 0) return false;
      // Each expert rank must return exactly the rows this rank routed to it.
      ReceiveSignals(c, LlOp::kCombine, protocol::HalfOfSeq(seq), seq, L.combine_rows_per_src, p.wait_recv_cost_stats,
                     got, failed, peeked, kAfterSend);
      __syncthreads();
      Trace(c, LlOp::kCombine, kTraceSignals);
      StampWaitEnd(c, seq);
      for (int d = tid; checks_counts && d < R; d += kThreads) {
        if (!*failed && got[d] >= 0 && routed[d] != got[d]) {  // got -1: masked, its rows are dropped
          // The signals arrived and were consumed: the protocol is intact, only this rank's input was wrong.
          RecordError(c, protocol::kDeviceCombineMismatch, LlOp::kCombine, d, seq,
                      (int64_t{got[d]} << 32) | static_cast<uint32_t>(routed[d]));
          *failed = 1;
        }
      }
    }
    if (reduced) {
      if (warp < n) {
        PlanReducedRows(c, plans[warp], K, slot + (round + warp) * G_tok, protocol::HalfOfSeq(seq), got, rplans[warp]);
      }
    } else if (warp < n && lane < K) {
      const int g = plans[warp].id[lane];
      const uint8_t* row = nullptr;
      if (g >= 0) {
        const int d = L.local_experts.Div(g), pos = plans[warp].row[lane];
        if (got[d] < 0) {
          // A masked expert rank (rank masking): its top-k term is dropped from the sum, as DeepEP's shrink mode does.
        } else if (pos < got[d]) {
          row = SrcBase(c, d) + L.CombineRecvOffset(protocol::HalfOfSeq(seq), d, pos);
        } else {  // fewer rows came back than this rank routed (the checking CTA records which rank)
          *failed = 1;
        }
      }
      rplans[warp].row[lane] = row;
    }
    __syncthreads();
    if (failed[2] != 0) {  // after the signals: the protocol is intact, only this call's input was wrong
      if (tid == 0) {
        RecordError(c, protocol::kDeviceCombineMismatch, LlOp::kCombine, c.rank, seq,
                    failed[2] == 2 ? protocol::kCombinePlanGone : protocol::kCombineWeightsDiffer);
      }
      return true;
    }
    if (*failed) return true;
    for (int item = warp; item < n * seg_chunks; item += kWarps) {
      const int tw = cta.per_token.Div(item), ch = ch_lo + item - tw * seg_chunks;
      const int c0 = ch * 256 + lane * 8;
      if (c0 >= H) continue;
      const int t = slot + (round + tw) * G_tok;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      ReduceChunk(rplans[tw], K, c0, acc);
      St16(p.out + int64_t{t} * H + c0, PackBf16x8(acc));
    }
    __syncthreads();
  }
  Trace(c, LlOp::kCombine, kTraceRecvEnd);
  // Every CTA: returning whether it reduced a token or checked the counts made the fused combine spill 88 bytes (kept
  // live, recomputed here, or stored in shared memory as the rounds start); in the receive-only compilation alone it
  // left the hook's combine receive level (bench/experiments/combine-recv-stamp-working-ctas.patch, session 48).
  return true;
}

}  // namespace
}  // namespace llep::kernels::cuda
