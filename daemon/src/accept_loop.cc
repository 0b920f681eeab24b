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

namespace {

bool IsWildcard(const std::string& host) { return host == "0.0.0.0" || host == "::" || host.empty(); }

// A socket of `family` bound to `address` and listening; -1 with errno set when it cannot be.
int BoundSocket(int family, const sockaddr* address, socklen_t length, bool dual_stack) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int on = 1, off = 0;
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      (dual_stack && ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) != 0) ||
      ::bind(fd, address, length) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}

}  // namespace

Result<TcpListening> ListenTcp(const std::string& host_port, const std::string& what) {
  SPECACHE_ASSIGN_OR_RETURN(const auto host_and_port, remote::SplitHostPort(host_port));
  TcpListening listening;
  int fd = -1;
  if (IsWildcard(host_and_port.first)) {
    sockaddr_in6 any6{};
    any6.sin6_family = AF_INET6;
    any6.sin6_addr = in6addr_any;
    any6.sin6_port = htons(host_and_port.second);
    fd = BoundSocket(AF_INET6, reinterpret_cast<const sockaddr*>(&any6), sizeof any6, /*dual_stack=*/true);
    listening.dual_stack = fd >= 0;
    if (fd < 0 && (errno == EAFNOSUPPORT || errno == EADDRNOTAVAIL)) {  // no IPv6 on this host: IPv4 alone
      sockaddr_in any4{};
      any4.sin_family = AF_INET;
      any4.sin_addr.s_addr = htonl(INADDR_ANY);
      any4.sin_port = htons(host_and_port.second);
      fd = BoundSocket(AF_INET, reinterpret_cast<const sockaddr*>(&any4), sizeof any4, false);
    }
  } else {
    SPECACHE_ASSIGN_OR_RETURN(const remote::SocketAddress address, remote::ResolveAddress(host_port));
    fd = BoundSocket(address.get()->sa_family, address.get(), address.length, false);
  }
  if (fd < 0) return Status::Unavailable("cannot listen on " + what + " " + host_port + ": " + Errno());
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    const std::string why = Errno();
    ::close(fd);
    return Status::Unavailable(what + " " + host_port + ": getsockname: " + why);
  }
  listening.fd = fd;
  listening.port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                                               : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  return listening;
}

std::string SourceOf(const sockaddr_storage& peer) {
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
    in6_addr prefix = v6->sin6_addr;
    std::memset(&prefix.s6_addr[8], 0, 8);  // the /64
    return ::inet_ntop(AF_INET6, &prefix, text, sizeof text) ? std::string(text) + "/64" : std::string();
  }
  return {};
}

std::string SourceOf(int fd) {
  sockaddr_storage peer{};
  socklen_t length = sizeof peer;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length) != 0) return {};
  return SourceOf(peer);
}

}  // namespace specache::daemon
