// The data plane for clients on other hosts: a UCX listener whose endpoints carry a remote
// session's rows (remote_protocol.h). One thread owns the UCX worker and answers every request.
//
// Rules, checked on every message before anything is read or written:
//   - every endpoint accepted is sent a random challenge (kChallenge) at once;
//   - the first message on an endpoint is kHello with the session id and token and the endpoint's
//     challenge; it takes the session's lease (Registry::AttachRemote) and binds the endpoint to
//     that session for good. Any other message before it (another peer may name the endpoint)
//     is dropped, logged (rate-limited) and counted, and changes nothing;
//   - every later request carries that session id and token (others are dropped likewise) and
//     names a sequence of that session, a layer and KV head inside its layout and rows inside
//     its pages (the registry checks them: Registry::ReadRows / WriteRows);
//   - an endpoint whose hello is refused, or that says none within the lease, is closed;
//     refusals are answered with a specific status (to the request's id), logged (rate-limited)
//     and counted;
//   - a payload is kept only after its header is checked: a hello with a payload, a payload
//     larger than its header's rows make it, or one that would take the endpoint past
//     max_endpoint_bytes (its requests not yet served plus its replies not yet taken) or all
//     endpoints past max_held_bytes is refused without receiving it (a rendezvous payload is then
//     never fetched; an eager one UCX has already received);
//   - an endpoint with 1024 requests queued or 1024 replies not taken, whose replies none of
//     which it took for 30 s, or whose rendezvous payload has not arrived within 10 s (plus the
//     time what the data plane held then takes at 25 MiB/s), is closed (logged, counted as
//     refused);
//   - requests are answered in order per endpoint; one endpoint's payload still on its way holds
//     up no other endpoint's requests.
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
  // Per endpoint: request payloads taken off the wire and not yet served plus reply payloads not
  // yet sent. Room for two of the largest requests (64K rows of 4 KiB).
  uint64_t max_endpoint_bytes = uint64_t{512} << 20;
  // The same for every endpoint together.
  uint64_t max_held_bytes = uint64_t{4} << 30;
};

struct UcxServerStats {
  uint64_t connections = 0;  // open endpoints
  uint64_t requests = 0, refused = 0;
  // Messages without a known endpoint, or that their endpoint did not take (before its hello
  // without its challenge, after it without its session's proof, of an id not served, on an
  // endpoint being closed), replies not delivered, requests of a closed endpoint.
  uint64_t dropped = 0;
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
