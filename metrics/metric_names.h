// The names llep exports (Prometheus conventions: one prefix, base units, _total on counters). The dashboards
// under metrics/ use only these; tests/metrics check that every dashboard query names one of them.
// Layer: metrics.
#pragma once

namespace llep::metrics {

/// Operations whose latencies were recorded, label op.
inline constexpr char kOpsTotal[] = "llep_ops_total";
/// Receive waits that timed out (a silent peer), label op.
inline constexpr char kTimeoutsTotal[] = "llep_timeouts_total";
/// Operation latency histogram from device timestamps, labels op, phase (send, recv_wait, total).
inline constexpr char kOpLatencySeconds[] = "llep_op_latency_seconds";
/// Time the receive phase waited for each source rank, labels op, src_rank.
inline constexpr char kRecvWaitSecondsTotal[] = "llep_recv_wait_seconds_total";
/// (token, expert) selections dispatched to each rank, label dst_rank.
inline constexpr char kDispatchTokensTotal[] = "llep_dispatch_tokens_total";
/// Tokens received per MoE layer and local expert, labels layer, local_expert, expert (global id).
inline constexpr char kExpertRecvTokensTotal[] = "llep_expert_recv_tokens_total";
/// Bytes of the communication buffer, label kind.
inline constexpr char kBufferBytes[] = "llep_buffer_bytes";
/// Decode step latency as the engine measured it (host clock, one observation per step that ran a batch; reported
/// through Exporter::ObserveDecodeStep, e.g. by llep.engine).
inline constexpr char kDecodeStepSeconds[] = "llep_decode_step_seconds";
/// Tokens the engine's decode steps fed through the model (rate() of it is tokens/s).
inline constexpr char kDecodeTokensTotal[] = "llep_decode_tokens_total";

}  // namespace llep::metrics
