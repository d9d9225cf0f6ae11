// The shape of a low-latency buffer and the hard limits every llep wire format is sized for.
// Layer: runtime/protocol (depends on nothing). Read by the host allocator, the kernels and the proxy.
// Limits are checked by runtime/validate.cc; a shape that passes validation fits every field below.
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"

namespace llep::protocol {

// Channels per FP8 scale group (DeepEP V1: per-128-channel scales).
inline constexpr int kChannelsPerScale = 128;
// UE8M0 mode packs four scale bytes into one int32, so hidden must be a multiple of 4 * 128.
inline constexpr int kChannelsPerPackedUe8m0 = 4 * kChannelsPerScale;

// Top-k slots per token. DeepEP allows 11; 16 covers every published MoE with room to spare. The dispatch
// message header reserves one 32-bit selection entry per slot, so raising this changes the wire format.
inline constexpr int kMaxTopK = 16;
// Tokens per rank per call (T). A selection's row-in-block is a 16-bit field (dispatch_msg.h), so T <= 65536.
inline constexpr int kMaxTokensPerRank = 65536;
// Ranks: source/destination fields are 16 bits wide (imm.h, fifo_cmd.h).
inline constexpr int kMaxRanks = 65536;
// Local experts per rank: the selection entry's expert field is 16 bits wide.
inline constexpr int kMaxLocalExperts = 65536;
// Global experts: ids travel as int64 from the caller but must fit an int32 everywhere inside llep.
inline constexpr int kMaxExperts = 1 << 20;
// Hidden size: large enough for every model we know, small enough that one row fits a 32-bit byte count.
inline constexpr int kMaxHidden = 65536;

/// The geometry shared by every call on one buffer. All ranks must agree on it: it defines the memory layout.
struct LlShape {
  int max_tokens_per_rank = 0;  ///< T: the most tokens one rank passes to one dispatch.
  int hidden = 0;               ///< H: channels per token; a multiple of 128.
  int num_experts = 0;          ///< E: global experts; a multiple of num_ranks.
  int num_ranks = 0;            ///< R: ranks in the expert-parallel group.

  LLEP_HD constexpr int num_local_experts() const { return num_experts / num_ranks; }
  /// R*T: the row capacity of one local expert in the packed receive layout.
  LLEP_HD constexpr int64_t max_recv_rows() const { return int64_t{num_ranks} * max_tokens_per_rank; }
  LLEP_HD constexpr int num_scales() const { return hidden / kChannelsPerScale; }
  LLEP_HD constexpr int num_packed_ue8m0() const { return hidden / kChannelsPerPackedUe8m0; }
};

/// How dispatch encodes token payloads. Fixed per call, not per buffer: the layout is sized for the largest.
struct DispatchMode {
  bool use_fp8 = true;       ///< FP8 e4m3 + per-128-channel fp32 scale_inv; otherwise BF16.
  bool round_scale = false;  ///< FP8 only: scale_inv rounded up to a power of two.
  bool use_ue8m0 = false;    ///< Requires round_scale: scales delivered as packed UE8M0 bytes in int32.
};

}  // namespace llep::protocol
