#include "proxy/batch.h"

#include <algorithm>

namespace llep::proxy {

using protocol::FifoCmdFields;
using protocol::FifoOpcode;

int GroupAndMerge(FifoCmdFields* cmds, int n) {
  std::stable_sort(cmds, cmds + n,
                   [](const FifoCmdFields& a, const FifoCmdFields& b) { return a.dst_rank < b.dst_rank; });
  int out = 0;
  for (int i = 0; i < n; ++i) {
    const FifoCmdFields& c = cmds[i];
    if (out > 0) {
      FifoCmdFields& prev = cmds[out - 1];
      if (c.opcode == FifoOpcode::kWrite && prev.opcode == FifoOpcode::kWrite && c.dst_rank == prev.dst_rank &&
          c.op == prev.op && c.half == prev.half && c.local_off == prev.local_off + prev.bytes &&
          c.remote_off == prev.remote_off + prev.bytes && prev.bytes + c.bytes <= protocol::kCmdMaxBytes) {
        prev.bytes += c.bytes;
        continue;
      }
    }
    cmds[out++] = c;
  }
  return out;
}

}  // namespace llep::proxy
