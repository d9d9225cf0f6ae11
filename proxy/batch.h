// How a proxy thread shapes one popped batch of commands before posting: group by destination (stable, so each
// destination's commands keep their order, which the per-(op, half, destination) write count relies on) and
// merge adjacent writes that are contiguous on both sides into one RDMA write. Layer: proxy. Pure function.
#pragma once

#include "runtime/protocol/fifo_cmd.h"

namespace llep::proxy {

/// Reorders and merges cmds[0, n) in place; returns the new count.
int GroupAndMerge(protocol::FifoCmdFields* cmds, int n);

}  // namespace llep::proxy
