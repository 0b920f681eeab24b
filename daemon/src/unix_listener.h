// The daemon's Unix stream sockets: the lock that lets one daemon own a socket path, and a
// listener whose socket file gets the configured mode and group before it accepts anything, and
// whose accept loop backs off on resource errors (EMFILE, ENFILE, ENOBUFS, ENOMEM) instead of
// spinning on them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <utility>  // Boost 1.74 asio/awaitable.hpp uses std::exchange without it (C++20)

#include <boost/asio.hpp>

#include "specache/status.h"

namespace specache::daemon {

// An exclusive flock on "<path>.lock" (created 0600 beside the socket), held while the object lives.
class PathLock {
 public:
  // FAILED_PRECONDITION naming the holder's pid when another process holds the lock;
  // UNAVAILABLE when the lock file cannot be created.
  static Result<std::unique_ptr<PathLock>> Acquire(const std::string& path);
  ~PathLock();
  PathLock(const PathLock&) = delete;
  PathLock& operator=(const PathLock&) = delete;

 private:
  explicit PathLock(int fd) : fd_(fd) {}
  int fd_;
};

// Creates the socket's directory if missing (mode 0755, whatever the umask); UNAVAILABLE (never
// an exception) when it cannot. Then refuses a directory that someone other than the daemon's user
// or root could replace the sockets in: owned by another user (PERMISSION_DENIED), or writable by
// its group or others without the sticky bit (PERMISSION_DENIED; /tmp itself passes).
Status EnsureSocketDirectory(const std::string& socket_path);

struct SocketFile {
  std::string path;
  uint32_t mode = 0660;
  std::optional<uint32_t> gid;  // chown the file to this group
  bool gid_required = false;    // fail (not just warn) when the chown fails
};

class UnixListener {
 public:
  // `name` ("control", "attach") for log lines.
  UnixListener(boost::asio::io_context& io, std::string name);
  // Binds (replacing a stale file: the caller holds the path's lock), sets the mode and group,
  // then listens.
  Status Listen(const SocketFile& file, int backlog);
  // Calls on_accept(fd) on the io thread for each connection; the callee owns fd (CLOEXEC).
  void Start(std::function<void(int fd)> on_accept);
  // Stops accepting and removes the socket file.
  void Stop();
  uint64_t accept_errors() const { return accept_errors_.load(); }

 private:
  void Wait();
  void AcceptReady();

  boost::asio::io_context& io_;
  std::string name_, path_;
  std::unique_ptr<boost::asio::local::stream_protocol::acceptor> acceptor_;
  boost::asio::steady_timer retry_;
  std::function<void(int)> on_accept_;
  std::chrono::milliseconds backoff_{0};
  std::atomic<uint64_t> accept_errors_{0};
  bool stopped_ = false;
};

}  // namespace specache::daemon
