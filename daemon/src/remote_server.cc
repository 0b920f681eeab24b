#include "remote_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <spdlog/spdlog.h>

#include "log_rate.h"
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

// OpenSSL's earliest queued error (the cause, before what it led to), for a refusal.
std::string SslError() {
  char text[256] = {};
  ERR_error_string_n(ERR_get_error(), text, sizeof text);
  ERR_clear_error();
  return text;
}

// The daemon's certificate chain and key as a TLS server would load them (OpenSSL, which gRPC's
// TLS uses here), the key matching the certificate, and the client CA's certificates: INVALID_ARGUMENT
// naming the file otherwise. gRPC 1.51 does not report credentials it cannot use on a port whose
// connections the daemon accepts: the port would take connections and never answer them.
// The texts are those handed to gRPC (read once: a file replaced between two reads would have
// one version checked and another served).
Status CheckTlsFiles(const RemoteConfig& rc, const std::string& cert_pem, const std::string& key_pem,
                     const std::string& client_ca_pem) {
  ERR_clear_error();  // the queue read below is this check's alone
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_server_method()), SSL_CTX_free);
  if (!ctx) return Status::Unavailable("remote: OpenSSL cannot make a TLS context: " + SslError());
  // The chain as SSL_CTX_use_certificate_chain_file reads a file: the leaf, then its issuers.
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())),
                                                     BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> leaf(
      cert_bio ? PEM_read_bio_X509_AUX(cert_bio.get(), nullptr, nullptr, const_cast<char*>("")) : nullptr, X509_free);
  auto unusable_chain = [&] {
    return Status::InvalidArgument("remote.tls_cert " + rc.tls_cert + " is not a usable certificate chain: " + SslError());
  };
  if (!leaf || SSL_CTX_use_certificate(ctx.get(), leaf.get()) != 1) return unusable_chain();
  // (add0 applies OpenSSL's security level to each issuer, as the file loader did: a weak
  // intermediate stops the startup where gRPC alone would serve it.)
  while (X509* issuer = PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, const_cast<char*>(""))) {
    if (SSL_CTX_add0_chain_cert(ctx.get(), issuer) != 1) {  // takes the certificate when it succeeds
      X509_free(issuer);
      return unusable_chain();
    }
  }
  // The loop ends at the text's end (no start line found) or at a malformed certificate.
  if (const unsigned long last = ERR_peek_last_error(); ERR_GET_LIB(last) != ERR_LIB_PEM || ERR_GET_REASON(last) != PEM_R_NO_START_LINE) {
    return unusable_chain();
  }
  ERR_clear_error();
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())),
                                                    BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      // An empty passphrase, as gRPC gives: an encrypted key fails here as it would there (without
      // one OpenSSL would ask for a passphrase on the terminal or stdin).
      key_bio ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, const_cast<char*>("")) : nullptr, EVP_PKEY_free);
  if (!key) return Status::InvalidArgument("remote.tls_key " + rc.tls_key + " is not a usable private key: " + SslError());
  if (SSL_CTX_use_PrivateKey(ctx.get(), key.get()) != 1 || SSL_CTX_check_private_key(ctx.get()) != 1) {
    return Status::InvalidArgument("remote.tls_key " + rc.tls_key + " does not match the certificate of remote.tls_cert " +
                                   rc.tls_cert + ": " + SslError());
  }
  if (!client_ca_pem.empty()) {
    std::unique_ptr<BIO, decltype(&BIO_free)> ca_bio(
        BIO_new_mem_buf(client_ca_pem.data(), static_cast<int>(client_ca_pem.size())), BIO_free);
    std::unique_ptr<X509, decltype(&X509_free)> ca(ca_bio ? PEM_read_bio_X509(ca_bio.get(), nullptr, nullptr, nullptr) : nullptr,
                                                   X509_free);
    if (!ca) return Status::InvalidArgument("remote.client_ca " + rc.client_ca + " holds no certificate: " + SslError());
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<RemoteServer>> RemoteServer::Start(const DaemonConfig& config, Registry* registry,
                                                          KeptSequences* kept, boost::asio::io_context& io) {
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
  SPECACHE_RETURN_IF_ERROR(CheckTlsFiles(rc, pair.cert_chain, pair.private_key, tls.pem_root_certs));

  // Callers by the tenant secret of each call; the policy compares it in constant time.
  const AccessPolicy* access = &registry->access();
  r->service_ = std::make_unique<ControlService>(
      registry, kept,
      [access](const grpc::ServerContext* ctx) {
        return access->AuthenticateRemote(Metadata(ctx, kTenantKey), Metadata(ctx, kSecretKey));
      },
      std::string(), config.lease_ms, data_address);
  // The control port, bound before gRPC starts: a port that is taken fails the startup here.
  SPECACHE_ASSIGN_OR_RETURN(const TcpListening listening, ListenTcp(rc.control_addr, "remote.control_addr"));
  for (size_t i = 0; i < listening.fds.size(); ++i) {
    auto loop = AcceptLoop::Create(io, "remote control", listening.fds[i]);  // owns the socket, also when it fails
    if (!loop.ok()) {
      for (size_t j = i + 1; j < listening.fds.size(); ++j) ::close(listening.fds[j]);
      return loop.status();
    }
    r->control_loops_.push_back(std::move(*loop));
  }
  r->control_port_ = listening.port;
  r->control_limits_ = {rc.control_connections, rc.control_connections_per_address, "address", "[remote]"};

  grpc::ServerBuilder builder;
  r->control_acceptor_ = builder.experimental().AddExternalConnectionAcceptor(
      grpc::ServerBuilder::experimental_type::ExternalConnectionType::FROM_FD, grpc::SslServerCredentials(tls));
  builder.RegisterService(r->service_.get());
  builder.SetMaxReceiveMessageSize(64 << 10);  // as on the local socket: every request is small
  // Anyone who reaches the port can open connections before any secret is checked: within the
  // caps (Admit), a connection that has not finished its TLS handshake is closed after
  // kHandshakeMs (gRPC's default, 120 s, let half-open ones hold their places for that long).
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, kHandshakeMs);
  // Once handshaken: closed after idle_close_ms without a call in progress, and at
  // max_connection_ms of age whatever it does (RemoteConfig).
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, static_cast<int>(rc.idle_close_ms));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, static_cast<int>(rc.max_connection_ms));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, kConnectionGraceMs);
  r->server_ = builder.BuildAndStart();
  if (!r->server_ || !r->control_acceptor_) return Status::Unavailable("cannot start the remote control plane's gRPC server");
  // Last: nothing after it can fail, so the loop never outlives a failed start on a running io thread.
  RemoteServer* self = r.get();
  for (auto& loop : r->control_loops_) {
    const AcceptLoop* of = loop.get();
    loop->Start([self, of](int fd) { self->Admit(fd, *of); });
  }
  spdlog::info("remote: control plane (TLS{}) on port {}, data plane (UCX, {}) on {}", rc.client_ca.empty() ? "" : ", mutual",
               r->control_port_, r->ucx_->transports(), data_address);
  if (rc.rma) {
    spdlog::warn("remote: rma = true hands out remote keys; over transports that do not check them in hardware (TCP) "
                 "a remote client can read any of this daemon's memory: trusted RDMA fabrics only");
  }
  return r;
}

void RemoteServer::Admit(int fd, const AcceptLoop& loop) {
  std::string source = SourceOf(fd);
  const int flags = fcntl(fd, F_GETFL);
  const int on = 1;  // as gRPC's own listener set: a call's reply is not held back for an ACK
  Status admitted = source.empty() ? Status::Unavailable("reset before its address could be read")
                    : flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0 ||
                            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on) != 0
                        ? Status::Unavailable("cannot set it up: " + std::string(strerror(errno)))
                        : control_connections_.Admit(fd, Caller{}, source, control_limits_);
  if (!admitted.ok()) {
    ::close(fd);
    const uint64_t refused = ++control_refused_;
    if (LoggedOccurrence(refused)) {  // 1st, 2nd, 4th...: a flood of connections does not flood the log
      spdlog::warn("remote: control connection from {} closed: {}; {} closed so far", source.empty() ? "?" : source,
                   admitted.message(), refused);
    }
    return;
  }
  grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters p;
  p.listener_fd = loop.fd();
  p.fd = fd;
  control_acceptor_->HandleNewConnection(&p);  // gRPC owns fd from here (and closes it at shutdown)
}

RemoteServer::~RemoteServer() {
  for (auto& loop : control_loops_) loop->Stop();  // no new connection reaches gRPC while it shuts down
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  ucx_.reset();  // after the control plane: no new session names it
}

}  // namespace specache::daemon
