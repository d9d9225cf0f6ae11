// Multi-process end to end: 4 rank processes on loopback, CPU backend + proxy + libfabric (shm and
// tcp;ofi_rxm), >= 100 iterations per configuration. Every iteration's dispatch outputs (counts, layout ranges,
// src_info, FP8 bytes, scales) and combine outputs are compared bit for bit with a direct computation
// (runtime/selftest). Call patterns rotate so both buffer halves, double dispatches, two overlapped
// micro-batches (the receive-hook model) and zero-copy combine all occur.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/base/status_macros.h"
#include "runtime/cpu_buffer.h"
#include "tests/harness/local_job.h"
#include "tests/harness/workload.h"

namespace llep {
namespace {

using selftest::Routing;
using selftest::WorkloadConfig;

struct E2eCase {
  const char* name;
  WorkloadConfig cfg;
  int iterations;
  int proxy_threads;
};

WorkloadConfig Cfg(int T, int H, int E, protocol::DispatchMode mode, Routing routing, uint64_t seed) {
  WorkloadConfig c;
  c.shape = {T, H, E, 4};
  c.num_topk = 8;
  c.mode = mode;
  c.routing = routing;
  c.seed = seed;
  return c;
}

constexpr protocol::DispatchMode kFp8{true, false, false};
constexpr protocol::DispatchMode kFp8Round{true, true, false};
constexpr protocol::DispatchMode kUe8m0{true, true, true};
constexpr protocol::DispatchMode kBf16{false, false, false};

std::vector<E2eCase> Cases() {
  return {
      {"T1_H2048_fp8_random", Cfg(1, 2048, 32, kFp8, Routing::kRandom, 1), 120, 1},
      {"T7_H7168_bf16_random", Cfg(7, 7168, 32, kBf16, Routing::kRandom, 2), 100, 2},
      {"T7_H2048_fp8round_hot", Cfg(7, 2048, 16, kFp8Round, Routing::kHotExpert, 3), 100, 1},
      {"T128_H2048_ue8m0_random", Cfg(128, 2048, 64, kUe8m0, Routing::kRandom, 4), 100, 1},
      {"T128_H7168_fp8_hot", Cfg(128, 7168, 32, kFp8, Routing::kHotExpert, 5), 100, 1},
      {"T128_H7168_bf16_random", Cfg(128, 7168, 32, kBf16, Routing::kRandom, 6), 100, 1},
  };
}

// One micro-batch's state across the send and receive phases.
struct MicroBatch {
  uint64_t iteration = 0;
  selftest::RankInputs in;
  selftest::DispatchOutputs d;
  std::vector<uint16_t> expert_out;
  std::vector<uint16_t> combined;
};

absl::StatusOr<PendingOp> SendDispatch(CpuBuffer& buf, const WorkloadConfig& cfg, MicroBatch& mb) {
  mb.in = selftest::MakeInputs(cfg, buf.rank(), mb.iteration);
  mb.d.Allocate(cfg);
  return buf.DispatchSend(selftest::MakeDispatchCall(cfg, mb.in, mb.d));
}

absl::StatusOr<PendingOp> SendCombine(CpuBuffer& buf, const WorkloadConfig& cfg, MicroBatch& mb, bool zero_copy) {
  const int64_t E_loc = cfg.shape.num_local_experts(), rows = cfg.shape.max_recv_rows(), H = cfg.shape.hidden;
  CombineCall call;
  if (zero_copy) {
    // Experts write straight into the buffer's staging, at its row stride (DeepEP zero_copy=True).
    selftest::RunExperts(cfg, buf.rank(), mb.d, buf.NextCombineBuffer(), buf.combine_buffer_row_stride());
    call.zero_copy = true;
  } else {
    mb.expert_out.assign(static_cast<size_t>(E_loc * rows * H), 0);
    selftest::RunExperts(cfg, buf.rank(), mb.d, mb.expert_out.data(), H);
    call.x = mb.expert_out.data();
  }
  mb.combined.assign(static_cast<size_t>(mb.in.num_tokens) * H, 0xFFFF);  // poison: every element must be written
  call.topk_idx = mb.in.topk_idx.data();
  call.topk_weights = mb.in.topk_weights.data();
  call.num_tokens = mb.in.num_tokens;
  call.num_topk = cfg.num_topk;
  call.layout_range = mb.d.layout_range.data();
  call.out = mb.combined.data();
  return buf.CombineSend(call);
}

absl::Status RunIterations(Bootstrap& boot, const E2eCase& c, const std::string& provider) {
  CpuBufferOptions opt;
  opt.provider = provider;
  opt.num_proxy_threads = c.proxy_threads;
  opt.timeout = absl::Seconds(60);
  LLEP_ASSIGN_OR_RETURN(auto buf, CpuBuffer::Create(c.cfg.shape, boot, opt));
  const WorkloadConfig& cfg = c.cfg;
  const int me = buf->rank();
  for (int it = 0; it < c.iterations; ++it) {
    const int pattern = it % 4;
    if (pattern == 3) {
      // Two micro-batches overlapped: send A, send B, receive A, receive B, for dispatch and for combine.
      MicroBatch a, b;
      a.iteration = static_cast<uint64_t>(it);
      b.iteration = static_cast<uint64_t>(it) + 1000000;
      LLEP_ASSIGN_OR_RETURN(PendingOp da, SendDispatch(*buf, cfg, a));
      LLEP_ASSIGN_OR_RETURN(PendingOp db, SendDispatch(*buf, cfg, b));
      LLEP_RETURN_IF_ERROR(buf->Receive(std::move(da)));
      LLEP_RETURN_IF_ERROR(buf->Receive(std::move(db)));
      LLEP_RETURN_IF_ERROR(selftest::CheckDispatch(cfg, me, a.iteration, a.d));
      LLEP_RETURN_IF_ERROR(selftest::CheckDispatch(cfg, me, b.iteration, b.d));
      LLEP_ASSIGN_OR_RETURN(PendingOp ca, SendCombine(*buf, cfg, a, false));
      LLEP_ASSIGN_OR_RETURN(PendingOp cb, SendCombine(*buf, cfg, b, false));
      LLEP_RETURN_IF_ERROR(buf->Receive(std::move(ca)));
      LLEP_RETURN_IF_ERROR(buf->Receive(std::move(cb)));
      LLEP_RETURN_IF_ERROR(selftest::CheckCombine(cfg, me, a.iteration, a.combined.data()));
      LLEP_RETURN_IF_ERROR(selftest::CheckCombine(cfg, me, b.iteration, b.combined.data()));
      continue;
    }
    MicroBatch mb;
    mb.iteration = static_cast<uint64_t>(it);
    // Pattern 1 dispatches twice, which shifts the halves every later call lands on.
    for (int rep = 0; rep < (pattern == 1 ? 2 : 1); ++rep) {
      LLEP_ASSIGN_OR_RETURN(PendingOp d, SendDispatch(*buf, cfg, mb));
      LLEP_RETURN_IF_ERROR(buf->Receive(std::move(d)));
      LLEP_RETURN_IF_ERROR(selftest::CheckDispatch(cfg, me, mb.iteration, mb.d));
    }
    LLEP_ASSIGN_OR_RETURN(PendingOp cop, SendCombine(*buf, cfg, mb, /*zero_copy=*/pattern == 2));
    LLEP_RETURN_IF_ERROR(buf->Receive(std::move(cop)));
    LLEP_RETURN_IF_ERROR(selftest::CheckCombine(cfg, me, mb.iteration, mb.combined.data()));
  }
  const proxy::ProxyStats st = buf->proxy_stats();
  if (st.writes_posted == 0 || st.immediates == 0) return absl::InternalError("no traffic went through the proxy");
  if (me == 0) {
    std::printf(
        "[%s] %s over %s: %d iterations verified; rank 0 proxy: %llu commands -> %llu writes, %llu immediates\n",
        c.name, selftest::Describe(cfg).c_str(), buf->transport_name().c_str(), c.iterations,
        static_cast<unsigned long long>(st.commands), static_cast<unsigned long long>(st.writes_posted),
        static_cast<unsigned long long>(st.immediates));
    std::fflush(stdout);
  }
  return buf->Close();
}

class E2eTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(E2eTest, FourRanksMatchDirectComputation) {
  const std::string provider = std::get<0>(GetParam());
  const E2eCase c = Cases()[std::get<1>(GetParam())];
  LocalJobOptions job;
  job.num_ranks = 4;
  job.timeout = absl::Minutes(10);
  const absl::Status s = RunLocalJobOk(job, [&](Bootstrap& boot) { return RunIterations(boot, c, provider); });
  EXPECT_TRUE(s.ok()) << s;
}

INSTANTIATE_TEST_SUITE_P(Providers, E2eTest,
                         ::testing::Combine(::testing::Values("shm", "tcp;ofi_rxm"), ::testing::Range(0, 6)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param) == "shm" ? "shm" : "tcp_rxm", "_",
                                               Cases()[std::get<1>(info.param)].name);
                         });

}  // namespace
}  // namespace llep
