// Failures become errors, never hangs or corruption: a stalled peer gives DeadlineExceeded naming it within the
// configured timeout, a dead peer gives an error as promptly, a combine whose routing differs from its dispatch
// is refused, and bad calls on a single-rank buffer are rejected before anything is sent.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "runtime/base/status_macros.h"
#include "runtime/cpu_buffer.h"
#include "runtime/protocol/ll_layout.h"
#include "tests/harness/local_job.h"
#include "tests/harness/workload.h"

namespace llep {
namespace {

using ::testing::HasSubstr;

selftest::WorkloadConfig SmallConfig() {
  selftest::WorkloadConfig c;
  c.shape = {8, 256, 16, 4};
  c.num_topk = 4;
  c.mode = {true, false, false};
  c.vary_num_tokens = false;
  return c;
}

struct Rank {
  selftest::RankInputs in;
  selftest::DispatchOutputs d;
  DispatchCall Call(const selftest::WorkloadConfig& cfg) { return selftest::MakeDispatchCall(cfg, in, d); }
};

absl::Status Expect(bool cond, const std::string& what) { return cond ? absl::OkStatus() : absl::InternalError(what); }

TEST(FaultTest, StalledPeerTimesOutWithItsRankNamed) {
  const selftest::WorkloadConfig cfg = SmallConfig();
  const absl::Status s = RunLocalJobOk({4, absl::Minutes(2)}, [&](Bootstrap& boot) -> absl::Status {
    CpuBufferOptions opt;
    opt.timeout = absl::Seconds(2);
    LLEP_ASSIGN_OR_RETURN(auto buf, CpuBuffer::Create(cfg.shape, boot, opt));
    if (buf->rank() == 3) {
      absl::SleepFor(absl::Seconds(6));  // alive but never dispatches
      return buf->Close();
    }
    Rank r;
    r.in = selftest::MakeInputs(cfg, buf->rank(), 0);
    r.d.Allocate(cfg);
    const auto start = std::chrono::steady_clock::now();
    LLEP_ASSIGN_OR_RETURN(PendingOp op, buf->DispatchSend(r.Call(cfg)));
    const absl::Status recv = buf->Receive(std::move(op));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    LLEP_RETURN_IF_ERROR(
        Expect(recv.code() == absl::StatusCode::kDeadlineExceeded, absl::StrCat("got ", recv.ToString())));
    LLEP_RETURN_IF_ERROR(Expect(std::string(recv.message()).find("rank(s) 3 ") != std::string::npos, recv.ToString()));
    LLEP_RETURN_IF_ERROR(Expect(secs >= 1.9 && secs < 5.0, absl::StrCat("timeout took ", secs, " s")));
    return buf->Close();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(FaultTest, DeadPeerIsAnErrorNotAHang) {
  const selftest::WorkloadConfig cfg = SmallConfig();
  for (const char* provider : {"shm", "tcp;ofi_rxm"}) {
    const absl::Status s = RunLocalJobOk({4, absl::Minutes(2)}, [&](Bootstrap& boot) -> absl::Status {
      CpuBufferOptions opt;
      opt.provider = provider;
      opt.timeout = absl::Seconds(2);
      LLEP_ASSIGN_OR_RETURN(auto buf, CpuBuffer::Create(cfg.shape, boot, opt));
      if (buf->rank() == 3) _exit(0);  // dies without a word
      Rank r;
      r.in = selftest::MakeInputs(cfg, buf->rank(), 0);
      r.d.Allocate(cfg);
      const auto start = std::chrono::steady_clock::now();
      absl::Status err;
      auto op = buf->DispatchSend(r.Call(cfg));
      err = op.ok() ? buf->Receive(*std::move(op)) : op.status();
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      LLEP_RETURN_IF_ERROR(Expect(!err.ok(), "receive succeeded although rank 3 is dead"));
      LLEP_RETURN_IF_ERROR(
          Expect(err.code() == absl::StatusCode::kDeadlineExceeded || err.code() == absl::StatusCode::kUnavailable,
                 err.ToString()));
      LLEP_RETURN_IF_ERROR(Expect(secs < 5.0, absl::StrCat(provider, ": error took ", secs, " s")));
      // Tearing the buffer down must not hang either: a proxy thread may be wedged inside libfabric's shm write to
      // the dead rank (it spins on a lock the dead process held); it is abandoned after the proxy's stall timeout.
      const auto teardown = std::chrono::steady_clock::now();
      buf.reset();
      const double down = std::chrono::duration<double>(std::chrono::steady_clock::now() - teardown).count();
      return Expect(down < 5.0, absl::StrCat(provider, ": teardown took ", down, " s"));
    });
    EXPECT_TRUE(s.ok()) << provider << ": " << s;
  }
}

TEST(FaultTest, CombineWithDifferentRoutingIsRefused) {
  const selftest::WorkloadConfig cfg = SmallConfig();
  const absl::Status s = RunLocalJobOk({4, absl::Minutes(2)}, [&](Bootstrap& boot) -> absl::Status {
    LLEP_ASSIGN_OR_RETURN(auto buf, CpuBuffer::Create(cfg.shape, boot, CpuBufferOptions{}));
    Rank r;
    r.in = selftest::MakeInputs(cfg, buf->rank(), 0);
    r.d.Allocate(cfg);
    LLEP_ASSIGN_OR_RETURN(PendingOp d, buf->DispatchSend(r.Call(cfg)));
    LLEP_RETURN_IF_ERROR(buf->Receive(std::move(d)));
    std::vector<uint16_t> y(cfg.shape.num_local_experts() * cfg.shape.max_recv_rows() * cfg.shape.hidden);
    std::vector<uint16_t> out(r.in.num_tokens * cfg.shape.hidden);
    std::vector<int64_t> topk = r.in.topk_idx;
    if (buf->rank() == 0) {
      for (auto& id : topk) id = id >= 0 ? -1 : id;  // rank 0 forgets its routing
    }
    CombineCall c;
    c.x = y.data();
    c.topk_idx = topk.data();
    c.topk_weights = r.in.topk_weights.data();
    c.num_tokens = r.in.num_tokens;
    c.num_topk = cfg.num_topk;
    c.layout_range = r.d.layout_range.data();
    c.out = out.data();
    LLEP_ASSIGN_OR_RETURN(PendingOp op, buf->CombineSend(c));
    const absl::Status recv = buf->Receive(std::move(op));
    if (buf->rank() == 0) {
      LLEP_RETURN_IF_ERROR(Expect(recv.code() == absl::StatusCode::kInvalidArgument, recv.ToString()));
      LLEP_RETURN_IF_ERROR(Expect(
          std::string(recv.message()).find("topk_idx of the matching dispatch") != std::string::npos, recv.ToString()));
    } else {
      LLEP_RETURN_IF_ERROR(recv);
    }
    return buf->Close();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(FaultTest, BadCallsAreRejectedBeforeSending) {
  auto boot = MakeCallbackBootstrap(
      0, 1, [](const std::string& b) { return absl::StatusOr<std::vector<std::string>>(std::vector<std::string>{b}); });
  selftest::WorkloadConfig cfg = SmallConfig();
  cfg.shape = {4, 256, 8, 1};
  auto buf = CpuBuffer::Create(cfg.shape, *boot, CpuBufferOptions{});
  ASSERT_TRUE(buf.ok()) << buf.status();
  Rank r;
  r.in = selftest::MakeInputs(cfg, 0, 0);
  r.d.Allocate(cfg);
  DispatchCall call = r.Call(cfg);
  std::vector<int64_t> bad = r.in.topk_idx;
  bad[1] = 8;
  call.topk_idx = bad.data();
  EXPECT_EQ((*buf)->DispatchSend(call).status().code(), absl::StatusCode::kInvalidArgument);
  call = r.Call(cfg);
  call.num_tokens = 5;
  EXPECT_THAT(std::string((*buf)->DispatchSend(call).status().message()), HasSubstr("num_tokens (5)"));
  call = r.Call(cfg);
  call.mode = {true, false, true};
  EXPECT_THAT(std::string((*buf)->DispatchSend(call).status().message()), HasSubstr("use_ue8m0 requires round_scale"));
  call = r.Call(cfg);
  call.recv_scales = nullptr;
  EXPECT_EQ((*buf)->DispatchSend(call).status().code(), absl::StatusCode::kInvalidArgument);
  // In-flight rule: a third send onto the half of an unreceived call is refused.
  auto d1 = (*buf)->DispatchSend(r.Call(cfg));
  auto d2 = (*buf)->DispatchSend(r.Call(cfg));
  ASSERT_TRUE(d1.ok() && d2.ok());
  auto d3 = (*buf)->DispatchSend(r.Call(cfg));
  EXPECT_EQ(d3.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d3.status().message()), HasSubstr("at most two low-latency operations"));
  ASSERT_TRUE((*buf)->Receive(*std::move(d1)).ok());
  ASSERT_TRUE((*buf)->Receive(*std::move(d2)).ok());
  EXPECT_TRUE(selftest::CheckDispatch(cfg, 0, 0, r.d).ok());
  // A garbage handle is refused instead of steering writes out of bounds.
  std::vector<int64_t> lr(cfg.shape.num_local_experts(), protocol::PackLayoutRange(3, 2));
  std::vector<uint16_t> y(8 * 4 * 256), out(4 * 256);
  CombineCall c;
  c.x = y.data();
  c.topk_idx = r.in.topk_idx.data();
  c.topk_weights = r.in.topk_weights.data();
  c.num_tokens = r.in.num_tokens;
  c.num_topk = cfg.num_topk;
  c.layout_range = lr.data();
  c.out = out.data();
  EXPECT_EQ((*buf)->CombineSend(c).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*buf)->Close().ok());
  EXPECT_EQ((*buf)->DispatchSend(r.Call(cfg)).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace llep
