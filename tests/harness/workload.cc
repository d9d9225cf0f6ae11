#include "tests/harness/workload.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/codec/fp8.h"
#include "kernels/host/ll_host.h"
#include "runtime/protocol/dispatch_msg.h"
#include "runtime/protocol/ll_layout.h"

namespace llep::selftest {
namespace {

using kernels::Bf16ToFloat;
using kernels::FloatToBf16;

// SplitMix64: a tiny, fast, well-distributed generator; streams are keyed by (seed, rank, iteration, purpose).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0); }
  int Below(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t s_;
};

uint64_t StreamSeed(const WorkloadConfig& cfg, int rank, uint64_t iteration, uint64_t purpose) {
  Rng r(cfg.seed * 0x100000001B3ull ^ (static_cast<uint64_t>(rank) << 40) ^ (iteration << 8) ^ purpose);
  return r.Next();
}

int NumTokens(const WorkloadConfig& cfg, int rank, uint64_t iteration) {
  const int T = cfg.shape.max_tokens_per_rank;
  if (!cfg.vary_num_tokens || iteration % 10 == 0) return T;
  Rng r(StreamSeed(cfg, rank, iteration, 1));
  if (r.Below(16) == 0) return 0;  // an idle rank still takes part (DP attention dummy batches)
  return 1 + r.Below(T);
}

int64_t ElemBytes(const WorkloadConfig& cfg) { return cfg.mode.use_fp8 ? 1 : 2; }
int64_t ScaleGroups(const WorkloadConfig& cfg) {
  return cfg.mode.use_ue8m0 ? cfg.shape.num_packed_ue8m0() : cfg.shape.num_scales();
}

// Dequantised payload of token x under the config's mode: what an expert sees.
void Dequantize(const WorkloadConfig& cfg, const uint16_t* x, std::vector<float>* out) {
  const int H = cfg.shape.hidden;
  out->resize(H);
  if (!cfg.mode.use_fp8) {
    for (int c = 0; c < H; ++c) (*out)[c] = Bf16ToFloat(x[c]);
    return;
  }
  std::vector<uint8_t> payload(protocol::Fp8PayloadBytes(H));
  kernels::EncodeDispatchPayload(x, H, cfg.mode, payload.data());
  const auto* scales = reinterpret_cast<const float*>(payload.data() + protocol::Fp8ScalesOffset(H));
  for (int c = 0; c < H; ++c) (*out)[c] = kernels::E4m3ToFloat(payload[c]) * scales[c / protocol::kChannelsPerScale];
}

float ExpertMultiplier(int64_t g) { return 1.0f + static_cast<float>(g % 8) / 8.0f; }

}  // namespace

std::string Describe(const WorkloadConfig& cfg) {
  const char* mode = !cfg.mode.use_fp8      ? "bf16"
                     : cfg.mode.use_ue8m0   ? "fp8+ue8m0"
                     : cfg.mode.round_scale ? "fp8+round"
                                            : "fp8";
  return absl::StrCat("T=", cfg.shape.max_tokens_per_rank, " H=", cfg.shape.hidden, " E=", cfg.shape.num_experts,
                      " R=", cfg.shape.num_ranks, " K=", cfg.num_topk, " ", mode, " ",
                      cfg.routing == Routing::kRandom ? "random" : "hot-expert");
}

RankInputs MakeInputs(const WorkloadConfig& cfg, int rank, uint64_t iteration) {
  const int H = cfg.shape.hidden, K = cfg.num_topk, E = cfg.shape.num_experts;
  RankInputs in;
  in.num_tokens = NumTokens(cfg, rank, iteration);
  const int N = in.num_tokens;
  in.x.resize(static_cast<size_t>(N) * H);
  in.topk_idx.resize(static_cast<size_t>(N) * K);
  in.topk_weights.resize(static_cast<size_t>(N) * K);
  Rng rx(StreamSeed(cfg, rank, iteration, 2));
  // Per 128-channel group amplitudes span the FP8 scale range, including all-zero groups (amax floor 1e-4).
  static constexpr float kAmp[] = {0.0f, 1e-6f, 3e-3f, 0.1f, 1.0f, 7.5f, 300.0f, 2e4f};
  for (int t = 0; t < N; ++t) {
    for (int g = 0; g < H / protocol::kChannelsPerScale; ++g) {
      const float amp = kAmp[rx.Below(8)];
      for (int c = 0; c < protocol::kChannelsPerScale; ++c) {
        const float v = static_cast<float>((rx.Uniform() * 2.0 - 1.0) * amp);
        in.x[static_cast<size_t>(t) * H + g * protocol::kChannelsPerScale + c] = FloatToBf16(v);
      }
    }
  }
  Rng rt(StreamSeed(cfg, rank, iteration, 3));
  std::vector<int> perm(E);
  const int hot = (static_cast<int>(iteration) * 7 + 3) % E;
  for (int t = 0; t < N; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    int start = 0;
    if (cfg.routing == Routing::kHotExpert && rt.Uniform() < 0.9) {
      std::swap(perm[0], perm[hot]);
      start = 1;
    }
    for (int k = start; k < K && k < E; ++k) std::swap(perm[k], perm[k + rt.Below(E - k)]);
    for (int k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(t) * K + k;
      in.topk_idx[i] = (k < E && rt.Uniform() >= cfg.hole_fraction) ? perm[k] : -1;
      in.topk_weights[i] = static_cast<float>(0.05 + rt.Uniform());
    }
  }
  return in;
}

void DispatchOutputs::Allocate(const WorkloadConfig& cfg) {
  const int64_t E_loc = cfg.shape.num_local_experts(), rows = cfg.shape.max_recv_rows();
  recv_x.assign(static_cast<size_t>(E_loc * rows * cfg.shape.hidden * ElemBytes(cfg)), 0);
  recv_scales.assign(static_cast<size_t>(E_loc * rows * ScaleGroups(cfg) * 4), 0);
  recv_count.assign(static_cast<size_t>(E_loc), 0);
  src_info.assign(static_cast<size_t>(E_loc * rows), 0);
  layout_range.assign(static_cast<size_t>(E_loc * cfg.shape.num_ranks), 0);
}

DispatchCall MakeDispatchCall(const WorkloadConfig& cfg, const RankInputs& in, DispatchOutputs& out) {
  DispatchCall call;
  call.x = in.x.data();
  call.topk_idx = in.topk_idx.data();
  call.num_tokens = in.num_tokens;
  call.num_topk = cfg.num_topk;
  call.mode = cfg.mode;
  call.recv_x = out.recv_x.data();
  call.recv_scales = out.recv_scales.data();
  call.recv_count = out.recv_count.data();
  call.src_info = out.src_info.data();
  call.layout_range = out.layout_range.data();
  return call;
}

absl::Status CheckDispatch(const WorkloadConfig& cfg, int my_rank, uint64_t iteration, const DispatchOutputs& got) {
  const int R = cfg.shape.num_ranks, H = cfg.shape.hidden, K = cfg.num_topk;
  const int E_loc = cfg.shape.num_local_experts();
  const int64_t rows = cfg.shape.max_recv_rows(), eb = ElemBytes(cfg), groups = ScaleGroups(cfg);
  std::vector<int64_t> next_row(E_loc, 0);
  std::vector<uint8_t> payload(protocol::DispatchPayloadStrideMax(H));
  for (int src = 0; src < R; ++src) {
    const RankInputs in = MakeInputs(cfg, src, iteration);
    for (int le = 0; le < E_loc; ++le) {
      const int64_t g = static_cast<int64_t>(my_rank) * E_loc + le;
      const int64_t begin = next_row[le];
      int64_t row = begin;
      for (int t = 0; t < in.num_tokens; ++t) {
        bool selected = false;
        for (int k = 0; k < K; ++k) selected |= in.topk_idx[static_cast<size_t>(t) * K + k] == g;
        if (!selected) continue;
        const auto where = [&] {  // only on failure: this runs for every received row
          return absl::StrCat("rank ", my_rank, " iter ", iteration, " expert ", le, " row ", row, " (src rank ", src,
                              " token ", t, ")");
        };
        if (row >= rows) return absl::InternalError(absl::StrCat(where(), ": row beyond R*T"));
        if (got.src_info[le * rows + row] != t) {
          return absl::InternalError(absl::StrCat(where(), ": src_info ", got.src_info[le * rows + row]));
        }
        kernels::EncodeDispatchPayload(&in.x[static_cast<size_t>(t) * H], H, cfg.mode, payload.data());
        if (std::memcmp(&got.recv_x[(le * rows + row) * H * eb], payload.data(), static_cast<size_t>(H * eb)) != 0) {
          return absl::InternalError(absl::StrCat(where(), ": payload bytes differ"));
        }
        if (cfg.mode.use_fp8) {
          const auto* scales = reinterpret_cast<const float*>(payload.data() + protocol::Fp8ScalesOffset(H));
          for (int64_t gi = 0; gi < groups; ++gi) {
            uint8_t want[4];
            if (cfg.mode.use_ue8m0) {
              for (int j = 0; j < 4; ++j) want[j] = kernels::Ue8m0FromScaleInv(scales[gi * 4 + j]);
            } else {
              std::memcpy(want, &scales[gi], 4);
            }
            if (std::memcmp(&got.recv_scales[((le * groups + gi) * rows + row) * 4], want, 4) != 0) {
              return absl::InternalError(absl::StrCat(where(), ": scale group ", gi, " differs"));
            }
          }
        }
        ++row;
      }
      const int64_t count = row - begin;
      const int64_t want_range = protocol::PackLayoutRange(count, begin);
      if (got.layout_range[static_cast<size_t>(le) * R + src] != want_range) {
        return absl::InternalError(absl::StrCat("rank ", my_rank, " iter ", iteration, " layout_range[", le, "][", src,
                                                "] = ", got.layout_range[static_cast<size_t>(le) * R + src],
                                                ", want count ", count, " begin ", begin));
      }
      next_row[le] = row;
    }
  }
  for (int le = 0; le < E_loc; ++le) {
    if (got.recv_count[le] != next_row[le]) {
      return absl::InternalError(absl::StrCat("rank ", my_rank, " iter ", iteration, " recv_count[", le,
                                              "] = ", got.recv_count[le], ", want ", next_row[le]));
    }
  }
  return absl::OkStatus();
}

void RunExperts(const WorkloadConfig& cfg, int my_rank, const DispatchOutputs& d, uint16_t* out, int64_t row_stride) {
  const int H = cfg.shape.hidden, E_loc = cfg.shape.num_local_experts();
  const int64_t rows = cfg.shape.max_recv_rows(), groups = ScaleGroups(cfg);
  for (int le = 0; le < E_loc; ++le) {
    const float m = ExpertMultiplier(static_cast<int64_t>(my_rank) * E_loc + le);
    for (int64_t row = 0; row < d.recv_count[le]; ++row) {
      uint16_t* y = out + (le * rows + row) * row_stride;
      if (!cfg.mode.use_fp8) {
        const auto* x = reinterpret_cast<const uint16_t*>(&d.recv_x[(le * rows + row) * H * 2]);
        for (int c = 0; c < H; ++c) y[c] = FloatToBf16(Bf16ToFloat(x[c]) * m);
        continue;
      }
      const uint8_t* codes = &d.recv_x[(le * rows + row) * H];
      for (int c = 0; c < H; ++c) {
        const int g = c / protocol::kChannelsPerScale;
        float scale_inv;
        if (cfg.mode.use_ue8m0) {
          scale_inv = kernels::ScaleInvFromUe8m0(d.recv_scales[((le * groups + g / 4) * rows + row) * 4 + g % 4]);
        } else {
          std::memcpy(&scale_inv, &d.recv_scales[((le * groups + g) * rows + row) * 4], 4);
        }
        y[c] = FloatToBf16(kernels::E4m3ToFloat(codes[c]) * scale_inv * m);
      }
    }
  }
}

absl::Status CheckCombine(const WorkloadConfig& cfg, int my_rank, uint64_t iteration, const uint16_t* combined) {
  const int H = cfg.shape.hidden, K = cfg.num_topk;
  const RankInputs in = MakeInputs(cfg, my_rank, iteration);
  std::vector<float> deq, acc(H);
  for (int t = 0; t < in.num_tokens; ++t) {
    Dequantize(cfg, &in.x[static_cast<size_t>(t) * H], &deq);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      const int64_t g = in.topk_idx[static_cast<size_t>(t) * K + k];
      if (g < 0) continue;
      const float w = in.topk_weights[static_cast<size_t>(t) * K + k], m = ExpertMultiplier(g);
      for (int c = 0; c < H; ++c) acc[c] = std::fmaf(Bf16ToFloat(FloatToBf16(deq[c] * m)), w, acc[c]);
    }
    for (int c = 0; c < H; ++c) {
      const uint16_t want = FloatToBf16(acc[c]), have = combined[static_cast<size_t>(t) * H + c];
      if (want != have) {
        return absl::InternalError(absl::StrCat("rank ", my_rank, " iter ", iteration, " combined[", t, "][", c,
                                                "] = 0x", absl::Hex(have), ", want 0x", absl::Hex(want)));
      }
    }
  }
  return absl::OkStatus();
}

WireBytes RemoteBytes(const WorkloadConfig& cfg, int my_rank, uint64_t iteration) {
  const int R = cfg.shape.num_ranks, K = cfg.num_topk, E_loc = cfg.shape.num_local_experts();
  const RankInputs in = MakeInputs(cfg, my_rank, iteration);
  WireBytes b;
  const int64_t payload = protocol::DispatchPayloadBytes(cfg.shape.hidden, cfg.mode.use_fp8);
  const int64_t header = sizeof(protocol::DispatchTokenHeader);
  for (int t = 0; t < in.num_tokens; ++t) {
    std::vector<bool> to_rank(R, false);
    for (int k = 0; k < K; ++k) {
      const int64_t g = in.topk_idx[static_cast<size_t>(t) * K + k];
      if (g < 0 || g / E_loc == my_rank) continue;
      to_rank[g / E_loc] = true;
      b.combine += protocol::CombineRowBytes(cfg.shape.hidden);  // each remote selection's row comes back
    }
    for (int r = 0; r < R; ++r) b.dispatch += to_rank[r] ? payload + header : 0;
  }
  return b;
}

}  // namespace llep::selftest
