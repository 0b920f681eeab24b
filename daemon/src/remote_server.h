// Access for clients on other hosts ([remote] in the config): the Control service on a TCP port
// with TLS (mutual TLS when client_ca is set), and the UCX data plane (ucx_server.h).
//
// A remote caller is whoever presents a tenant's secret (tenants.<name>.remote_secret_file) in the
// metadata of each call (kTenantKey, kSecretKey); it may use that tenant only and is never an admin
// (access.h). Its sessions attach over UCX with the session token, not on the attach socket.
// The daemon never serves remote callers on a plaintext port.
#pragma once

#include <memory>
#include <string>

#include "control_service.h"
#include "registry.h"
#include "ucx_server.h"

namespace grpc {
class Server;
}

namespace specache::daemon {

inline constexpr char kTenantKey[] = "x-specache-tenant";
inline constexpr char kSecretKey[] = "x-specache-secret";

class RemoteServer {
 public:
  // Starts the UCX listener, then the TLS gRPC server (whose OpenSession names the UCX port).
  static Result<std::unique_ptr<RemoteServer>> Start(const DaemonConfig& config, Registry* registry, KeptSequences* kept);
  ~RemoteServer();

  uint16_t control_port() const { return control_port_; }
  uint16_t data_port() const { return ucx_->port(); }
  const ControlService& service() const { return *service_; }
  UcxServerStats data_stats() const { return ucx_->stats(); }
  void set_connection_counts(std::function<ServiceCounts()> counts) { service_->set_connection_counts(std::move(counts)); }

 private:
  RemoteServer() = default;
  std::unique_ptr<UcxServer> ucx_;
  std::unique_ptr<ControlService> service_;
  std::unique_ptr<grpc::Server> server_;
  uint16_t control_port_ = 0;
};

}  // namespace specache::daemon
