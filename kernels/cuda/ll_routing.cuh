// Routing of the low-latency kernels: the topk validation rule, the deterministic per-round token plan (rows in
// (expert, source) blocks, message slots per destination), block scans, the combine's bf16 sums, and the FP8 encoder
// the dispatch uses.
// Part of the kernels' device code (included into ll_kernels.cu and ll_kernels_recv.cu through ll_run_phases.cuh, and
// by fp8_encoder_test.cu to test the encoder itself; each part reopens the same private namespace): split by phase so
// a reader can hold each part.
#pragma once

#include "kernels/codec/fp8.h"
#include "kernels/cuda/ll_device_common.cuh"
#include "runtime/protocol/gpu_port.h"

#if defined(LLEP_GPU_CUDA)
#include <cuda_fp8.h>  // the e4m3 conversion instruction (EncodeFp8x16)
#endif

namespace llep::kernels::cuda {
namespace {

// ------------------------------------------------------------------------------------------ routing

// The routing validation rule, applied by every phase so a bad row is treated identically everywhere and the
// buffer stays consistent: a topk id outside [-1, E) and an id an earlier slot of the same token already selected
// become -1 ("no expert") and are recorded. It has two forms over one pair of helpers: the warp form (a lane per
// slot, for the token plan) and the thread form (a thread per token, for the histograms).

/// The largest top-k this compilation's routing code plans for: kK, or 8 where LLEP_LL_TOPK_8 is defined (the
/// NVLink-only compilations, ll_kernels_nvlink.cu, which the launchers pick only for calls with a top-k of at most 8:
/// DeepSeek-V3's and most MoE models' routing). The top-16 planning beside the top-8 one was ~1,000 instructions of
/// the dispatch kernel that a top-8 launch jumps over (kernels/SMALL_T_CODE.md rule 6).
#if defined(LLEP_LL_TOPK_8)
constexpr int kRouteK = 8;
#else
constexpr int kRouteK = kK;
#endif

/// Rule part 1: topk value v as an expert id, -1 (recorded) when outside [-1, E).
__device__ __forceinline__ int InRangeId(const LlDeviceContext& c, int64_t v, LlOp op, uint32_t seq) {
  const bool in_range = v >= -1 && v < c.layout.shape.num_experts;
  if (!in_range) RecordError(c, protocol::kDeviceBadExpertId, op, -1, seq, v);
  return in_range ? static_cast<int>(v) : -1;
}

/// Rule part 2: id, or -1 (recorded) when an earlier slot of the token selected it already (`repeated`).
__device__ __forceinline__ int UnlessRepeated(const LlDeviceContext& c, int id, bool repeated, int64_t v, LlOp op,
                                              uint32_t seq) {
  if (repeated) RecordError(c, protocol::kDeviceBadExpertId, op, -1, seq, v);
  return repeated ? -1 : id;
}

/// Warp form: topk_idx[t][lane] validated, lanes >= K get -1. One coalesced load per token; the repeat check runs
/// on shuffles (trace on H200: the per-slot scalar loads it replaced cost 3.6 us per token plan; a thread-form load
/// of the whole row by every lane, measured on 4xH200, cost 1 us of dispatch send at T=1). One shuffle per possible
/// earlier slot, unrolled over kRouteK - 1: looping over the runtime K made the dispatch send ~0.4 us slower at T=1,
/// and a warp match (__match_any_sync) instead the combine receive ~0.7 us slower at T=128 (2 x H200, session 39).
/// WarpTokenExpertOf takes the lane's topk value loaded already (v, -1 for lanes >= K, which the id >= 0 test skips).
__device__ int WarpTokenExpertOf(const LlDeviceContext& c, int64_t v, LlOp op, uint32_t seq) {
  const int lane = threadIdx.x % 32;
  const int id = InRangeId(c, v, op, seq);
  bool repeated = false;
#pragma unroll
  for (int j = 0; j < kRouteK - 1; ++j) {
    const int other = gpu::WarpShfl(id, j);
    repeated |= j < lane && id >= 0 && other == id;
  }
  return UnlessRepeated(c, id, repeated, v, op, seq);
}
__device__ __forceinline__ int WarpTokenExpert(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op,
                                               uint32_t seq) {
  const int lane = threadIdx.x % 32;
  return WarpTokenExpertOf(c, lane < K ? topk[static_cast<int64_t>(t) * K + lane] : -1, op, seq);
}

/// Thread form: the calling thread takes token t's row and calls f(ids, k0) with its validated ids eight slots at a
/// time: ids is int[8] holding slots [k0, k0 + 8), those at or beyond K -1; one pass for a top-k up to 8, two for up
/// to kMaxTopK. Each pass is one round of independent loads. A slot that repeats one of an earlier pass is found by
/// re-reading that pass's values (the same row, cached), so a top-k above 8 runs the same code again instead of an
/// inline 16-slot copy that every top-8 launch jumps over (kernels/SMALL_T_CODE.md; bench/RESULTS.md session 50: the
/// dispatch send's route counting, 0.3-1.0 us of the hook send). Errors are recorded slot by slot.
template <typename F>
__device__ __forceinline__ void ForTokenIdsByEight(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op,
                                                   uint32_t seq, F&& f) {
  const int64_t* r = topk + static_cast<int64_t>(t) * K;
#pragma unroll 1
  for (int k0 = 0; k0 < K; k0 += 8) {
    int64_t v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = k0 + k < K ? r[k0 + k] : -1;
    bool earlier[8];  // the value is an earlier pass's: that slot kept it, or dropped it as a repeat itself
#pragma unroll
    for (int k = 0; k < 8; ++k) earlier[k] = false;
#pragma unroll 1
    for (int j = 0; j < k0; ++j) {
      const int64_t w = r[j];
#pragma unroll
      for (int k = 0; k < 8; ++k) earlier[k] |= v[k] >= 0 && v[k] == w;
    }
    int valid[8], ids[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      valid[k] = InRangeId(c, v[k], op, seq);
      bool repeated = earlier[k] && valid[k] >= 0;
#pragma unroll
      for (int j = 0; j < k; ++j) repeated |= valid[k] >= 0 && valid[j] == valid[k];
      ids[k] = UnlessRepeated(c, valid[k], repeated, v[k], op, seq);
    }
    f(ids, k0);
  }
}

/// The plan of one token, written by one warp into shared memory.
struct TokenPlan {
  int id[kK];      ///< validated expert id per slot, -1 = skipped
  int row[kK];     ///< row_in_block: earlier tokens that select the same expert
  int slot[kK];    ///< message slot of this token on the slot's destination rank
  int dst[kK];     ///< destination rank of the slot, -1 = skipped
  uint32_t opens;  ///< bit k: slot k is the token's first on its rank, the slot that owns the (token, rank) message
};

// Route keys for PlanRound: rank << 16 | local expert (both fit: a rank and a local expert id are below 65536, and
// E <= 2^20 keeps them from both being 65535), kNoKey for "no expert".
constexpr uint32_t kNoKey = 0xFFFFFFFFu;

__device__ __forceinline__ uint32_t RouteKey(int64_t id, int E, const protocol::FastDivisor& e_loc) {
  if (id < 0 || id >= E) return kNoKey;
  const int g = static_cast<int>(id), d = e_loc.Div(g);
  return static_cast<uint32_t>(d) << 16 | static_cast<uint32_t>(g - d * static_cast<int>(e_loc.divisor));
}

/// Token tp's route keys (kNoKey for slots >= K, for an id outside [0, E) and for tp >= limit): one round of
/// independent loads. The planners' "every thread takes one token" row.
template <int kMaxK>
__device__ __forceinline__ void LoadRouteKeys(const int64_t* topk, int tp, int limit, int K, int E,
                                              const protocol::FastDivisor& e_loc, uint32_t (&q)[kMaxK]) {
  const int64_t* r = topk + static_cast<int64_t>(tp) * K;
  int64_t v[kMaxK];
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) v[j] = (tp < limit && j < K) ? r[j] : -1;
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) q[j] = RouteKey(v[j], E, e_loc);
}

/// PlanRound's shared memory: the keys of the round's tokens and their row / slot counters.
struct PlanScratch {
  uint32_t key[kWarps][kK];
  int row[kWarps][kK];
  int slot[kWarps][kK];
};

/// The plans of one round's tokens (route_plan.h definitions), a CTA-wide call: token w < n of the round is
/// first_t + w * stride, its plan goes to out[w]. Row and slot count the earlier tokens t' < t that select the same
/// expert / send to the same rank. Every lane takes one earlier token (one round of independent loads for up to
/// 512 of them), compares it with planned slots, and the counts meet through warp reductions and shared atomics:
/// the whole CTA works on the plan instead of one warp scanning serially. (H200 trace, T=128, 2 ranks: plan ready at
/// 8.5 us with the serial scan, 6.3 us like this; a fully unrolled scan was far worse, ~30 us, as its straight-line
/// code missed the instruction cache.) only_dst >= 0 leaves open only the token's message to that rank (the dispatch
/// send's split by destination); rows and slots stay those of the whole token.
template <int kMaxK>
__device__ void PlanRound(const LlDeviceContext& c, const int64_t* topk, int first_t, int stride, int n, int K, LlOp op,
                          uint32_t seq, PlanScratch* sc, TokenPlan* out, int only_dst) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int E = c.layout.shape.num_experts;
  const int t_last = first_t + (n - 1) * stride;  // the round's last token: earlier tokens are [0, t_last)
  const auto load_row = [&](int tp, uint32_t(&q)[kMaxK]) {
    LoadRouteKeys(topk, tp, t_last, K, E, c.layout.local_experts, q);
  };
  // The work: (earlier token, planned token, slot) triples. A warp's lanes take a span of 32 earlier tokens; with few
  // spans (small T) the CTA's warps split the (planned token, slot) pairs of a span between copies of it instead of
  // one warp running through all n * kMaxK pairs in turn (2^lg span slots, powers of two: shifts, no division). Trace
  // on 2 x H200: the dispatch send's last plan at T=8 ready at 2.6 us instead of 3.9 (bench/RESULTS.md session 39).
  const int lg = CeilLog2(static_cast<uint32_t>(min((t_last + 31) / 32, kWarps)));
  const int span0 = warp & ((1 << lg) - 1), copy = warp >> lg, copies = kWarps >> lg, pairs = n * kMaxK;
  const bool counts = span0 * 32 < t_last && copy < pairs;  // warp-uniform: this warp has triples
  // The first span's keys are loaded before the planned tokens' own loads, so both are in flight together; only by
  // warps with triples (at T=1 none): the eight key conversions are ~170 instructions on a plan's path (ncu,
  // bench/RESULTS.md session 39).
  uint32_t q[kMaxK];
  if (counts) load_row(span0 * 32 + lane, q);
  if (warp < n) {
    const int id = WarpTokenExpert(c, topk, first_t + warp * stride, K, op, seq);
    if (lane < kK) {
      sc->key[warp][lane] = RouteKey(id, E, c.layout.local_experts);
      sc->row[warp][lane] = 0;
      sc->slot[warp][lane] = 0;
      out[warp].id[lane] = id;
    }
  }
  __syncthreads();
  for (int base = span0 * 32; counts && base < t_last; base += 32 << lg) {
    const int tp = base + lane;
    if (base != span0 * 32) {
      load_row(tp, q);
    }
    // Not unrolled (as CountCombineRows): every CTA runs this once per launch from a cold instruction cache, and
    // unrolled over the slots it was ~2,100 more instructions; the send's median CTA had its plan at 8.0 us of a
    // 14.1 us launch at T=128, 4.9 of 10.3 with the loop (recv_trace, bench/RESULTS.md session 23). A per-expert
    // histogram in shared memory instead of the compares was slower at T=1 and gained less.
#pragma unroll 1
    for (int pair = copy; pair < pairs; pair += copies) {
      const int w = pair / kMaxK, k = pair % kMaxK;
      const uint32_t key = sc->key[w][k];
      // Branch-free compares (as CountCombineRows'): the key's rank holds the keys [lo, lo + span); kNoKey (rank
      // field 0xFFFF, local field 0xFFFF, which no real key of rank 0xFFFF reaches) falls outside. A kNoKey slot
      // counts nothing.
      const uint32_t lo = key & 0xFFFF0000u, span = lo == 0xFFFF0000u ? 0xFFFFu : 0x10000u;
      uint32_t same_expert = 0, same_rank = 0;
#pragma unroll
      for (int j = 0; j < kMaxK; ++j) {
        same_expert |= q[j] == key ? 1u : 0u;
        same_rank |= q[j] - lo < span ? 1u : 0u;
      }
      const uint32_t counted = tp < first_t + w * stride && key != kNoKey ? 1u : 0u;  // an earlier token's
      const int r = gpu::WarpSum(static_cast<int>(counted & same_expert));
      const int s = gpu::WarpSum(static_cast<int>(counted & same_rank));
      if (lane == 0 && r != 0) atomicAdd(&sc->row[w][k], r);
      if (lane == 0 && s != 0) atomicAdd(&sc->slot[w][k], s);
    }
  }
  __syncthreads();
  if (warp < n) {
    const uint32_t key = lane < kK ? sc->key[warp][lane] : kNoKey;
    const int dst = key == kNoKey ? -1 : static_cast<int>(key >> 16);
    const unsigned same_rank = gpu::WarpMatchAny(dst);
    const unsigned opens =
        gpu::WarpBallot(dst >= 0 && __ffs(same_rank) - 1 == lane && (only_dst < 0 || dst == only_dst));
    if (lane < kK) {
      out[warp].row[lane] = sc->row[warp][lane];
      out[warp].slot[lane] = sc->slot[warp][lane];
      out[warp].dst[lane] = dst;
    }
    if (lane == 0) out[warp].opens = opens;
  }
}

/// PlanRound with registers for top-8 when K <= 8, else for kMaxTopK. Every thread of the CTA calls it; the plans
/// are visible to the CTA after the caller's next barrier.
__device__ void PlanRoundAnyK(const LlDeviceContext& c, const int64_t* topk, int first_t, int stride, int n, int K,
                              LlOp op, uint32_t seq, PlanScratch* sc, TokenPlan* out, int only_dst) {
  if (kRouteK == 8 || K <= 8) {  // kRouteK == 8: this compilation has no top-16 plan
    PlanRound<8>(c, topk, first_t, stride, n, K, op, seq, sc, out, only_dst);
  } else {
    PlanRound<kK>(c, topk, first_t, stride, n, K, op, seq, sc, out, only_dst);
  }
}

/// Inclusive prefix sum of v over the warp's lanes (warp-collective).
__device__ __forceinline__ int WarpInclusiveScan(int v) {
  const int lane = threadIdx.x % 32;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = gpu::WarpShflUp(v, o);
    if (lane >= o) v += y;
  }
  return v;
}

/// Last index q in [0, n) with starts[q] <= m (starts non-decreasing, starts[0] == 0): the non-empty block
/// that holds flattened item m.
__device__ __forceinline__ int FindBlock(const int* starts, int n, int m) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= m) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// ------------------------------------------------------------------------------------------ messages

// Messages counted per source and located by index: the dispatch receive's items and the expert-side combine send's.

/// A message's place: its source and its index among that source's messages.
struct MessageRef {
  int src, j;
};

/// The messages per source as a warp sees them (count(src) each, -1 for a masked source: none): lane i holds the
/// inclusive and exclusive prefixes of sources 0..i (i < 32), `first` the messages of sources 0..31, `total` those of
/// all sources. Warp-collective. One scan gives the total and, kept, places every message of the first 32 sources
/// (every NVLink-only buffer of up to 32 ranks) without a scan per item (LocateMessage): a warp sum for the total
/// and a scan per item were two chains of five shuffles and a shared load each on a small-T receive item's path.
/// Sources beyond 32 are summed by a loop that only runs beyond them, not unrolled: unrolled, its code was a 1.6 KiB
/// jump on the receive's path at R <= 32 (ncu source counters, bench/RESULTS.md session 38).
struct MessageScan {
  int incl, excl, first, total;
};
template <typename Count>
__device__ __forceinline__ MessageScan ScanMessages(const Count& count, int R) {
  const int lane = threadIdx.x % 32;
  const int v = lane < R ? max(count(lane), 0) : 0;
  MessageScan sc;
  sc.incl = WarpInclusiveScan(v);
  sc.excl = sc.incl - v;
  sc.first = gpu::WarpShfl(sc.incl, 31);
  sc.total = sc.first;
#pragma unroll 1
  for (int s0 = 32; s0 < R; s0 += 32) sc.total += gpu::WarpSum(s0 + lane < R ? max(count(s0 + lane), 0) : 0);
  return sc;
}

/// Message m (< sc.total) of the messages taken in source order: from the kept scan among the first 32 sources (a
/// ballot and a shuffle), beyond them a warp scan per 32 sources; no CTA-wide scan and its barriers either way.
/// Warp-collective, m warp-uniform.
template <typename Count>
__device__ __forceinline__ MessageRef LocateMessage(const Count& count, int R, int m, const MessageScan& sc) {
  // Sources that end at or before m: a prefix of the lanes, so their count is m's source.
  if (m < sc.first) {
    const int q = __popc(gpu::WarpBallot(sc.incl <= m));
    return MessageRef{q, m - gpu::WarpShfl(sc.excl, q)};
  }
  const int lane = threadIdx.x % 32;
  int carry = sc.first;
  for (int s0 = 32; s0 < R; s0 += 32) {
    const int v = s0 + lane < R ? max(count(s0 + lane), 0) : 0;
    const int incl = WarpInclusiveScan(v);
    const int chunk = gpu::WarpShfl(incl, 31);
    if (m < carry + chunk) {
      const int q = __popc(gpu::WarpBallot(carry + incl <= m));
      return MessageRef{s0 + q, m - carry - gpu::WarpShfl(incl - v, q)};
    }
    carry += chunk;
  }
  return MessageRef{R - 1, 0};  // not reached for m < total
}

// ------------------------------------------------------------------------------------------ carried plans

// The dispatch send keeps its plan of this rank's tokens for the combine receive (ll_kernels.h CarriedPlanArea): plain
// stores to local memory that the combine, a later launch in stream order, reads.

__device__ __forceinline__ CarriedPlanArea CarriedArea(const LlDeviceContext& c) {
  return CarriedPlanArea{c.layout.shape.num_experts, c.layout.shape.max_tokens_per_rank};
}

/// Token t's slot k as the dispatch planned it (one lane per slot): its row in the (expert, source) block, and the
/// slot's combine_weights when the dispatch carries them (null: none).
__device__ __forceinline__ void KeepPlanEntry(const LlDeviceContext& c, int half, int t, int K, int k,
                                              const TokenPlan& pl, const float* weights) {
  const int64_t i = int64_t{t} * K + k;
  reinterpret_cast<int*>(c.carried + CarriedArea(c).entries(half))[i] = pl.row[k];
  if (weights != nullptr) reinterpret_cast<float*>(c.carried + CarriedArea(c).weights(half))[i] = weights[i];
}

/// Destination d's local-expert counts as exclusive prefixes (warp-collective, counts in shared memory).
__device__ __forceinline__ void KeepRoutePrefix(const LlDeviceContext& c, int half, int d, const int* counts,
                                                int E_loc) {
  const int lane = threadIdx.x % 32;
  int* out = reinterpret_cast<int*>(c.carried + CarriedArea(c).prefix(half)) + int64_t{d} * E_loc;
  int carry = 0;
  for (int i0 = 0; i0 < E_loc; i0 += 32) {
    const int v = i0 + lane < E_loc ? counts[i0 + lane] : 0;
    const int incl = WarpInclusiveScan(v);
    if (i0 + lane < E_loc) out[i0 + lane] = carry + incl - v;
    carry += gpu::WarpShfl(incl, 31);
  }
}

/// A kept plan's header (CarriedPlanArea and ExpertPlanArea alike; one thread, at `at`): {key, the dispatch's seq,
/// num_tokens | K << 24}; key 0 names no plan.
__device__ __forceinline__ void StorePlanHeader(uint8_t* at, uint64_t key, uint32_t seq, int num_tokens, int K) {
  *reinterpret_cast<uint4*>(at) = make_uint4(static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), seq,
                                             static_cast<uint32_t>(num_tokens) | static_cast<uint32_t>(K) << 24);
}

/// Which of a kept pair's two slots (headers h0, h1 as StorePlanHeader wrote them) holds the plan of the dispatch with
/// this key and shape: of two (a captured dispatch replayed into both halves), the later call's; -1 when neither (a
/// later dispatch of the half replaced it, or the handle has no key).
__device__ __forceinline__ int KeptPlanSlot(const uint4& h0, const uint4& h1, uint64_t key, int num_tokens, int K) {
  const uint32_t shape = static_cast<uint32_t>(num_tokens) | static_cast<uint32_t>(K) << 24;
  const auto names = [&](const uint4& h) { return key != 0 && protocol::JoinHalves(h.y, h.x) == key && h.w == shape; };
  const bool n0 = names(h0), n1 = names(h1);
  return n0 && n1 ? (protocol::SignalIsNewer(h1.z, h0.z) ? 1 : 0) : n0 ? 0 : n1 ? 1 : -1;
}

// ------------------------------------------------------------------------------------------ BF16 sums

// The combine's fp32 accumulation of bf16 rows and its one rounding back (both combine phases).

/// acc[2i], acc[2i + 1] += w * the two bf16 channels of word i of v (fp32 fma, the CPU backend's order).
__device__ __forceinline__ void AccumulateBf16x8(const uint4& v, float w, float (&acc)[8]) {
  const uint32_t ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = __fmaf_rn(BitsToFloat(ws[i] << 16), w, acc[2 * i]);
    acc[2 * i + 1] = __fmaf_rn(BitsToFloat(ws[i] & 0xFFFF0000u), w, acc[2 * i + 1]);
  }
}

/// Eight fp32 sums rounded to bf16 and packed for one 16-byte store.
__device__ __forceinline__ uint4 PackBf16x8(const float (&acc)[8]) {
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = uint32_t{FloatToBf16(acc[2 * i])} | (uint32_t{FloatToBf16(acc[2 * i + 1])} << 16);
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// ------------------------------------------------------------------------------------------ FP8

/// Encodes 16 channels per lane (8 lanes per 128-channel group); returns the 16 e4m3 codes and the group's
/// scale_inv. Arithmetic is kernels/codec/fp8.h's; the conversion is cvt.rn.satfinite (bit-equal to
/// FloatToE4m3; fp8_encoder_test.cu runs this function against the CPU encoder).
__device__ __forceinline__ uint4 EncodeFp8x16(const uint4& a, const uint4& b, bool round_scale, float* scale_inv) {
  float v[16];
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = BitsToFloat(w[i] << 16);
    v[2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  for (int m = 4; m > 0; m >>= 1) amax = fmaxf(amax, gpu::WarpShflXor(amax, m));
  const Fp8Scale s = ComputeFp8Scale(amax, round_scale);
  *scale_inv = s.scale_inv;
  uint32_t out[4];
#if defined(LLEP_GPU_HIP)
  // No e4m3fn conversion instruction on CDNA (CDNA3's converts e4m3fnuz): the host codec's arithmetic, which the
  // CUDA conversion matches bit for bit (kernels/codec/fp8.h). The wire stays e4m3fn (kernels/HIP_PORT.md).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) word |= uint32_t{FloatToE4m3(v[4 * i + b] * s.scale)} << (8 * b);
    out[i] = word;
  }
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(v[4 * i] * s.scale, v[4 * i + 1] * s.scale), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(v[4 * i + 2] * s.scale, v[4 * i + 3] * s.scale), __NV_SATFINITE, __NV_E4M3);
    out[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
#endif
  return make_uint4(out[0], out[1], out[2], out[3]);
}

}  // namespace
}  // namespace llep::kernels::cuda
