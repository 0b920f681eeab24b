// The daemon's accept loops: the control and attach sockets' (Unix, unix_listener.h) and the
// remote control port's (TCP, ListenTcp). A loop accepts on the io thread, up to 64 connections a
// wakeup, and backs off on resource errors (EMFILE, ENFILE, ENOBUFS, ENOMEM) instead of spinning
// on them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <utility>  // Boost 1.74 asio/awaitable.hpp uses std::exchange without it (C++20)

#include <boost/asio.hpp>
#include <sys/socket.h>

#include "specache/status.h"

namespace specache::daemon {

class AcceptLoop {
 public:
  // Owns `listening_fd` (a listening stream socket; made non-blocking here) from the call, also
  // when it fails (the descriptor is then closed): UNAVAILABLE when the io context cannot watch
  // it. `name` ("control", "attach", "remote control") for log lines.
  static Result<std::unique_ptr<AcceptLoop>> Create(boost::asio::io_context& io, std::string name, int listening_fd);
  ~AcceptLoop();  // closes the socket
  AcceptLoop(const AcceptLoop&) = delete;
  AcceptLoop& operator=(const AcceptLoop&) = delete;

  // Calls on_accept(fd) on the io thread for each connection; the callee owns fd (CLOEXEC). May
  // be called from another thread before the io thread first runs the loop's handlers.
  void Start(std::function<void(int fd)> on_accept);
  // Stops accepting and closes the socket: with the io thread stopped, or on it.
  void Stop();
  int fd() const { return fd_; }
  uint64_t accept_errors() const { return accept_errors_.load(); }

 private:
  AcceptLoop(boost::asio::io_context& io, std::string name, int listening_fd);
  void Wait();
  void AcceptReady();

  std::string name_;
  int fd_;
  boost::asio::posix::stream_descriptor listening_;
  boost::asio::steady_timer retry_;
  std::function<void(int)> on_accept_;
  std::chrono::milliseconds backoff_{0};
  std::atomic<uint64_t> accept_errors_{0};
  bool stopped_ = false;
};

// Listening TCP sockets on HOST:PORT (SO_REUSEADDR, CLOEXEC, the system's largest backlog), as
// gRPC's own listener bound them: a wildcard host ("0.0.0.0", "[::]", "::") one IPv6 socket that
// takes IPv4 clients too (IPV6_V6ONLY off; IPv4 alone where the host has no IPv6), a numeric
// address that address, a name every address it resolves to that the host has (its IPv6 ones
// IPv6-only; an address the host lacks is skipped while another binds). Port 0:
// any free one, the same for every socket. Their descriptors (the caller's to close) and the
// port; UNAVAILABLE naming `what` and the address when one cannot be bound (none is left open).
struct TcpListening {
  std::vector<int> fds;
  uint16_t port = 0;
  bool dual_stack = false;  // one IPv6 socket that also accepts IPv4 clients
};
Result<TcpListening> ListenTcp(const std::string& host_port, const std::string& what);

// The source a TCP peer's connections are counted under: "a.b.c.d" for IPv4 (also when it reached
// an IPv6 socket as ::ffff:a.b.c.d), the /64 prefix for IPv6 ("2001:db8:1:2::/64": a host is
// given a whole /64, and could otherwise draw a new address for each connection); empty for
// another family.
std::string SourceOf(const sockaddr_storage& peer);
// SourceOf the connection's peer; empty when it has none (reset before this call).
std::string SourceOf(int fd);

}  // namespace specache::daemon
