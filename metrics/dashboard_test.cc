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

// What a real Exporter renders: sample names (histograms as _bucket/_sum/_count) and, into *labels, every label
// name its series carry (the dashboards filter on model_name, a constant label the engine passes).
std::set<std::string> ExportedSeriesNames(std::set<std::string>* labels = nullptr) {
  const protocol::MetricsLayout layout = protocol::ComputeMetricsLayout(2, 2);
  ExporterOptions o;
  o.port = -1;
  o.labels = {{"model_name", "m"}};
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
  const std::regex label(R"(([a-zA-Z_][a-zA-Z0-9_]*)=")");
  for (std::string line; std::getline(text, line);) {
    std::smatch m;
    if (line.empty() || line[0] == '#' || !std::regex_search(line, m, sample)) continue;
    names.insert(m[1]);
    if (labels == nullptr) continue;
    for (auto it = std::sregex_iterator(line.begin(), line.end(), label); it != std::sregex_iterator(); ++it) {
      labels->insert((*it)[1]);
    }
  }
  return names;
}

// Label names a PromQL expression groups by (`by (a, b)`) or matches on (`{a=~"..."}`).
std::vector<std::string> LabelsUsed(const std::string& promql) {
  std::vector<std::string> out;
  const std::regex by(R"(\b(?:by|without)\s*\(([^)]*)\))"), matcher(R"(\{([^}]*)\})");
  const std::regex name(R"(([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)?)");
  for (const std::regex* re : {&by, &matcher}) {
    for (auto it = std::sregex_iterator(promql.begin(), promql.end(), *re); it != std::sregex_iterator(); ++it) {
      const std::string inner = (*it)[1];
      // In a matcher only the names before an operator count (values are quoted strings, skipped here).
      std::string unquoted;
      bool quoted = false;
      for (char ch : inner) {
        if (ch == '"')
          quoted = !quoted;
        else if (!quoted)
          unquoted += ch;
      }
      for (auto n = std::sregex_iterator(unquoted.begin(), unquoted.end(), name); n != std::sregex_iterator(); ++n) {
        out.push_back((*n)[1]);
      }
    }
  }
  return out;
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
  std::set<std::string> labels;
  const std::set<std::string> exported = ExportedSeriesNames(&labels);
  ASSERT_TRUE(labels.count("layer")) << "the per-layer expert series carry a layer label";
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
    for (const std::string& l : LabelsUsed(e)) {
      EXPECT_TRUE(labels.count(l)) << "dashboard query uses label " << l << ", which no llep series has: " << e;
    }
  }
  // The per-layer panels: a layer x expert matrix of load and an imbalance ratio per layer.
  bool matrix = false, imbalance = false;
  for (const std::string& e : exprs) {
    matrix |= e.find("sum by (layer, expert)") != std::string::npos && e.find("max by (layer)") == std::string::npos;
    imbalance |= e.find("max by (layer)") != std::string::npos && e.find("avg by (layer)") != std::string::npos;
  }
  EXPECT_TRUE(matrix) << "no layer x expert load query";
  EXPECT_TRUE(imbalance) << "no per-layer imbalance query";
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
