#include "remote_server.h"

#include <fstream>
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>
#include <spdlog/spdlog.h>

#include "specache/remote_protocol.h"

namespace specache::daemon {
namespace {

// How long a control connection may take to finish its TLS handshake.
constexpr int kHandshakeMs = 10000;
// A connection told to go away (max_connection_ms) is cut this long after, if calls still hold it.
constexpr int kConnectionGraceMs = 5000;

// A PEM file; the private key's must be private (ReadPrivateFile), the certificates may be public.
Result<std::string> ReadPem(const std::string& path, const char* what, bool secret = false) {
  std::string pem;
  if (secret) {
    SPECACHE_ASSIGN_OR_RETURN(pem, ReadPrivateFile(path, std::string("remote.") + what));
  } else {
    std::ifstream in(path);
    if (!in) return Status::NotFound(std::string("remote.") + what + " " + path + " cannot be read");
    std::stringstream s;
    s << in.rdbuf();
    pem = s.str();
  }
  if (pem.find("-----BEGIN") == std::string::npos) {
    return Status::InvalidArgument(std::string("remote.") + what + " " + path + " is not PEM");
  }
  return pem;
}

std::string Metadata(const grpc::ServerContext* ctx, const char* key) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(key);
  return it == md.end() ? std::string() : std::string(it->second.data(), it->second.size());
}

}  // namespace

Result<std::unique_ptr<RemoteServer>> RemoteServer::Start(const DaemonConfig& config, Registry* registry,
                                                          KeptSequences* kept) {
  const RemoteConfig& rc = config.remote;
  std::unique_ptr<RemoteServer> r(new RemoteServer);
  SPECACHE_ASSIGN_OR_RETURN(r->ucx_, UcxServer::Start(registry, {rc.data_addr, rc.rma, config.lease_ms,
                                                                 config.limits.attach_connections}));
  SPECACHE_ASSIGN_OR_RETURN(auto data_host, remote::SplitHostPort(rc.data_addr));
  const std::string host = data_host.first.find(':') != std::string::npos ? "[" + data_host.first + "]" : data_host.first;
  const std::string data_address = host + ":" + std::to_string(r->ucx_->port());

  grpc::SslServerCredentialsOptions tls(rc.client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                             : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  SPECACHE_ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(rc.tls_cert, "tls_cert"));
  SPECACHE_ASSIGN_OR_RETURN(pair.private_key, ReadPem(rc.tls_key, "tls_key", /*secret=*/true));
  tls.pem_key_cert_pairs.push_back(pair);
  if (!rc.client_ca.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(tls.pem_root_certs, ReadPem(rc.client_ca, "client_ca"));
  }

  // Callers by the tenant secret of each call; the policy compares it in constant time.
  const AccessPolicy* access = &registry->access();
  r->service_ = std::make_unique<ControlService>(
      registry, kept,
      [access](const grpc::ServerContext* ctx) {
        return access->AuthenticateRemote(Metadata(ctx, kTenantKey), Metadata(ctx, kSecretKey));
      },
      std::string(), config.lease_ms, data_address);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(rc.control_addr, grpc::SslServerCredentials(tls), &port);
  builder.RegisterService(r->service_.get());
  builder.SetMaxReceiveMessageSize(64 << 10);  // as on the local socket: every request is small
  // Anyone who reaches the port can open connections before any secret is checked, and gRPC
  // (1.51) has no limit on their number: a connection that has not finished its TLS handshake is
  // closed after kHandshakeMs (gRPC's default, 120 s, let half-open ones pile up towards the
  // process's descriptor limit, which the local sockets share).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeMs);
  // Once handshaken: closed after idle_close_ms without a call in progress, and at
  // max_connection_ms of age whatever it does (RemoteConfig).
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, static_cast<int>(rc.idle_close_ms));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, static_cast<int>(rc.max_connection_ms));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, kConnectionGraceMs);
  r->server_ = builder.BuildAndStart();
  if (!r->server_ || port == 0) return Status::Unavailable("cannot listen on remote.control_addr " + rc.control_addr);
  r->control_port_ = static_cast<uint16_t>(port);
  spdlog::info("remote: control plane (TLS{}) on port {}, data plane (UCX, {}) on {}", rc.client_ca.empty() ? "" : ", mutual",
               r->control_port_, r->ucx_->transports(), data_address);
  if (rc.rma) {
    spdlog::warn("remote: rma = true hands out remote keys; over transports that do not check them in hardware (TCP) "
                 "a remote client can read any of this daemon's memory: trusted RDMA fabrics only");
  }
  return r;
}

RemoteServer::~RemoteServer() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  ucx_.reset();  // after the control plane: no new session names it
}

}  // namespace specache::daemon
