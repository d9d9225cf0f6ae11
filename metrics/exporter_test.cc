#include "metrics/exporter.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "runtime/protocol/metrics_layout.h"

namespace llep::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A counter block the test writes as a backend would (AddOpLatencies and the layout's words).
struct FakeBackend {
  protocol::MetricsLayout layout = protocol::ComputeMetricsLayout(4, 3, /*num_layers=*/3);
  absl::Mutex mu;
  std::vector<uint64_t> words = std::vector<uint64_t>(static_cast<size_t>(layout.num_words()), 0);
  int snapshots = 0;

  SnapshotFn Fn() {
    return [this](std::vector<uint64_t>* out) {
      absl::MutexLock lock(&mu);
      ++snapshots;
      *out = words;
      return absl::OkStatus();
    };
  }
  void Op(int op, uint64_t send_ns, uint64_t wait_ns, uint64_t total_ns) {
    absl::MutexLock lock(&mu);
    const uint64_t ns[protocol::kNumMetricPhases] = {send_ns, wait_ns, total_ns};
    protocol::AddOpLatencies(layout, op, ns, [&](int w, uint64_t v) { words[w] += v; });
  }
  void Add(int word, uint64_t v) {
    absl::MutexLock lock(&mu);
    words[word] += v;
  }
};

ExporterOptions NoHttp() {
  ExporterOptions o;
  o.port = -1;
  o.rank = 2;
  o.interval = absl::Hours(1);  // the test collects explicitly
  return o;
}

TEST(MetricsLayout, WordsAreDistinctAndBucketsCoverAllLatencies) {
  const protocol::MetricsLayout m = protocol::ComputeMetricsLayout(3, 5, /*num_layers=*/4);
  std::vector<int> seen(static_cast<size_t>(m.num_words()), 0);
  for (int op = 0; op < 2; ++op) {
    ++seen[m.ops(op)];
    ++seen[m.timeouts(op)];
    for (int ph = 0; ph < protocol::kNumMetricPhases; ++ph) {
      for (int b = 0; b < protocol::kLatencyBuckets; ++b) ++seen[m.latency_bucket(op, ph, b)];
      ++seen[m.latency_sum_ns(op, ph)];
    }
    for (int r = 0; r < 3; ++r) ++seen[m.recv_wait_ns(op, r)];
  }
  for (int r = 0; r < 3; ++r) ++seen[m.sent_selections(r)];
  for (int layer = 0; layer < 4; ++layer) {
    for (int le = 0; le < 5; ++le) ++seen[m.expert_recv_tokens(layer, le)];
  }
  for (int w = 0; w < m.num_words(); ++w) EXPECT_EQ(seen[w], 1) << "word " << w;

  EXPECT_EQ(protocol::LatencyBucket(0), 0);
  EXPECT_EQ(protocol::LatencyBucket(5000), 0);  // le is inclusive
  EXPECT_EQ(protocol::LatencyBucket(5001), 1);
  EXPECT_EQ(protocol::LatencyBucket(87'000), 8);  // (80, 100] us
  EXPECT_EQ(protocol::LatencyBucket(5'000'000), protocol::kLatencyBounds - 1);
  EXPECT_EQ(protocol::LatencyBucket(5'000'001), protocol::kLatencyBounds);  // +Inf
  for (int i = 1; i < protocol::kLatencyBounds; ++i)
    EXPECT_LT(protocol::LatencyBoundNs(i - 1), protocol::LatencyBoundNs(i));
}

TEST(Exporter, ExportsEveryCounterWithRankAndCallerLabels) {
  FakeBackend be;
  ExporterOptions o = NoHttp();
  o.labels = {{"model_name", "dsv3"}, {"engine", "sglang"}};
  o.buffer_bytes = 4096;
  auto e = Exporter::Create(be.layout, be.Fn(), o);
  ASSERT_TRUE(e.ok()) << e.status();
  const protocol::MetricsLayout& m = be.layout;
  be.Op(0, 20'000, 7'000, 90'000);  // dispatch: send in (10, 20] us, wait (5, 10], total (80, 100]
  be.Op(0, 20'000, 7'000, 90'000);
  be.Op(1, 4'000, 6'000'000, 6'100'000);  // combine: wait and total above the last bound
  be.Add(m.timeouts(1), 1);
  be.Add(m.recv_wait_ns(0, 3), 2'500'000'000);
  be.Add(m.sent_selections(1), 17);
  be.Add(m.expert_recv_tokens(0, 2), 41);
  ASSERT_TRUE((*e)->Collect().ok());
  const std::string t = (*e)->Text();
  // prometheus-cpp renders the constant labels first (sorted), then the series' own, then le.
  const std::string lab = R"(engine="sglang",model_name="dsv3",rank="2")";
  EXPECT_THAT(t, HasSubstr("# TYPE llep_ops_total counter"));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_ops_total{", lab, R"(,op="dispatch"} 2)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_ops_total{", lab, R"(,op="combine"} 1)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_timeouts_total{", lab, R"(,op="combine"} 1)")));
  EXPECT_THAT(t, HasSubstr("# TYPE llep_op_latency_seconds histogram"));
  // Cumulative buckets: both dispatch totals are <= 100 us, none <= 60 us.
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_op_latency_seconds_bucket{", lab,
                                        R"(,op="dispatch",phase="total",le="6e-05"} 0)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_op_latency_seconds_bucket{", lab,
                                        R"(,op="dispatch",phase="total",le="0.0001"} 2)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_op_latency_seconds_count{", lab, R"(,op="dispatch",phase="total"} 2)")));
  EXPECT_THAT(t,
              HasSubstr(absl::StrCat("llep_op_latency_seconds_sum{", lab, R"(,op="dispatch",phase="total"} 0.00018)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_op_latency_seconds_bucket{", lab,
                                        R"(,op="combine",phase="recv_wait",le="0.005"} 0)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_op_latency_seconds_bucket{", lab,
                                        R"(,op="combine",phase="recv_wait",le="+Inf"} 1)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_recv_wait_seconds_total{", lab, R"(,op="dispatch",src_rank="3"} 2.5)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_dispatch_tokens_total{", lab, R"(,dst_rank="1"} 17)")));
  // Global expert id = rank * E_loc + local expert = 2 * 3 + 2. Layer 0's series exist from the start, the
  // others only once their layer received something.
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_expert_recv_tokens_total{", lab,
                                        R"(,expert="8",layer="0",local_expert="2"} 41)")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_expert_recv_tokens_total{", lab,
                                        R"(,expert="6",layer="0",local_expert="0"} 0)")));
  EXPECT_THAT(t, Not(HasSubstr(R"(layer="1")")));
  EXPECT_THAT(t, Not(HasSubstr(R"(layer="2")")));
  EXPECT_THAT(t, HasSubstr(absl::StrCat("llep_buffer_bytes{", lab, R"(,kind="region"} 4096)")));

  // Increments since the last collection are added, not the totals again.
  be.Add(m.expert_recv_tokens(0, 2), 9);
  be.Add(m.expert_recv_tokens(2, 1), 4);  // layer 2 appears, its other experts at 0; layer 1 stays absent
  be.Op(0, 20'000, 7'000, 90'000);
  ASSERT_TRUE((*e)->Collect().ok());
  const std::string t2 = (*e)->Text();
  EXPECT_THAT(t2, HasSubstr(R"(expert="8",layer="0",local_expert="2"} 50)"));
  EXPECT_THAT(t2, HasSubstr(R"(expert="7",layer="2",local_expert="1"} 4)"));
  EXPECT_THAT(t2, HasSubstr(R"(expert="8",layer="2",local_expert="2"} 0)"));
  EXPECT_THAT(t2, Not(HasSubstr(R"(layer="1")")));
  EXPECT_THAT(t2, HasSubstr(absl::StrCat("llep_ops_total{", lab, R"(,op="dispatch"} 3)")));
  EXPECT_THAT(t2, HasSubstr(absl::StrCat("llep_op_latency_seconds_count{", lab, R"(,op="dispatch",phase="send"} 3)")));
}

TEST(Exporter, RejectsBadOptionsAndAnEmptyLayout) {
  FakeBackend be;
  ExporterOptions o = NoHttp();
  o.labels = {{"bad-name", "x"}};
  EXPECT_EQ(Exporter::Create(be.layout, be.Fn(), o).status().code(), absl::StatusCode::kInvalidArgument);
  o.labels = {{"rank", "7"}};
  EXPECT_EQ(Exporter::Create(be.layout, be.Fn(), o).status().code(), absl::StatusCode::kInvalidArgument);
  o = NoHttp();
  o.port = 70000;
  EXPECT_EQ(Exporter::Create(be.layout, be.Fn(), o).status().code(), absl::StatusCode::kInvalidArgument);
  o = NoHttp();
  EXPECT_EQ(Exporter::Create(protocol::MetricsLayout{}, be.Fn(), o).status().code(),
            absl::StatusCode::kFailedPrecondition);
  SnapshotFn failing = [](std::vector<uint64_t>*) { return absl::InternalError("device gone"); };
  auto e = Exporter::Create(be.layout, failing, o);
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("device gone"));
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

TEST(Exporter, ServesOnLoopbackAndTheThreadCollects) {
  FakeBackend be;
  ExporterOptions o;
  o.port = 0;  // ephemeral
  o.interval = absl::Milliseconds(20);
  auto e = Exporter::Create(be.layout, be.Fn(), o);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_GT((*e)->port(), 0);
  be.Add(be.layout.expert_recv_tokens(0, 1), 5);
  // The collector thread picks it up without an explicit Collect().
  std::string body;
  for (int i = 0; i < 200 && body.find("local_expert=\"1\"} 5") == std::string::npos; ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    body = HttpGet((*e)->port(), "/metrics");
  }
  EXPECT_THAT(body, HasSubstr("200 OK"));
  EXPECT_THAT(body, HasSubstr(R"(llep_expert_recv_tokens_total{rank="0",expert="1",layer="0",local_expert="1"} 5)"));
  EXPECT_TRUE((*e)->last_status().ok());

  // A second exporter on the same port is refused with a clear error.
  ExporterOptions taken = o;
  taken.port = (*e)->port();
  const auto again = Exporter::Create(be.layout, be.Fn(), taken);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  const int port = (*e)->port();
  e->reset();
  EXPECT_THAT(HttpGet(port, "/metrics"), Not(HasSubstr("llep_")));
}

TEST(Exporter, DecodeStepsFromTheEngine) {
  FakeBackend be;
  ExporterOptions o;
  o.port = -1;
  auto e = Exporter::Create(be.layout, be.Fn(), o);
  ASSERT_TRUE(e.ok()) << e.status();
  ASSERT_TRUE((*e)->ObserveDecodeStep(0.0007, 8).ok());  // bucket le=0.001
  ASSERT_TRUE((*e)->ObserveDecodeStep(0.012, 32).ok());  // bucket le=0.015
  const std::string text = (*e)->Text();
  EXPECT_THAT(text, HasSubstr(R"(llep_decode_step_seconds_count{rank="0"} 2)"));
  EXPECT_THAT(text, HasSubstr(R"(llep_decode_step_seconds_bucket{rank="0",le="0.0005"} 0)"));
  EXPECT_THAT(text, HasSubstr(R"(llep_decode_step_seconds_bucket{rank="0",le="0.001"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(llep_decode_step_seconds_bucket{rank="0",le="0.01"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(llep_decode_step_seconds_bucket{rank="0",le="0.015"} 2)"));
  EXPECT_THAT(text, HasSubstr(R"(llep_decode_tokens_total{rank="0"} 40)"));
  for (const auto& [seconds, tokens] : {std::pair{-1.0, int64_t{1}}, std::pair{std::nan(""), int64_t{1}},
                                        std::pair{1.0 / 0.0, int64_t{1}}, std::pair{0.1, int64_t{-1}}}) {
    EXPECT_EQ((*e)->ObserveDecodeStep(seconds, tokens).code(), absl::StatusCode::kInvalidArgument) << seconds;
  }
  EXPECT_THAT((*e)->Text(), HasSubstr(R"(llep_decode_step_seconds_count{rank="0"} 2)"));  // refused: not counted
}

}  // namespace
}  // namespace llep::metrics
