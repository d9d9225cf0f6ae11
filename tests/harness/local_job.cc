#include "tests/harness/local_job.h"

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "runtime/base/log.h"
#include "runtime/base/status_macros.h"
#include "runtime/tcp_store.h"

namespace llep {
namespace {

[[noreturn]] void ChildMain(int rank, int size, int port, int listen_fd, const RankMain& main) {
  close(listen_fd);
  absl::Status s = [&]() -> absl::Status {
    LLEP_ASSIGN_OR_RETURN(auto client, TcpStoreClient::Connect("127.0.0.1", port, absl::Seconds(30)));
    auto bootstrap = MakeStoreBootstrap(rank, size, std::move(client), "llep", absl::Seconds(120));
    return main(*bootstrap);
  }();
  if (!s.ok()) LLEP_LOG(kError) << "rank " << rank << " failed: " << s;
  // _exit: the child must not run the parent's atexit handlers or static destructors (gtest, stdio buffers).
  _exit(s.ok() ? 0 : 1);
}

}  // namespace

absl::StatusOr<std::vector<int>> RunLocalJob(const LocalJobOptions& options, const RankMain& main) {
  if (options.num_ranks < 1) return absl::InvalidArgumentError("num_ranks must be >= 1");
  LLEP_ASSIGN_OR_RETURN(auto server, TcpStoreServer::Listen("127.0.0.1", 0));
  std::vector<pid_t> pids(options.num_ranks, -1);
  std::vector<int> codes(options.num_ranks, 0);
  for (int r = 0; r < options.num_ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      const int err = errno;
      for (int i = 0; i < r; ++i) kill(pids[i], SIGKILL);
      for (int i = 0; i < r; ++i) waitpid(pids[i], nullptr, 0);
      return base::ErrnoToStatus(err, "fork");
    }
    if (pid == 0) ChildMain(r, options.num_ranks, server->port(), server->listen_fd(), main);
    pids[r] = pid;
  }
  // Threads only after every fork: a child forked while a thread holds a lock could deadlock.
  LLEP_RETURN_IF_ERROR(server->Start());

  const absl::Time deadline = absl::Now() + options.timeout;
  absl::Time kill_at = deadline;
  int alive = options.num_ranks;
  while (alive > 0) {
    int wstatus = 0;
    const pid_t pid = waitpid(-1, &wstatus, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < options.num_ranks; ++r) {
        if (pids[r] != pid) continue;
        codes[r] = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -WTERMSIG(wstatus);
        pids[r] = -1;
        --alive;
        if (codes[r] != 0) kill_at = std::min(kill_at, absl::Now() + options.grace_after_failure);
      }
      continue;
    }
    if (absl::Now() >= kill_at) {
      for (int r = 0; r < options.num_ranks; ++r) {
        if (pids[r] > 0) {
          LLEP_LOG(kError) << "killing rank " << r << " (pid " << pids[r] << "): job deadline or a failed peer";
          kill(pids[r], SIGKILL);
        }
      }
      kill_at = absl::InfiniteFuture();
    }
    usleep(2000);
  }
  return codes;
}

absl::Status RunLocalJobOk(const LocalJobOptions& options, const RankMain& main) {
  LLEP_ASSIGN_OR_RETURN(std::vector<int> codes, RunLocalJob(options, main));
  for (size_t r = 0; r < codes.size(); ++r) {
    if (codes[r] != 0) return absl::InternalError(absl::StrCat("rank ", r, " exited with ", codes[r]));
  }
  return absl::OkStatus();
}

}  // namespace llep
