// Runs N rank processes on this host, each with a TCP-store bootstrap on loopback: how the CPU benchmark, the multi-
// process tests and any C++ program start a single-host job without MPI or Python. Layer: tests/harness (llep::testing,
// not part of llep). Call from a process that has started no threads yet (it forks); the parent serves the store while
// the children run and returns once all exited, killing them all at the deadline.
#pragma once

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runtime/bootstrap.h"

namespace llep {

struct LocalJobOptions {
  int num_ranks = 4;
  absl::Duration timeout = absl::Minutes(5);  ///< whole job; stragglers are SIGKILLed
  /// After the first rank fails, how long the others get to notice (their own timeouts) before being killed.
  absl::Duration grace_after_failure = absl::Seconds(20);
};

/// What each rank runs. Its Status decides the exit code (0 ok, 1 error, message on stderr).
using RankMain = std::function<absl::Status(Bootstrap& bootstrap)>;

/// Runs the job; returns each rank's exit code (-signal when killed), or an error if the job could not start.
absl::StatusOr<std::vector<int>> RunLocalJob(const LocalJobOptions& options, const RankMain& main);

/// Runs the job and fails unless every rank exited 0.
absl::Status RunLocalJobOk(const LocalJobOptions& options, const RankMain& main);

}  // namespace llep
