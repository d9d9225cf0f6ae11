#include "kernels/host/ll_host.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/codec/fp8.h"
#include "kernels/host/ll_host_internal.h"
#include "runtime/protocol/dispatch_msg.h"
#include "runtime/protocol/signal.h"
#include "runtime/protocol/sys_order.h"

namespace llep::kernels {

using protocol::LlOp;

namespace {

using AccumulateFn = void (*)(float*, const uint16_t*, float, int);

// fmaf, not a*b+c: a fused multiply-add is what the GPU emits, so both backends round identically. fma is
// correctly rounded, so the vectorised and the portable variant give the same bits.
void AccumulatePortable(float* acc, const uint16_t* row, float w, int n) {
  for (int c = 0; c < n; ++c) acc[c] = std::fmaf(Bf16ToFloat(row[c]), w, acc[c]);
}

#if defined(__x86_64__) && defined(__GNUC__)
// 8-wide vfmadd instead of a libm call per element: 50x on the combine inner loop (bench/RESULTS.md,
// codec_bench BM_CombineAccumulateRow/7168: 19.5 us -> 0.39 us per row).
// (clang, in the LLEP_GPU=hip build, vectorizes it at -O2 and has no optimize attribute.)
#if defined(__clang__)
__attribute__((target("avx2,fma")))
#else
__attribute__((target("avx2,fma"), optimize("tree-vectorize")))
#endif
void AccumulateAvx2(float* acc, const uint16_t* row, float w, int n) {
  for (int c = 0; c < n; ++c) acc[c] = __builtin_fmaf(BitsToFloat(uint32_t{row[c]} << 16), w, acc[c]);
}
#endif

AccumulateFn SelectAccumulate() {
  // LLEP_CPU_PORTABLE_FMA=1 forces the libm path (debugging, and before/after benchmarks in one build).
  const char* portable = std::getenv("LLEP_CPU_PORTABLE_FMA");
  if (portable != nullptr && portable[0] == '1') return AccumulatePortable;
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AccumulateAvx2;
#endif
  return AccumulatePortable;
}

}  // namespace

void AccumulateWeightedRow(float* acc, const uint16_t* row, float w, int n) {
  static const AccumulateFn fn = SelectAccumulate();
  fn(acc, row, w, n);
}

namespace {

constexpr int kGroup = protocol::kChannelsPerScale;
using EncodeGroupFn = float (*)(const uint16_t*, bool, uint8_t*);

// One 128-channel group: amax, scales, codes; returns scale_inv. The reference: FloatToE4m3 per element.
float EncodeGroupPortable(const uint16_t* xg, bool round_scale, uint8_t* codes) {
  float amax = 0.0f;
  for (int c = 0; c < kGroup; ++c) amax = MaxIgnoringNan(amax, fabsf(Bf16ToFloat(xg[c])));
  const Fp8Scale s = ComputeFp8Scale(amax, round_scale);
  for (int c = 0; c < kGroup; ++c) codes[c] = FloatToE4m3(Bf16ToFloat(xg[c]) * s.scale);
  return s.scale_inv;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same algorithm as FloatToE4m3, eight lanes at a time: NaN -> 0x7F, |v| > 448 -> 0x7E, below 2^-6 the
// subnormal grid (rint(|v| * 512), exact scaling), otherwise the exponent/mantissa bits rounded to nearest even
// (the carry of the rounding propagates into the exponent by plain addition). Checked against the scalar path
// on every bf16 pattern (ll_host_test VectorisedEncodeMatchesReference).
__attribute__((target("avx2"))) float EncodeGroupAvx2(const uint16_t* xg, bool round_scale, uint8_t* codes) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256 vmax = _mm256_setzero_ps();
  __m256 v[kGroup / 8];
  for (int i = 0; i < kGroup / 8; ++i) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xg + 8 * i));
    v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16 -> f32, exact
    // maxps returns its second operand when either is NaN: with vmax second, NaN inputs are ignored (GPU max.f32).
    vmax = _mm256_max_ps(_mm256_and_ps(v[i], _mm256_castsi256_ps(abs_mask)), vmax);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (float l : lanes) amax = MaxIgnoringNan(amax, l);
  const Fp8Scale s = ComputeFp8Scale(amax, round_scale);
  const __m256 scale = _mm256_set1_ps(s.scale);
  for (int i = 0; i < kGroup / 8; ++i) {
    const __m256i bits = _mm256_castps_si256(_mm256_mul_ps(v[i], scale));
    const __m256i a = _mm256_and_si256(bits, abs_mask);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
    // Normal path: ((a >> 20) - (120 << 3)) is ((exp + 7) << 3) | top-3 mantissa bits; add the RNE carry.
    const __m256i keep = _mm256_srli_epi32(a, 20);
    const __m256i rem = _mm256_and_si256(a, _mm256_set1_epi32(0xFFFFF));
    const __m256i half = _mm256_set1_epi32(0x80000);
    const __m256i odd = _mm256_and_si256(keep, _mm256_set1_epi32(1));
    const __m256i up =
        _mm256_or_si256(_mm256_cmpgt_epi32(rem, half),
                        _mm256_and_si256(_mm256_cmpeq_epi32(rem, half), _mm256_cmpeq_epi32(odd, _mm256_set1_epi32(1))));
    __m256i normal = _mm256_sub_epi32(_mm256_sub_epi32(keep, _mm256_set1_epi32(120 << 3)), up);  // up is -1 or 0
    normal = _mm256_min_epi32(normal, _mm256_set1_epi32(0x7E));
    // Subnormal path: |v| * 2^9 rounded to nearest even (exact scaling; 8 encodes the smallest normal).
    const __m256 mag = _mm256_castsi256_ps(a);
    const __m256i sub = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(mag, _mm256_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a);  // a < 2^-6
    __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
    const __m256i sat = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43E00000));  // |v| > 448, incl. inf
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7E), sat);
    code = _mm256_or_si256(code, sign);
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), nan);
    // Pack eight int32 codes (0..255) into eight bytes.
    const __m256i bytes =
        _mm256_shuffle_epi8(code, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                                                   12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 0));
    const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 4));
    std::memcpy(codes + 8 * i, &lo, 4);
    std::memcpy(codes + 8 * i + 4, &hi, 4);
  }
  return s.scale_inv;
}
#endif

EncodeGroupFn SelectEncodeGroup() {
  const char* portable = std::getenv("LLEP_CPU_PORTABLE_FP8");
  if (portable != nullptr && portable[0] == '1') return EncodeGroupPortable;
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2")) return EncodeGroupAvx2;
#endif
  return EncodeGroupPortable;
}

}  // namespace

void EncodeDispatchPayload(const uint16_t* x, int hidden, const protocol::DispatchMode& mode, uint8_t* payload) {
  if (!mode.use_fp8) {
    std::memcpy(payload, x, static_cast<size_t>(hidden) * 2);
    return;
  }
  static const EncodeGroupFn encode_group = SelectEncodeGroup();
  float* scales = reinterpret_cast<float*>(payload + protocol::Fp8ScalesOffset(hidden));
  for (int g = 0; g < hidden / kGroup; ++g)
    scales[g] = encode_group(x + g * kGroup, mode.round_scale, payload + g * kGroup);
}

void EncodeDispatchPayloadReference(const uint16_t* x, int hidden, const protocol::DispatchMode& mode,
                                    uint8_t* payload) {
  if (!mode.use_fp8) {
    std::memcpy(payload, x, static_cast<size_t>(hidden) * 2);
    return;
  }
  float* scales = reinterpret_cast<float*>(payload + protocol::Fp8ScalesOffset(hidden));
  for (int g = 0; g < hidden / kGroup; ++g)
    scales[g] = EncodeGroupPortable(x + g * kGroup, mode.round_scale, payload + g * kGroup);
}

bool DispatchSendHost(const HostRankContext& ctx, const DispatchSendArgs& a) {
  const protocol::LlLayout& L = ctx.layout;
  const protocol::DispatchCall& call = *a.call;
  const RoutePlan& plan = *a.plan;
  const int half = protocol::HalfOfSeq(a.seq), R = L.shape.num_ranks, H = L.shape.hidden;
  const int E_loc = L.shape.num_local_experts();
  const bool fp8 = call.mode.use_fp8;
  const int64_t payload_bytes = protocol::DispatchPayloadBytes(H, fp8);
  const int64_t stride = protocol::DispatchPayloadStride(H, fp8);

  // 1. Stage each routed token's payload once; every destination reads the same bytes.
  for (int t = 0; t < plan.num_tokens; ++t) {
    bool routed = false;
    for (int d = 0; d < R && !routed; ++d) routed = plan.slot[static_cast<size_t>(t) * R + d] >= 0;
    if (routed) {
      EncodeDispatchPayload(call.x + static_cast<size_t>(t) * H, H, call.mode,
                            ctx.local_base + L.DispatchPayloadOffset(half, t, fp8));
    }
  }
  // 2. Route blocks: per destination, counts per local expert, then one header per token in slot order.
  for (int d = 0; d < R; ++d) {
    const int64_t blk = L.RouteSendOffset(half, d);
    auto* counts = reinterpret_cast<uint64_t*>(ctx.local_base + blk);
    std::memset(counts, 0, static_cast<size_t>(protocol::RouteCountsBytes(L.shape)));
    for (int le = 0; le < E_loc; ++le) {
      counts[le] =
          protocol::PackRouteCount(a.seq, static_cast<uint32_t>(plan.counts[static_cast<size_t>(d) * E_loc + le]));
    }
  }
  for (int t = 0; t < plan.num_tokens; ++t) {
    for (int d = 0; d < R; ++d) {
      const int32_t j = plan.slot[static_cast<size_t>(t) * R + d];
      if (j < 0) continue;
      auto* h = reinterpret_cast<protocol::DispatchTokenHeader*>(ctx.local_base +
                                                                 L.RouteHeaderOffset(L.RouteSendOffset(half, d), j));
      std::memset(h, 0, sizeof(*h));
      h->src_token_idx = t;
      h->version = protocol::kDispatchMsgVersion;
      h->seq = a.seq;
      h->flags = (fp8 ? protocol::kMsgFlagFp8 : 0) | (call.carries_weights ? protocol::kMsgFlagWeights : 0);
      auto* w = reinterpret_cast<float*>(ctx.local_base + L.RouteWeightsOffset(L.RouteSendOffset(half, d), j));
      for (int k = 0; k < plan.num_topk; ++k) {
        const RouteEntry& e = plan.at(t, k);
        if (e.dst_rank != d) continue;
        if (call.carries_weights) w[h->num_sel] = call.topk_weights[static_cast<size_t>(t) * plan.num_topk + k];
        h->sel[h->num_sel++] =
            protocol::PackSelection(static_cast<uint32_t>(e.local_expert), static_cast<uint32_t>(e.row_in_block));
      }
    }
  }
  // 3. Deliver: route block, payloads (coalesced into runs of consecutive tokens and slots), then the signal.
  for (int d = 0; d < R; ++d) {
    if (IsMasked(ctx, d)) continue;
    const HostPeer& peer = ctx.peers[d];
    const int n = plan.tokens_per_dst[d];
    const int64_t route_bytes = protocol::RouteBlockUsedBytes(L.shape, n);
    const uint64_t signal = protocol::PackSignal(a.seq, static_cast<uint32_t>(n));
    // The messages' weights rows (a dispatch that carries topk_weights): one contiguous run of n rows.
    const int64_t weights_bytes = call.carries_weights ? n * protocol::RouteWeightsRowBytes() : 0;
    const int64_t weights_from = L.RouteWeightsOffset(L.RouteSendOffset(half, d), 0);
    const int64_t weights_to = L.RouteWeightsOffset(L.RouteRecvOffset(half, ctx.rank), 0);
    if (peer.direct_base != nullptr) {
      std::memcpy(peer.direct_base + L.RouteRecvOffset(half, ctx.rank), ctx.local_base + L.RouteSendOffset(half, d),
                  static_cast<size_t>(route_bytes));
      if (weights_bytes > 0) {
        std::memcpy(peer.direct_base + weights_to, ctx.local_base + weights_from, static_cast<size_t>(weights_bytes));
      }
      for (int t = 0; t < plan.num_tokens; ++t) {
        const int32_t j = plan.slot[static_cast<size_t>(t) * R + d];
        if (j < 0) continue;
        std::memcpy(peer.direct_base + L.DispatchRecvOffset(half, ctx.rank, j, fp8),
                    ctx.local_base + L.DispatchPayloadOffset(half, t, fp8), static_cast<size_t>(payload_bytes));
      }
      SignalPeer(ctx, peer, LlOp::kDispatch, half, d, signal);  // a mapped peer: a store, never refused
      continue;
    }
    if (!PushWrite(peer, LlOp::kDispatch, half, d, L.RouteSendOffset(half, d), L.RouteRecvOffset(half, ctx.rank),
                   route_bytes) ||
        (weights_bytes > 0 && !PushWrite(peer, LlOp::kDispatch, half, d, weights_from, weights_to, weights_bytes))) {
      return false;
    }
    int run_t = -1, run_j = -1, run_len = 0;
    auto flush = [&]() {
      if (run_len == 0) return true;
      const bool ok = PushWrite(peer, LlOp::kDispatch, half, d, L.DispatchPayloadOffset(half, run_t, fp8),
                                L.DispatchRecvOffset(half, ctx.rank, run_j, fp8), run_len * stride);
      run_len = 0;
      return ok;
    };
    for (int t = 0; t < plan.num_tokens; ++t) {
      const int32_t j = plan.slot[static_cast<size_t>(t) * R + d];
      if (j < 0) continue;
      if (run_len > 0 && t == run_t + run_len && j == run_j + run_len) {
        ++run_len;
        continue;
      }
      if (!flush()) return false;
      run_t = t, run_j = j, run_len = 1;
    }
    if (!flush() || !SignalPeer(ctx, peer, LlOp::kDispatch, half, d, signal)) return false;
  }
  return true;
}

std::string DispatchRecvHost(const HostRankContext& ctx, const DispatchRecvArgs& a) {
  const protocol::LlLayout& L = ctx.layout;
  const protocol::DispatchCall& call = *a.call;
  const int half = protocol::HalfOfSeq(a.seq), R = L.shape.num_ranks, H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E_loc = L.shape.num_local_experts();
  const int64_t rows = L.shape.max_recv_rows();
  const bool fp8 = call.mode.use_fp8;
  const int num_scales = L.shape.num_scales(), num_packed = L.shape.num_packed_ue8m0();

  // Counts and block starts: blocks of one expert are ordered by source rank.
  std::vector<uint32_t> cnt(static_cast<size_t>(R) * E_loc);
  std::vector<int64_t> begin(static_cast<size_t>(R) * E_loc);
  for (int src = 0; src < R; ++src) {
    if (IsMasked(ctx, src)) continue;  // its counts stay 0, its route block (stale) is not read
    if (a.tokens_from_src[src] > static_cast<uint32_t>(T)) {
      return "source rank " + std::to_string(src) + " announced " + std::to_string(a.tokens_from_src[src]) +
             " tokens, more than T=" + std::to_string(T);
    }
    const auto* c = reinterpret_cast<const uint64_t*>(ctx.local_base + L.RouteRecvOffset(half, src));
    for (int le = 0; le < E_loc; ++le) {
      if (protocol::RouteCountSeq(c[le]) != a.seq) {
        return "source rank " + std::to_string(src) + " sent a route count of call " +
               std::to_string(protocol::RouteCountSeq(c[le])) + ", not " + std::to_string(a.seq) +
               " (route block overwritten or stale)";
      }
      const uint32_t n = protocol::RouteCountValue(c[le]);
      if (n > static_cast<uint32_t>(T)) return "source rank " + std::to_string(src) + " announced a count over T";
      cnt[static_cast<size_t>(src) * E_loc + le] = n;
    }
  }
  for (int le = 0; le < E_loc; ++le) {
    int64_t acc = 0;
    for (int src = 0; src < R; ++src) {
      const uint32_t c = cnt[static_cast<size_t>(src) * E_loc + le];
      begin[static_cast<size_t>(src) * E_loc + le] = acc;
      call.layout_range[static_cast<size_t>(le) * R + src] = protocol::PackLayoutRange(c, acc);
      acc += c;
    }
    call.recv_count[le] = static_cast<int32_t>(acc);
    if (call.cumulative_local_expert_recv_stats != nullptr)
      call.cumulative_local_expert_recv_stats[le] += static_cast<int32_t>(acc);
  }

  std::vector<uint32_t> seen(static_cast<size_t>(R) * E_loc, 0);
  if (a.expert_plan != nullptr) {
    a.expert_plan->plan_key = call.plan_key;
    a.expert_plan->by_src.assign(static_cast<size_t>(R), {});
  }
  for (int src = 0; src < R; ++src) {
    if (IsMasked(ctx, src)) continue;
    const int64_t blk = L.RouteRecvOffset(half, src);
    for (uint32_t j = 0; j < a.tokens_from_src[src]; ++j) {
      const auto* h = reinterpret_cast<const protocol::DispatchTokenHeader*>(
          ctx.local_base + L.RouteHeaderOffset(blk, static_cast<int>(j)));
      // Built only on the error paths: this loop runs once per received message.
      const auto where = [&] { return "message " + std::to_string(j) + " from rank " + std::to_string(src); };
      if (h->version != protocol::kDispatchMsgVersion) return where() + ": bad header version";
      if (h->seq != a.seq) {
        return where() + ": sequence " + std::to_string(h->seq) + " != " + std::to_string(a.seq) +
               " (slot overwritten: more low-latency calls in flight than allowed)";
      }
      if (((h->flags & protocol::kMsgFlagFp8) != 0) != fp8) return where() + ": ranks disagree on use_fp8";
      if (((h->flags & protocol::kMsgFlagWeights) != 0) != call.carries_weights) {
        return where() + ": ranks disagree on passing topk_weights to the dispatch";
      }
      if (h->num_sel == 0 || h->num_sel > protocol::kMaxTopK) return where() + ": bad selection count";
      if (h->src_token_idx < 0 || h->src_token_idx >= T) return where() + ": token index out of range";
      const uint8_t* payload = ctx.local_base + L.DispatchRecvOffset(half, src, static_cast<int>(j), fp8);
      ExpertSidePlan::Message* kept = nullptr;
      if (a.expert_plan != nullptr) {
        kept = &a.expert_plan->by_src[static_cast<size_t>(src)].emplace_back();
        kept->token = h->src_token_idx;
        kept->n = h->num_sel;
        std::memcpy(kept->w, ctx.local_base + L.RouteWeightsOffset(blk, static_cast<int>(j)),
                    sizeof(float) * h->num_sel);
      }
      for (int i = 0; i < h->num_sel; ++i) {
        const uint32_t le = protocol::SelectionExpert(h->sel[i]), r = protocol::SelectionRow(h->sel[i]);
        if (le >= static_cast<uint32_t>(E_loc) || r >= cnt[static_cast<size_t>(src) * E_loc + le]) {
          return where() + ": selection outside the announced counts";
        }
        ++seen[static_cast<size_t>(src) * E_loc + le];
        const int64_t row = begin[static_cast<size_t>(src) * E_loc + le] + r;
        if (kept != nullptr) kept->row[i] = le * rows + row;
        call.src_info[le * rows + row] = h->src_token_idx;
        if (!fp8) {
          std::memcpy(static_cast<uint16_t*>(call.recv_x) + (le * rows + row) * H, payload, static_cast<size_t>(H) * 2);
          continue;
        }
        std::memcpy(static_cast<uint8_t*>(call.recv_x) + (le * rows + row) * H, payload, static_cast<size_t>(H));
        const auto* scales = reinterpret_cast<const float*>(payload + protocol::Fp8ScalesOffset(H));
        if (call.mode.use_ue8m0) {
          // int32 [E_loc, H/512, R*T]: byte g%4 (little-endian) of word (le, g/4, row) is group g's exponent.
          auto* packed = static_cast<uint8_t*>(call.recv_scales);
          for (int g = 0; g < num_scales; ++g) {
            packed[((le * num_packed + g / 4) * rows + row) * 4 + g % 4] = Ue8m0FromScaleInv(scales[g]);
          }
        } else {
          auto* out = static_cast<float*>(call.recv_scales);
          for (int g = 0; g < num_scales; ++g) out[(le * num_scales + g) * rows + row] = scales[g];
        }
      }
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] != cnt[i]) {
      return "rank " + std::to_string(i / E_loc) + " announced " + std::to_string(cnt[i]) +
             " tokens for local expert " + std::to_string(i % E_loc) + " but sent " + std::to_string(seen[i]);
    }
  }
  return "";
}

}  // namespace llep::kernels
