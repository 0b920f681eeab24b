// The data plane for clients on other hosts: a UCX listener whose endpoints carry a remote
// session's rows (remote_protocol.h). One thread owns the UCX worker and answers every request.
//
// Rules, checked on every message before anything is read or written:
//   - the first message on an endpoint is kHello with the session id and token; it takes the
//     session's lease (Registry::AttachRemote) and binds the endpoint to that session for good;
//   - every later request names a sequence of that session, a layer and KV head inside its layout
//     and rows inside its pages (the registry checks them: Registry::ReadRows / WriteRows);
//   - an endpoint that sends anything else first, or no hello within the lease, is closed;
//     refusals are answered with a specific status, logged (rate-limited) and counted.
// The session ends when its endpoint closes (the client exited, crashed or lost the network): the
// registry reclaims it as it does a closed attach connection. An endpoint whose session ended
// another way (CloseSession) is closed too, and its chunks' UCX registrations are dropped, so a
// remote key handed out for them is stale from then on.
//
// With `rma` on, the hello's reply also carries the session's chunks as remote keys (ucp_mem_map
// at attach, ucp_mem_unmap when the session ends), for client-side gets. Only transports that
// check keys in hardware (RDMA) confine those gets to the session's chunks: UCX's software RMA
// (TCP, and shared memory through CMA) serves any address of the daemon, so `rma` is for trusted
// fabrics and is off by default (docs/remote.md).
//
// Transports and their settings come from UCX's own environment (UCX_TLS, UCX_NET_DEVICES...) and
// configuration file, not from here.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "registry.h"

namespace specache::daemon {

struct UcxServerOptions {
  std::string listen_addr;  // "host:port"; port 0 picks one (see port())
  bool rma = false;
  uint32_t lease_ms = 2000;          // hello within this, or the endpoint is closed
  uint32_t max_connections = 1024;   // more are rejected at the listener
};

struct UcxServerStats {
  uint64_t connections = 0;  // open endpoints
  uint64_t requests = 0, refused = 0, dropped = 0;
};

class UcxServer {
 public:
  // Creates the UCX context, worker and listener and starts the thread.
  static Result<std::unique_ptr<UcxServer>> Start(Registry* registry, const UcxServerOptions& options);
  ~UcxServer();  // closes every endpoint, then the listener and the worker

  uint16_t port() const;
  UcxServerStats stats() const;
  // The UCX transports the context uses (for the startup log line).
  const std::string& transports() const;

  struct Impl;

 private:
  explicit UcxServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specache::daemon
