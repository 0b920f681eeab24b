// Access for clients on other hosts ([remote] in the config): the Control service on a TCP port
// with TLS (mutual TLS when client_ca is set), and the UCX data plane (ucx_server.h).
//
// A remote caller is whoever presents a tenant's secret (tenants.<name>.remote_secret_file) in the
// metadata of each call (kTenantKey, kSecretKey); it may use that tenant only and is never an admin
// (access.h). Its sessions attach over UCX with the session token, not on the attach socket.
// The daemon never serves remote callers on a plaintext port.
//
// The daemon accepts the control port's TCP connections itself (AcceptLoop), caps how many are
// open in all and per source address ([remote] control_connections, control_connections_per_address:
// one over a cap is closed at once, logged and counted), and hands the rest to gRPC, which runs
// TLS and the calls on them (an external connection acceptor). The certificate and key are checked
// with OpenSSL before: gRPC 1.51 starts such a server with credentials it cannot use and then
// leaves every connection unanswered.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "accept_loop.h"
#include "access.h"
#include "control_service.h"
#include "registry.h"
#include "ucx_server.h"

namespace grpc {
class Server;
namespace experimental {
class ExternalConnectionAcceptor;
}
}  // namespace grpc

namespace specache::daemon {

inline constexpr char kTenantKey[] = "x-specache-tenant";
inline constexpr char kSecretKey[] = "x-specache-secret";

class RemoteServer {
 public:
  // Starts the UCX listener, then the TLS gRPC server (whose OpenSession names the UCX port), then
  // accepts control connections on `io`'s thread. Destroy it with that thread stopped.
  static Result<std::unique_ptr<RemoteServer>> Start(const DaemonConfig& config, Registry* registry, KeptSequences* kept,
                                                     boost::asio::io_context& io);
  ~RemoteServer();

  uint16_t control_port() const { return control_port_; }
  uint16_t data_port() const { return ucx_->port(); }
  const ControlService& service() const { return *service_; }
  UcxServerStats data_stats() const { return ucx_->stats(); }
  // Control connections closed at accept (over a cap, or reset before they could be counted), and
  // accept errors of the control port.
  uint64_t control_refused() const { return control_refused_.load(); }
  uint64_t accept_errors() const {
    uint64_t errors = 0;
    for (const auto& loop : control_loops_) errors += loop->accept_errors();
    return errors;
  }
  void set_connection_counts(std::function<ServiceCounts()> counts) { service_->set_connection_counts(std::move(counts)); }

 private:
  RemoteServer() = default;
  // On the io thread: a new control connection of `loop` counted, or closed over a cap.
  void Admit(int fd, const AcceptLoop& loop);

  std::unique_ptr<UcxServer> ucx_;
  std::unique_ptr<ControlService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> control_acceptor_;  // gRPC's side
  std::vector<std::unique_ptr<AcceptLoop>> control_loops_;                            // the daemon's side
  PeerTable control_connections_;
  ConnectionLimits control_limits_;
  std::atomic<uint64_t> control_refused_{0};
  uint16_t control_port_ = 0;
};

}  // namespace specache::daemon
