// The daemon's Unix stream sockets: the lock that lets one daemon own a socket path, and a
// listener whose socket file gets the configured mode and group before it accepts anything (its
// accept loop: accept_loop.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "accept_loop.h"
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
  uint64_t accept_errors() const { return loop_ ? loop_->accept_errors() : 0; }

 private:
  boost::asio::io_context& io_;
  std::string name_, path_;
  std::unique_ptr<AcceptLoop> loop_;  // from Listen
  bool bound_ = false;                // the socket file is this listener's to remove
};

}  // namespace specache::daemon
