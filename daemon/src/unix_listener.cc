#include "unix_listener.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "specache/trusted_directory.h"

namespace specache::daemon {
namespace {

std::string Errno() { return std::strerror(errno); }

}  // namespace

Result<std::unique_ptr<PathLock>> PathLock::Acquire(const std::string& path) {
  const std::string lock_path = path + ".lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return Status::Unavailable("lock file " + lock_path + ": " + Errno());
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const std::string why = Errno();
    char holder[32] = {};
    const ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
    ::close(fd);
    std::string pid(holder, n > 0 ? static_cast<size_t>(n) : 0);
    pid.erase(std::remove_if(pid.begin(), pid.end(), [](char c) { return c < '0' || c > '9'; }), pid.end());
    return Status::FailedPrecondition("another specached" + (pid.empty() ? std::string() : " (pid " + pid + ")") +
                                      " serves " + path + " (it holds " + lock_path + ": " + why +
                                      "); stop it first or choose another socket");
  }
  // The holder's pid, for the next daemon's message.
  const std::string pid = std::to_string(getpid()) + "\n";
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    spdlog::warn("lock file {}: cannot record the pid: {}", lock_path, Errno());
  }
  return std::unique_ptr<PathLock>(new PathLock(fd));
}

PathLock::~PathLock() { ::close(fd_); }  // releases the lock; the file stays for the next daemon

Status EnsureSocketDirectory(const std::string& socket_path) {
  const std::filesystem::path dir = std::filesystem::path(socket_path).parent_path();
  if (dir.empty()) return Status::Ok();
  // Each missing component's mode is the daemon's choice, not the umask's: writable by the
  // daemon alone, searchable by the clients the sockets' own mode admits (a parent left writable
  // by others would let anyone put another directory, and another daemon's socket, in its place).
  std::filesystem::path at;
  for (const std::filesystem::path& part : dir) {
    at /= part;
    if (::mkdir(at.c_str(), 0755) == 0) {
      if (::chmod(at.c_str(), 0755) != 0) {
        return Status::Unavailable("socket directory " + dir.string() + ": chmod " + at.string() + ": " + Errno());
      }
    } else if (errno != EEXIST) {
      return Status::Unavailable("socket directory " + dir.string() + " cannot be created: " + at.string() + ": " +
                                 Errno());
    }
  }
  return CheckTrustedDirectory(dir, "socket directory");
}

UnixListener::UnixListener(boost::asio::io_context& io, std::string name) : io_(io), name_(std::move(name)) {}

Status UnixListener::Listen(const SocketFile& file, int backlog) {
  path_ = file.path;
  ::unlink(path_.c_str());
  boost::system::error_code ec;
  boost::asio::local::stream_protocol::acceptor acceptor(io_);
  acceptor.open(boost::asio::local::stream_protocol(), ec);
  if (!ec) acceptor.bind(boost::asio::local::stream_protocol::endpoint(path_), ec);
  if (ec) return Status::Unavailable(name_ + " socket " + path_ + ": " + ec.message());
  bound_ = true;
  // Mode and group before listen(): until then every connect() is refused, so nobody connects
  // through the mode bind() left.
  // No chown when the file already has the group (the daemon's own group, as under the shipped
  // unit, whose system call filter refuses chown).
  struct stat st {};
  const bool has_group = file.gid && ::stat(path_.c_str(), &st) == 0 && st.st_gid == *file.gid;
  if (file.gid && !has_group && ::chown(path_.c_str(), static_cast<uid_t>(-1), *file.gid) != 0) {
    const std::string why = name_ + " socket " + path_ + ": chown to group " + std::to_string(*file.gid) + ": " + Errno();
    if (file.gid_required) return Status::PermissionDenied(why);
    spdlog::warn("{} (the socket keeps the daemon's group)", why);
  }
  if (::chmod(path_.c_str(), file.mode) != 0) {
    return Status::Unavailable(name_ + " socket " + path_ + ": chmod: " + Errno());
  }
  acceptor.listen(backlog, ec);
  if (ec) return Status::Unavailable(name_ + " socket " + path_ + ": " + ec.message());
  const int fd = acceptor.release(ec);  // the loop's from here
  if (ec) return Status::Unavailable(name_ + " socket " + path_ + ": " + ec.message());
  SPECACHE_ASSIGN_OR_RETURN(loop_, AcceptLoop::Create(io_, name_, fd));
  return Status::Ok();
}

void UnixListener::Start(std::function<void(int)> on_accept) { loop_->Start(std::move(on_accept)); }

void UnixListener::Stop() {
  if (loop_) loop_->Stop();
  if (bound_) ::unlink(path_.c_str());
  bound_ = false;
}

}  // namespace specache::daemon
