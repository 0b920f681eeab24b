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

#include <utility>  // Boost 1.74 asio/awaitable.hpp uses std::exchange without it (C++20)

#include <boost/asio.hpp>
#include <sys/socket.h>

#include "specache/status.h"

namespace specache::daemon {

class AcceptLoop {
 public:
  // Owns `listening_fd` (a listening stream socket; made non-blocking here). `name` ("control",
  // "attach", "remote control") for log lines.
  AcceptLoop(boost::asio::io_context& io, std::string name, int listening_fd);
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

// A listening TCP socket on HOST:PORT (SO_REUSEADDR, CLOEXEC, the system's largest backlog; port
// 0: any free one). A wildcard host ("0.0.0.0", "[::]", "::") listens on IPv4 and IPv6 alike (one
// IPv6 socket with IPV6_V6ONLY off, or IPv4 alone where the host has no IPv6), as gRPC's own
// listener did; a numeric address on that address; a name on the first address it resolves to.
// Its descriptor and the port bound; UNAVAILABLE naming `what` and the address when it cannot be
// bound.
struct TcpListening {
  int fd = -1;
  uint16_t port = 0;
  bool dual_stack = false;  // an IPv6 socket that also accepts IPv4 clients
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
