// llep self-test: deterministic synthetic MoE decode traffic and a direct reference for its results. Layer:
// tests/harness (library llep::testing, not part of llep). Used by the benchmark (which verifies what it times), the
// multi-process tests and, later, the GPU tests. Inputs depend only on (config, rank, iteration), so every rank
// regenerates every other rank's inputs and checks its own outputs without extra communication. The reference is
// computed from the definitions (DeepEP V1 semantics), not through kernels/host/route_plan.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "runtime/cpu_buffer.h"
#include "runtime/protocol/ll_shape.h"

namespace llep::selftest {

enum class Routing {
  kRandom,     ///< top-k distinct uniform experts per token
  kHotExpert,  ///< slot 0 hits one hot expert for most tokens: one expert receives most of the traffic
};

struct WorkloadConfig {
  protocol::LlShape shape;
  int num_topk = 8;
  protocol::DispatchMode mode;
  Routing routing = Routing::kRandom;
  double hole_fraction = 0.1;   ///< probability of a -1 slot
  bool vary_num_tokens = true;  ///< otherwise every rank sends T tokens every iteration
  uint64_t seed = 1;
};

struct RankInputs {
  int num_tokens = 0;
  std::vector<uint16_t> x;          ///< bf16 [num_tokens, H]
  std::vector<int64_t> topk_idx;    ///< [num_tokens, K]
  std::vector<float> topk_weights;  ///< [num_tokens, K]
};

RankInputs MakeInputs(const WorkloadConfig& cfg, int rank, uint64_t iteration);

/// Receive-side buffers of one dispatch, sized from the shape.
struct DispatchOutputs {
  std::vector<uint8_t> recv_x;        ///< [E_loc, R*T, H * elem_bytes]
  std::vector<uint8_t> recv_scales;   ///< [E_loc, groups, R*T] * 4 bytes
  std::vector<int32_t> recv_count;    ///< [E_loc]
  std::vector<int32_t> src_info;      ///< [E_loc, R*T]
  std::vector<int64_t> layout_range;  ///< [E_loc, R]
  void Allocate(const WorkloadConfig& cfg);
};

/// A dispatch of `in` whose outputs land in `out` (which must outlive the call's receive phase).
DispatchCall MakeDispatchCall(const WorkloadConfig& cfg, const RankInputs& in, DispatchOutputs& out);

/// Checks one rank's dispatch outputs bit for bit against the definition: counts, layout ranges, src_info,
/// payload bytes and scales of every valid row.
absl::Status CheckDispatch(const WorkloadConfig& cfg, int my_rank, uint64_t iteration, const DispatchOutputs& got);

/// The stand-in expert: for every valid received row of local expert le, y = bf16(dequant(row) * m(g)) with
/// m(g) = 1 + (g % 8) / 8, g the global expert. Writes bf16 [E_loc, R*T, row_stride] (row_stride in elements).
void RunExperts(const WorkloadConfig& cfg, int my_rank, const DispatchOutputs& d, uint16_t* out, int64_t row_stride);

/// Checks combine output bf16 [num_tokens, H] bit for bit: sum over k in top-k order of fmaf(y, w, acc).
absl::Status CheckCombine(const WorkloadConfig& cfg, int my_rank, uint64_t iteration, const uint16_t* combined);

/// Remote bytes moved for this rank's tokens, for throughput reports: dispatch = messages (payload + header) it
/// sends to other ranks, combine = rows other ranks return to it (local experts' traffic never leaves the rank).
struct WireBytes {
  int64_t dispatch = 0;
  int64_t combine = 0;
};
WireBytes RemoteBytes(const WorkloadConfig& cfg, int my_rank, uint64_t iteration);

std::string Describe(const WorkloadConfig& cfg);

}  // namespace llep::selftest
