// The attach endpoint: a Unix stream socket (Boost.Asio) where an attaching client presents its
// session id and token; the daemon checks the peer's credentials (SO_PEERCRED) against the
// session's tenant and passes the page table and chunk descriptors (SCM_RIGHTS). The session
// then lives as long as the connection: EOF, an error or any further byte detaches it.
#pragma once

#include <memory>
#include <string>

#include <utility>  // Boost 1.74 asio/awaitable.hpp uses std::exchange without it (C++20)

#include <boost/asio.hpp>

#include "registry.h"

namespace specache::daemon {

class AttachServer {
 public:
  AttachServer(boost::asio::io_context& io, Registry* registry, std::string path);
  // Binds (replacing a stale socket file) and starts accepting.
  Status Listen();
  void Stop();

 private:
  void Accept();

  boost::asio::io_context& io_;
  Registry* registry_;
  std::string path_;
  std::unique_ptr<boost::asio::local::stream_protocol::acceptor> acceptor_;
};

}  // namespace specache::daemon
