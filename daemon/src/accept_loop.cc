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
    : name_(std::move(name)), fd_(listening_fd), listening_(io), retry_(io) {}

Result<std::unique_ptr<AcceptLoop>> AcceptLoop::Create(boost::asio::io_context& io, std::string name, int listening_fd) {
  std::unique_ptr<AcceptLoop> loop(new AcceptLoop(io, std::move(name), listening_fd));
  boost::system::error_code ec;
  loop->listening_.assign(listening_fd, ec);  // registers it with the io context's reactor
  if (!ec) loop->listening_.non_blocking(true, ec);  // accept4 must not block the io thread
  if (ec) {
    if (!loop->listening_.is_open()) ::close(listening_fd);  // else closed with the loop
    return Status::Unavailable(loop->name_ + " socket: " + ec.message());
  }
  return loop;
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
// v6only: 1 or 0 sets IPV6_V6ONLY, -1 leaves the system's default.
int BoundSocket(int family, const sockaddr* address, socklen_t length, int v6only) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int on = 1;
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      (v6only >= 0 && ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only) != 0) ||
      ::bind(fd, address, length) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  return fd;
}

// The port a listening socket is bound to, or 0.
uint16_t BoundPort(int fd) {
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) return 0;
  return bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                                     : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
}

// The wildcard: one IPv6 socket that takes IPv4 clients too, or an IPv4 one where the host has no
// IPv6; -1 with errno set when neither binds.
int WildcardSocket(uint16_t port, bool* dual_stack) {
  sockaddr_in6 any6{};
  any6.sin6_family = AF_INET6;
  any6.sin6_addr = in6addr_any;
  any6.sin6_port = htons(port);
  int fd = BoundSocket(AF_INET6, reinterpret_cast<const sockaddr*>(&any6), sizeof any6, /*v6only=*/0);
  *dual_stack = fd >= 0;
  if (fd < 0 && (errno == EAFNOSUPPORT || errno == EADDRNOTAVAIL)) {
    sockaddr_in any4{};
    any4.sin_family = AF_INET;
    any4.sin_addr.s_addr = htonl(INADDR_ANY);
    any4.sin_port = htons(port);
    fd = BoundSocket(AF_INET, reinterpret_cast<const sockaddr*>(&any4), sizeof any4, -1);
  }
  return fd;
}

}  // namespace

Result<TcpListening> ListenTcp(const std::string& host_port, const std::string& what) {
  SPECACHE_ASSIGN_OR_RETURN(const auto host_and_port, remote::SplitHostPort(host_port));
  TcpListening listening;
  auto fail = [&](const std::string& why) {
    for (int fd : listening.fds) ::close(fd);
    return Status::Unavailable("cannot listen on " + what + " " + host_port + ": " + why);
  };
  if (IsWildcard(host_and_port.first)) {
    const int fd = WildcardSocket(host_and_port.second, &listening.dual_stack);
    if (fd < 0) return fail(Errno());
    listening.fds.push_back(fd);
  } else {
    auto resolved = remote::ResolveAddresses(host_port);
    if (!resolved.ok()) return fail(std::string(resolved.status().message()));
    const bool has_v4 = std::any_of(resolved->begin(), resolved->end(),
                                    [](const remote::SocketAddress& a) { return a.storage.ss_family == AF_INET; });
    for (remote::SocketAddress a : *resolved) {
      const bool v6 = a.storage.ss_family == AF_INET6;
      if (!listening.fds.empty()) {  // port 0: the first socket's port for every one
        const uint16_t port = htons(BoundPort(listening.fds.front()));
        if (v6) reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_port = port;
        else reinterpret_cast<sockaddr_in*>(&a.storage)->sin_port = port;
      }
      // An IPv6 socket beside IPv4 ones takes IPv6 alone, or their binds would clash.
      const int fd = BoundSocket(a.storage.ss_family, a.get(), a.length, v6 && has_v4 ? 1 : -1);
      if (fd < 0 && (errno == EADDRNOTAVAIL || errno == EAFNOSUPPORT) && resolved->size() > 1) {
        continue;  // an address this host does not have (::1 of localhost without IPv6): the others serve
      }
      if (fd < 0) return fail(Errno());
      listening.fds.push_back(fd);
    }
    if (listening.fds.empty()) return fail("none of its addresses is this host's");
  }
  listening.port = BoundPort(listening.fds.front());
  if (listening.port == 0) return fail("getsockname: " + Errno());
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
