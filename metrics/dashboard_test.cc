// Every metric a dashboard query or recording rule uses must be one the exporter produces: the Grafana dashboard
// and the Prometheus files under metrics/ are read as text, each PromQL expression's llep_ names are extracted and
// looked up in the families an Exporter actually renders.
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "metrics/exporter.h"

namespace llep::metrics {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Sample names the exporter renders (histograms as _bucket/_sum/_count), from a real Exporter.
std::set<std::string> ExportedSeriesNames() {
  const protocol::MetricsLayout layout = protocol::ComputeMetricsLayout(2, 2);
  ExporterOptions o;
  o.port = -1;
  auto e = Exporter::Create(
      layout,
      [&](std::vector<uint64_t>* out) {
        out->assign(static_cast<size_t>(layout.num_words()), 0);
        return absl::OkStatus();
      },
      o);
  EXPECT_TRUE(e.ok()) << e.status();
  std::set<std::string> names;
  if (!e.ok()) return names;
  std::istringstream text((*e)->Text());
  const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ])");
  for (std::string line; std::getline(text, line);) {
    std::smatch m;
    if (!line.empty() && line[0] != '#' && std::regex_search(line, m, sample)) names.insert(m[1]);
  }
  return names;
}

// The PromQL expressions of a Grafana dashboard ("expr": "...") with JSON string escapes undone.
std::vector<std::string> DashboardExpressions(const std::string& json) {
  std::vector<std::string> out;
  const std::regex expr(R"re("expr"\s*:\s*"((?:[^"\\]|\\.)*)")re");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), expr); it != std::sregex_iterator(); ++it) {
    std::string s = (*it)[1], u;
    for (size_t i = 0; i < s.size(); ++i) u += (s[i] == '\\' && i + 1 < s.size()) ? s[++i] : s[i];
    out.push_back(u);
  }
  return out;
}

std::vector<std::string> LlepNames(const std::string& promql) {
  std::vector<std::string> out;
  const std::regex name(R"(\bllep_[a-z_]+\b)");
  for (auto it = std::sregex_iterator(promql.begin(), promql.end(), name); it != std::sregex_iterator(); ++it) {
    out.push_back(it->str());
  }
  return out;
}

TEST(Dashboard, EveryQueryUsesOnlyExportedMetrics) {
  const std::set<std::string> exported = ExportedSeriesNames();
  ASSERT_TRUE(exported.count("llep_op_latency_seconds_bucket"));
  const std::string json = ReadFile(std::string(LLEP_METRICS_DIR) + "/grafana/llep_dashboard.json");
  ASSERT_FALSE(json.empty()) << "dashboard missing";
  const std::vector<std::string> exprs = DashboardExpressions(json);
  ASSERT_GE(exprs.size(), 6u);
  std::set<std::string> used;
  for (const std::string& e : exprs) {
    const std::vector<std::string> names = LlepNames(e);
    EXPECT_FALSE(names.empty()) << "query uses no llep metric: " << e;
    for (const std::string& n : names) {
      EXPECT_TRUE(exported.count(n)) << "dashboard query uses " << n << ", which llep does not export: " << e;
      used.insert(n);
    }
  }
  // The panels the issue asks for: latency percentiles, per-expert load, wait per source rank.
  EXPECT_TRUE(used.count("llep_op_latency_seconds_bucket"));
  EXPECT_TRUE(used.count("llep_expert_recv_tokens_total"));
  EXPECT_TRUE(used.count("llep_recv_wait_seconds_total"));
}

TEST(Dashboard, ScrapeConfigTargetsTheExporterPath) {
  const std::string cfg = ReadFile(std::string(LLEP_METRICS_DIR) + "/prometheus/prometheus.yml");
  ASSERT_FALSE(cfg.empty());
  EXPECT_NE(cfg.find("metrics_path: /metrics"), std::string::npos);
  EXPECT_NE(cfg.find("127.0.0.1:"), std::string::npos);
  const std::string rules = ReadFile(std::string(LLEP_METRICS_DIR) + "/prometheus/llep_rules.yml");
  const std::set<std::string> exported = ExportedSeriesNames();
  const std::regex expr(R"(expr:\s*(.+))");
  int n = 0;
  for (auto it = std::sregex_iterator(rules.begin(), rules.end(), expr); it != std::sregex_iterator(); ++it, ++n) {
    for (const std::string& name : LlepNames((*it)[1])) {
      EXPECT_TRUE(exported.count(name)) << "rule uses " << name << ", which llep does not export";
    }
  }
  EXPECT_GE(n, 1);
}

}  // namespace
}  // namespace llep::metrics
