// The CPU-backend benchmark (llep's main job without a GPU): N rank processes on loopback, each a CpuBuffer
// over libfabric, run dispatch (FP8 by default) and combine (BF16) for the DeepSeek-V3 decode shape, verify the
// results, and print per-phase latency (median / p99 of the slowest rank per iteration), bytes and throughput.
// JSON goes to --json. Verification runs between timed iterations (every --verify_every and the last one).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "runtime/base/status_macros.h"
#include "runtime/cpu_buffer.h"
#include "runtime/protocol/ll_layout.h"
#include "tests/harness/local_job.h"
#include "tests/harness/workload.h"

ABSL_FLAG(int, ranks, 4, "rank processes");
ABSL_FLAG(int, tokens, 128, "T: tokens per rank per call");
ABSL_FLAG(int, hidden, 7168, "hidden size");
ABSL_FLAG(int, experts, 256, "global experts");
ABSL_FLAG(int, topk, 8, "experts per token");
ABSL_FLAG(std::string, dispatch, "fp8", "dispatch format: fp8, fp8_round, ue8m0, bf16");
ABSL_FLAG(std::string, provider, "shm", "libfabric provider: shm, tcp;ofi_rxm, ...");
ABSL_FLAG(int, proxy_threads, 1, "proxy threads per rank");
ABSL_FLAG(int, warmup, 5, "untimed iterations");
ABSL_FLAG(int, iterations, 50, "timed iterations");
ABSL_FLAG(int, verify_every, 10, "verify every Nth timed iteration (and the last); 0 = only the last");
ABSL_FLAG(std::string, json, "", "write results as JSON to this file");

namespace llep {
namespace {

enum Phase { kDispatchSend, kDispatchRecv, kCombineSend, kCombineRecv, kDispatch, kCombine, kRoundTrip, kNumPhases };
constexpr const char* kPhaseNames[] = {"dispatch send", "dispatch recv", "combine send", "combine recv",
                                       "dispatch",      "combine",       "round trip"};

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

protocol::DispatchMode ParseMode(const std::string& s) {
  if (s == "bf16") return {false, false, false};
  if (s == "fp8_round") return {true, true, false};
  if (s == "ue8m0") return {true, true, true};
  return {true, false, false};
}

struct Sample {
  double t[kNumPhases];
  int64_t dispatch_bytes;
  int64_t combine_bytes;
};

absl::Status BenchRank(Bootstrap& boot, const selftest::WorkloadConfig& cfg) {
  CpuBufferOptions opt;
  opt.provider = absl::GetFlag(FLAGS_provider);
  opt.num_proxy_threads = absl::GetFlag(FLAGS_proxy_threads);
  LLEP_ASSIGN_OR_RETURN(auto buf, CpuBuffer::Create(cfg.shape, boot, opt));
  const int me = buf->rank(), warmup = absl::GetFlag(FLAGS_warmup), iters = absl::GetFlag(FLAGS_iterations);
  const int verify_every = absl::GetFlag(FLAGS_verify_every);
  const int64_t E_loc = cfg.shape.num_local_experts(), rows = cfg.shape.max_recv_rows(), H = cfg.shape.hidden;
  selftest::DispatchOutputs d;
  d.Allocate(cfg);
  std::vector<uint16_t> y(static_cast<size_t>(E_loc * rows * H)), out;
  std::vector<Sample> samples;
  int verified = 0;
  for (int it = 0; it < warmup + iters; ++it) {
    const uint64_t iteration = static_cast<uint64_t>(it);
    const selftest::RankInputs in = selftest::MakeInputs(cfg, me, iteration);
    out.assign(static_cast<size_t>(in.num_tokens) * H, 0);
    const DispatchCall dc = selftest::MakeDispatchCall(cfg, in, d);
    LLEP_RETURN_IF_ERROR(boot.Barrier());  // aligned starts: every rank's clock measures the same collective
    const auto t0 = std::chrono::steady_clock::now();
    LLEP_ASSIGN_OR_RETURN(PendingOp dop, buf->DispatchSend(dc));
    const auto t1 = std::chrono::steady_clock::now();
    LLEP_RETURN_IF_ERROR(buf->Receive(std::move(dop)));
    const auto t2 = std::chrono::steady_clock::now();
    selftest::RunExperts(cfg, me, d, y.data(), H);  // stand-in expert compute, outside the timed phases
    CombineCall cc;
    cc.x = y.data();
    cc.topk_idx = in.topk_idx.data();
    cc.topk_weights = in.topk_weights.data();
    cc.num_tokens = in.num_tokens;
    cc.num_topk = cfg.num_topk;
    cc.layout_range = d.layout_range.data();
    cc.out = out.data();
    LLEP_RETURN_IF_ERROR(boot.Barrier());  // experts take different times per rank; keep them out of combine
    const auto t3 = std::chrono::steady_clock::now();
    LLEP_ASSIGN_OR_RETURN(PendingOp cop, buf->CombineSend(cc));
    const auto t4 = std::chrono::steady_clock::now();
    LLEP_RETURN_IF_ERROR(buf->Receive(std::move(cop)));
    const auto t5 = std::chrono::steady_clock::now();
    const int timed = it - warmup;
    if (timed >= 0) {
      Sample s{};
      s.t[kDispatchSend] = Seconds(t0, t1);
      s.t[kDispatchRecv] = Seconds(t1, t2);
      s.t[kCombineSend] = Seconds(t3, t4);
      s.t[kCombineRecv] = Seconds(t4, t5);
      s.t[kDispatch] = Seconds(t0, t2);
      s.t[kCombine] = Seconds(t3, t5);
      s.t[kRoundTrip] = s.t[kDispatch] + s.t[kCombine];  // communication only: expert time excluded
      const selftest::WireBytes wb = selftest::RemoteBytes(cfg, me, iteration);
      s.dispatch_bytes = wb.dispatch;
      s.combine_bytes = wb.combine;
      samples.push_back(s);
      if (timed == iters - 1 || (verify_every > 0 && timed % verify_every == 0)) {
        LLEP_RETURN_IF_ERROR(selftest::CheckDispatch(cfg, me, iteration, d));
        LLEP_RETURN_IF_ERROR(selftest::CheckCombine(cfg, me, iteration, out.data()));
        ++verified;
      }
    }
  }
  // Rank 0 gathers every rank's samples and reports the slowest rank per iteration (the collective's latency).
  const std::string mine(reinterpret_cast<const char*>(samples.data()), samples.size() * sizeof(Sample));
  LLEP_ASSIGN_OR_RETURN(std::vector<std::string> all, boot.AllGather(mine));
  const proxy::ProxyStats st = buf->proxy_stats();
  LLEP_RETURN_IF_ERROR(buf->Close());
  if (me != 0) return absl::OkStatus();

  std::vector<Sample> worst(samples.size());
  int64_t total_dispatch_bytes = 0, total_combine_bytes = 0;
  for (const std::string& blob : all) {
    if (blob.size() != mine.size()) return absl::InternalError("ranks ran different iteration counts");
    const auto* s = reinterpret_cast<const Sample*>(blob.data());
    for (size_t i = 0; i < samples.size(); ++i) {
      for (int p = 0; p < kNumPhases; ++p) worst[i].t[p] = std::max(worst[i].t[p], s[i].t[p]);
      total_dispatch_bytes += s[i].dispatch_bytes;
      total_combine_bytes += s[i].combine_bytes;
    }
  }
  auto percentile = [&](int p, double q) {
    std::vector<double> v;
    for (const Sample& s : worst) v.push_back(s.t[p]);
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
  };
  const double n = static_cast<double>(samples.size()) * cfg.shape.num_ranks;
  const double disp_bytes_per_rank = total_dispatch_bytes / n, comb_bytes_per_rank = total_combine_bytes / n;
  const protocol::LlLayout layout = buf->layout();
  const int64_t deepep =
      protocol::DeepEpV1LowLatencySizeHint(cfg.shape.max_tokens_per_rank, cfg.shape.hidden, cfg.shape.num_experts);
  std::printf("\nllep CPU backend: %s over %s, %d proxy thread(s)/rank, %d timed iterations (%d verified, all exact)\n",
              selftest::Describe(cfg).c_str(), buf->transport_name().c_str(), opt.num_proxy_threads, iters, verified);
  std::printf("buffer per rank: %.1f MB (DeepEP V1 hint for this shape: %.1f MB)\n", layout.total_bytes / 1e6,
              deepep / 1e6);
  std::printf("remote bytes per rank per call: dispatch %.2f MB, combine %.2f MB; rank 0 proxy: %llu writes\n",
              disp_bytes_per_rank / 1e6, comb_bytes_per_rank / 1e6, static_cast<unsigned long long>(st.writes_posted));
  std::printf("\n%-15s %12s %12s %14s\n", "phase", "median us", "p99 us", "remote GB/s");
  for (int p = 0; p < kNumPhases; ++p) {
    const double med = percentile(p, 0.5), p99 = percentile(p, 0.99);
    double bytes = 0;
    if (p == kDispatch) bytes = disp_bytes_per_rank;
    if (p == kCombine) bytes = comb_bytes_per_rank;
    if (p == kRoundTrip) bytes = disp_bytes_per_rank + comb_bytes_per_rank;
    const std::string gbps = bytes > 0 ? absl::StrFormat("%.3f", bytes / med / 1e9) : std::string("-");
    std::printf("%-15s %12.1f %12.1f %14s\n", kPhaseNames[p], med * 1e6, p99 * 1e6, gbps.c_str());
  }
  std::fflush(stdout);
  const std::string json_path = absl::GetFlag(FLAGS_json);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << "{\n  \"backend\": \"cpu\",\n  \"transport\": \"" << buf->transport_name() << "\",\n  \"config\": \""
      << selftest::Describe(cfg) << "\",\n  \"ranks\": " << cfg.shape.num_ranks << ",\n  \"iterations\": " << iters
      << ",\n  \"verified_iterations\": " << verified << ",\n  \"buffer_bytes\": " << layout.total_bytes
      << ",\n  \"deepep_v1_hint_bytes\": " << deepep
      << ",\n  \"dispatch_remote_bytes_per_rank\": " << disp_bytes_per_rank
      << ",\n  \"combine_remote_bytes_per_rank\": " << comb_bytes_per_rank << ",\n  \"phases_us\": {";
    for (int p = 0; p < kNumPhases; ++p) {
      f << (p ? "," : "") << "\n    \"" << kPhaseNames[p] << "\": {\"median\": " << percentile(p, 0.5) * 1e6
        << ", \"p99\": " << percentile(p, 0.99) * 1e6 << "}";
    }
    f << "\n  }\n}\n";
    if (!f) return absl::InternalError(absl::StrCat("could not write ", json_path));
    std::printf("\nJSON written to %s\n", json_path.c_str());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace llep

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  llep::selftest::WorkloadConfig cfg;
  cfg.shape = {absl::GetFlag(FLAGS_tokens), absl::GetFlag(FLAGS_hidden), absl::GetFlag(FLAGS_experts),
               absl::GetFlag(FLAGS_ranks)};
  cfg.num_topk = absl::GetFlag(FLAGS_topk);
  cfg.mode = llep::ParseMode(absl::GetFlag(FLAGS_dispatch));
  cfg.hole_fraction = 0.0;      // decode-shaped traffic: every token uses its top-k
  cfg.vary_num_tokens = false;  // every rank sends T tokens
  llep::LocalJobOptions job;
  job.num_ranks = cfg.shape.num_ranks;
  job.timeout = absl::Minutes(20);
  const absl::Status s = llep::RunLocalJobOk(job, [&](llep::Bootstrap& boot) { return llep::BenchRank(boot, cfg); });
  if (!s.ok()) {
    std::fprintf(stderr, "benchmark failed: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
