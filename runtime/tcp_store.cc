#include "runtime/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/base/log.h"
#include "runtime/base/status_macros.h"

namespace llep {
namespace {

constexpr uint8_t kOpSet = 1;
constexpr uint8_t kOpGet = 2;
constexpr size_t kHeaderBytes = 9;
constexpr uint32_t kMaxFieldBytes = 64u << 20;

absl::StatusOr<sockaddr_in> MakeAddr(const std::string& host, int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("not an IPv4 address: '", host, "'"));
  }
  return addr;
}

void PutU32(std::string* s, uint32_t v) { s->append(reinterpret_cast<const char*>(&v), 4); }
uint32_t GetU32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

bool SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    const ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

std::string Reply(uint8_t status, const std::string& value) {
  std::string r(1, static_cast<char>(status));
  PutU32(&r, static_cast<uint32_t>(value.size()));
  r += value;
  return r;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------- server

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Listen(const std::string& host, int port) {
  std::unique_ptr<TcpStoreServer> s(new TcpStoreServer());
  LLEP_ASSIGN_OR_RETURN(sockaddr_in addr, MakeAddr(host, port));
  s->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  LLEP_ERRNO_RETURN_IF_ERROR(s->listen_fd_, "socket");
  const int one = 1;
  setsockopt(s->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  LLEP_ERRNO_RETURN_IF_ERROR(bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
                             absl::StrCat("bind ", host, ":", port));
  LLEP_ERRNO_RETURN_IF_ERROR(listen(s->listen_fd_, 128), "listen");
  socklen_t len = sizeof(addr);
  LLEP_ERRNO_RETURN_IF_ERROR(getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len), "getsockname");
  s->port_ = ntohs(addr.sin_port);
  return s;
}

absl::Status TcpStoreServer::Start() {
  if (thread_.joinable()) return absl::FailedPreconditionError("store server already started");
  LLEP_ERRNO_RETURN_IF_ERROR(pipe2(wake_pipe_, O_CLOEXEC), "pipe2");
  thread_ = std::thread([this] { Serve(); });
  return absl::OkStatus();
}

TcpStoreServer::~TcpStoreServer() {
  if (thread_.joinable()) {
    const char c = 0;
    ssize_t ignored = write(wake_pipe_[1], &c, 1);
    (void)ignored;
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_pipe_[0], wake_pipe_[1]}) {
    if (fd >= 0) close(fd);
  }
}

void TcpStoreServer::Serve() {
  struct Conn {
    int fd;
    std::string in;
  };
  std::vector<Conn> conns;
  std::map<std::string, std::string> kv;
  std::multimap<std::string, int> waiting;  // key -> fd of a parked get
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_pipe_[0], POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const Conn& c : conns) fds.push_back({c.fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      LLEP_LOG(kError) << "tcp store poll failed: " << std::strerror(errno);
      return;
    }
    if (fds[0].revents != 0) break;  // stop requested
    if (fds[1].revents & POLLIN) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        const int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        conns.push_back({fd, {}});
      }
    }
    std::vector<int> dead;
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Conn& c = conns[i - 2];
      char buf[65536];
      const ssize_t n = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        dead.push_back(c.fd);
        continue;
      }
      c.in.append(buf, static_cast<size_t>(n));
      while (c.in.size() >= kHeaderBytes) {
        const uint8_t op = static_cast<uint8_t>(c.in[0]);
        const uint32_t klen = GetU32(c.in.data() + 1), vlen = GetU32(c.in.data() + 5);
        if (klen > kMaxFieldBytes || vlen > kMaxFieldBytes || (op != kOpSet && op != kOpGet)) {
          dead.push_back(c.fd);  // not a client of ours: drop it
          break;
        }
        if (c.in.size() < kHeaderBytes + klen + vlen) break;
        std::string key = c.in.substr(kHeaderBytes, klen);
        std::string value = c.in.substr(kHeaderBytes + klen, vlen);
        c.in.erase(0, kHeaderBytes + klen + vlen);
        if (op == kOpSet) {
          kv[key] = value;
          SendAll(c.fd, Reply(0, {}));
          auto range = waiting.equal_range(key);
          for (auto it = range.first; it != range.second; ++it) SendAll(it->second, Reply(0, value));
          waiting.erase(range.first, range.second);
        } else if (auto it = kv.find(key); it != kv.end()) {
          SendAll(c.fd, Reply(0, it->second));
        } else {
          waiting.emplace(std::move(key), c.fd);
        }
      }
    }
    for (int fd : dead) {
      close(fd);
      for (auto it = waiting.begin(); it != waiting.end();) it = it->second == fd ? waiting.erase(it) : std::next(it);
      for (size_t i = 0; i < conns.size(); ++i) {
        if (conns[i].fd == fd) {
          conns.erase(conns.begin() + static_cast<long>(i));
          break;
        }
      }
    }
  }
  for (const Conn& c : conns) close(c.fd);
}

// ---------------------------------------------------------------------------------------------------- client

absl::StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(const std::string& host, int port,
                                                                        absl::Duration timeout) {
  LLEP_ASSIGN_OR_RETURN(sockaddr_in addr, MakeAddr(host, port));
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    LLEP_ERRNO_RETURN_IF_ERROR(fd, "socket");
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return std::unique_ptr<TcpStoreClient>(new TcpStoreClient(fd));
    }
    const int err = errno;
    close(fd);
    if (absl::Now() >= deadline) {
      return base::Annotate(
          base::ErrnoToStatus(err == ECONNREFUSED ? ETIMEDOUT : err, "connect"),
          absl::StrCat("tcp store ", host, ":", port, " unreachable for ", absl::FormatDuration(timeout)));
    }
    usleep(10000);
  }
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) close(fd_);
}

absl::Status TcpStoreClient::Set(const std::string& key, const std::string& value) {
  std::string ignored;
  return Request(kOpSet, key, value, absl::Seconds(60), &ignored);
}

absl::StatusOr<std::string> TcpStoreClient::Get(const std::string& key, absl::Duration timeout) {
  std::string value;
  LLEP_RETURN_IF_ERROR(Request(kOpGet, key, {}, timeout, &value));
  return value;
}

absl::Status TcpStoreClient::Request(uint8_t op, const std::string& key, const std::string& value,
                                     absl::Duration timeout, std::string* reply) {
  if (broken_) return absl::FailedPreconditionError("tcp store connection unusable after an earlier failure");
  if (key.size() > kMaxFieldBytes || value.size() > kMaxFieldBytes) {
    return absl::InvalidArgumentError("tcp store key or value over 64 MiB");
  }
  std::string req(1, static_cast<char>(op));
  PutU32(&req, static_cast<uint32_t>(key.size()));
  PutU32(&req, static_cast<uint32_t>(value.size()));
  req += key;
  req += value;
  broken_ = true;  // until the full reply is read
  if (!SendAll(fd_, req)) return base::ErrnoToStatus(errno == 0 ? ECONNRESET : errno, "tcp store send");
  const absl::Time deadline = absl::Now() + timeout;
  std::string in;
  size_t want = 5;
  while (in.size() < want) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0)
      return absl::DeadlineExceededError(absl::StrCat("tcp store: key '", key, "' not available in time"));
    pollfd p{fd_, POLLIN, 0};
    const int rc = poll(&p, 1, static_cast<int>(left_ms < 1000 ? left_ms : 1000));
    if (rc < 0 && errno != EINTR) return base::ErrnoToStatus(errno, "tcp store poll");
    if (rc <= 0) continue;
    char buf[65536];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n == 0) return absl::UnavailableError("tcp store server closed the connection");
    if (n < 0) {
      if (errno == EINTR) continue;
      return base::ErrnoToStatus(errno, "tcp store recv");
    }
    in.append(buf, static_cast<size_t>(n));
    if (in.size() >= 5) want = 5 + GetU32(in.data() + 1);
  }
  if (in.size() != want) return absl::InternalError("tcp store: unexpected extra bytes in reply");
  broken_ = false;
  *reply = in.substr(5);
  return absl::OkStatus();
}

}  // namespace llep
