// The attach endpoint: a Unix stream socket (Boost.Asio) where an attaching client presents its
// session id and token; the daemon checks the peer's credentials (SO_PEERCRED, SO_PEERGROUPS)
// against the session's tenant and passes the page table and chunk descriptors (SCM_RIGHTS). The
// session then lives as long as the connection: EOF, an error or any further byte detaches it.
//
// Connections are capped in total and per connecting uid ([limits]); one over a cap is closed at
// once, with a log line and a count. A connection that sends no request within 2 s is closed.
// Every request that gets no session is counted: refused by the registry (wrong token, a caller
// the tenant does not admit: `denied`), or malformed, cut short or never sent (`bad`); their log
// lines are throttled (LoggedOccurrence), since any member of the socket's group can send them.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "access.h"
#include "registry.h"
#include "unix_listener.h"

namespace specache::daemon {

struct AttachStats {
  uint64_t open = 0;           // connections now
  uint64_t refused = 0;        // closed at accept: over a cap, or no peer credentials
  uint64_t accept_errors = 0;  // accept() failures (EMFILE...), each followed by a backoff
  uint64_t denied = 0;         // requests the registry refused (token, tenant, session state)
  uint64_t bad = 0;            // requests malformed, cut short, or not sent within 2 s
  uint64_t replies_failed = 0;  // replies with a session's descriptors not delivered (the attach undone)
};

class AttachServer {
 public:
  AttachServer(boost::asio::io_context& io, Registry* registry, SocketFile file, LimitsConfig limits);
  // Binds (replacing a stale socket file: the caller holds the path's lock) and starts accepting.
  Status Listen();
  // Call with the io thread stopped.
  void Stop();
  AttachStats stats() const;

  // Open connections, shared with the connections themselves (they may outlive the server in
  // the io_context's queue).
  struct Counts {
    std::map<uint32_t, uint32_t> per_uid;  // io thread only
    std::atomic<uint64_t> open{0}, refused{0}, denied{0}, bad{0}, replies_failed{0};
  };

 private:
  void OnAccept(int fd);

  boost::asio::io_context& io_;
  Registry* registry_;
  SocketFile file_;
  LimitsConfig limits_;
  UnixListener listener_;
  std::shared_ptr<Counts> counts_ = std::make_shared<Counts>();
};

}  // namespace specache::daemon
