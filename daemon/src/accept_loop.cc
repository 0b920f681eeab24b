#include "accept_loop.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

#include "log_rate.h"
#include "specache/remote_protocol.h"

namespace specache::daemon {
namespace {

constexpr auto kFirstBackoff = std::chrono::milliseconds(10);
constexpr auto kMaxBackoff = std::chrono::milliseconds(1000);
constexpr int kAcceptsPerWakeup = 64;  // then other handlers on the io thread get their turn

std::string Errno() { return std::strerror(errno); }

}  // namespace

AcceptLoop::AcceptLoop(boost::asio::io_context& io, std::string name, int listening_fd)
    : name_(std::move(name)), fd_(listening_fd), listening_(io, listening_fd), retry_(io) {
  boost::system::error_code ec;
  listening_.non_blocking(true, ec);  // accept4 below must not block the io thread
  if (ec) spdlog::warn("{} socket: cannot make it non-blocking: {}", name_, ec.message());
}

AcceptLoop::~AcceptLoop() { Stop(); }

void AcceptLoop::Start(std::function<void(int)> on_accept) {
  on_accept_ = std::move(on_accept);
  Wait();
}

void AcceptLoop::Wait() {
  listening_.async_wait(boost::asio::posix::stream_descriptor::wait_read, [this](boost::system::error_code ec) {
    if (ec || stopped_) return;
    AcceptReady();
  });
}

void AcceptLoop::AcceptReady() {
  for (int i = 0; i < kAcceptsPerWakeup; ++i) {
    const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      backoff_ = std::chrono::milliseconds(0);
      on_accept_(fd);
      continue;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
    // Out of descriptors or memory: the connection stays queued. Waiting (10 ms, doubling to
    // 1 s) lets sessions end and descriptors come back; retrying at once would spin a core.
    const uint64_t errors = ++accept_errors_;
    backoff_ = std::min<std::chrono::milliseconds>(backoff_.count() ? backoff_ * 2 : kFirstBackoff, kMaxBackoff);
    if (LoggedOccurrence(errors)) {  // an accept storm does not flood the log
      spdlog::warn("{} socket: accept failed: {}; retrying in {} ms ({} accept errors so far)", name_, Errno(),
                   backoff_.count(), errors);
    }
    retry_.expires_after(backoff_);
    retry_.async_wait([this](boost::system::error_code ec) {
      if (!ec && !stopped_) AcceptReady();
    });
    return;
  }
  Wait();
}

void AcceptLoop::Stop() {
  if (stopped_) return;
  stopped_ = true;
  retry_.cancel();
  boost::system::error_code ec;
  listening_.close(ec);
}

Result<TcpListening> ListenTcp(const std::string& host_port, int backlog, const std::string& what) {
  SPECACHE_ASSIGN_OR_RETURN(const remote::SocketAddress address, remote::ResolveAddress(host_port));
  const int fd = ::socket(address.get()->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::Unavailable(what + " " + host_port + ": socket: " + Errno());
  const int on = 1;
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      ::bind(fd, address.get(), address.length) != 0 || ::listen(fd, backlog) != 0) {
    const std::string why = Errno();
    ::close(fd);
    return Status::Unavailable("cannot listen on " + what + " " + host_port + ": " + why);
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    const std::string why = Errno();
    ::close(fd);
    return Status::Unavailable(what + " " + host_port + ": getsockname: " + why);
  }
  const uint16_t port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                                                    : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  return TcpListening{fd, port};
}

std::string PeerAddress(int fd) {
  sockaddr_storage peer{};
  socklen_t length = sizeof peer;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) return {};
  char text[INET6_ADDRSTRLEN] = {};
  if (peer.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&peer);
    return ::inet_ntop(AF_INET, &v4->sin_addr, text, sizeof text) ? text : std::string();
  }
  if (peer.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&peer);
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {  // an IPv4 client of a dual-stack socket: counted as itself
      return ::inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], text, sizeof text) ? text : std::string();
    }
    return ::inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof text) ? text : std::string();
  }
  return {};
}

}  // namespace specache::daemon
