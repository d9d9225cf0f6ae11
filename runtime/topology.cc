#include "runtime/topology.h"

#include <unistd.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace llep {

const char* PeerPathName(PeerPath p) {
  switch (p) {
    case PeerPath::kSelf:
      return "self";
    case PeerPath::kNvlink:
      return "nvlink";
    case PeerPath::kProxy:
      return "proxy";
  }
  return "?";
}

absl::StatusOr<std::vector<std::vector<PeerPath>>> DecidePeerPaths(const std::vector<std::string>& host_ids,
                                                                   const std::vector<std::vector<bool>>& reach,
                                                                   int ranks_per_node) {
  const int R = static_cast<int>(host_ids.size());
  if (ranks_per_node < 0) return absl::InvalidArgumentError("ranks_per_node must be >= 0 (0 = by host)");
  if (static_cast<int>(reach.size()) != R) {
    return absl::InvalidArgumentError(absl::StrCat(reach.size(), " reachability rows for ", R, " ranks"));
  }
  for (const auto& row : reach) {
    if (static_cast<int>(row.size()) != R) return absl::InvalidArgumentError("reachability matrix is not square");
  }
  const auto same_node = [&](int a, int b) {
    if (host_ids[a] != host_ids[b]) return false;
    return ranks_per_node == 0 || a / ranks_per_node == b / ranks_per_node;
  };
  std::vector<std::vector<PeerPath>> paths(R, std::vector<PeerPath>(R, PeerPath::kProxy));
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < R; ++b) {
      if (a == b) {
        paths[a][b] = PeerPath::kSelf;
      } else if (same_node(a, b) && reach[a][b] && reach[b][a]) {
        paths[a][b] = PeerPath::kNvlink;
      }
    }
  }
  return paths;
}

bool AnyProxyPath(const std::vector<std::vector<PeerPath>>& paths) {
  for (const auto& row : paths) {
    for (PeerPath p : row) {
      if (p == PeerPath::kProxy) return true;
    }
  }
  return false;
}

std::string HostIdentity() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  return absl::StrCat(host, "/", absl::StripAsciiWhitespace(boot));
}

}  // namespace llep
