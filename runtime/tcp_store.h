// A tiny TCP key-value store for bootstrap (loopback by default): Set(key, value) and a blocking Get(key) that
// waits until the key exists. Layer: runtime. The server runs one poll() thread; clients are used by one thread.
// Wire format (both directions little-endian): request [u8 op][u32 key_len][u32 value_len][key][value],
// response [u8 status][u32 value_len][value]. op 1 = set, 2 = get (the reply is sent once the key exists).
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace llep {

class TcpStoreServer {
 public:
  /// Binds and listens on host:port (port 0 = ephemeral) without starting a thread, so a launcher can fork
  /// after this call. Call Start() to serve.
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Listen(const std::string& host, int port);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }
  /// The listening descriptor (forked children close it).
  int listen_fd() const { return listen_fd_; }
  absl::Status Start();

 private:
  TcpStoreServer() = default;
  void Serve();

  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  int port_ = 0;
  std::thread thread_;
};

class TcpStoreClient {
 public:
  /// Connects, retrying until `timeout` (the server may start after the client).
  static absl::StatusOr<std::unique_ptr<TcpStoreClient>> Connect(const std::string& host, int port,
                                                                 absl::Duration timeout);
  ~TcpStoreClient();
  TcpStoreClient(const TcpStoreClient&) = delete;
  TcpStoreClient& operator=(const TcpStoreClient&) = delete;

  absl::Status Set(const std::string& key, const std::string& value);
  /// Waits up to `timeout` for the key; DeadlineExceeded after that (the connection is then unusable).
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout);

 private:
  explicit TcpStoreClient(int fd) : fd_(fd) {}
  absl::Status Request(uint8_t op, const std::string& key, const std::string& value, absl::Duration timeout,
                       std::string* reply);

  int fd_ = -1;
  bool broken_ = false;
};

}  // namespace llep
