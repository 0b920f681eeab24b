// The TLS channel to a daemon on another host, and the credentials from the environment.
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <grpcpp/security/credentials.h>

#include "client_impl.h"
#include "specache/remote_protocol.h"

namespace specache::client {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

Result<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(std::string(what) + " " + path + " cannot be read");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

RemoteCredentials RemoteCredentials::FromEnvironment() {
  return {Env("SPECACHE_TLS_CA"), Env("SPECACHE_TLS_CERT"),   Env("SPECACHE_TLS_KEY"),
          Env("SPECACHE_TENANT"), Env("SPECACHE_SECRET_FILE"), Env("SPECACHE_TLS_SERVER_NAME")};
}

Status Client::Impl::ConnectRemote(const std::string& host_port, const RemoteCredentials& c,
                                   grpc::ChannelArguments* args) {
  if (c.tenant.empty() || c.secret_file.empty()) {
    return Status::InvalidArgument("a tcp:// daemon needs a tenant and its secret (SPECACHE_TENANT, SPECACHE_SECRET_FILE)");
  }
  SPECACHE_ASSIGN_OR_RETURN(secret, ReadFile(c.secret_file, "tenant secret"));
  remote::DropTrailingSpace(&secret);  // as the daemon does with its copy (config.cc, ReadSecretFile)
  if (secret.empty()) return Status::InvalidArgument("tenant secret file " + c.secret_file + " is empty");
  if (!remote::PrintableHeaderValue(secret)) {
    return Status::InvalidArgument("tenant secret file " + c.secret_file +
                                   " holds a byte outside printable ASCII (0x20-0x7e), which a gRPC header cannot "
                                   "carry: make the secret printable (e.g. openssl rand -hex 32) on both sides");
  }
  if (!remote::PrintableHeaderValue(c.tenant)) {
    return Status::InvalidArgument("tenant name holds a byte outside printable ASCII (0x20-0x7e)");
  }
  grpc::SslCredentialsOptions tls;
  if (!c.ca_file.empty()) {
    SPECACHE_ASSIGN_OR_RETURN(tls.pem_root_certs, ReadFile(c.ca_file, "TLS CA"));
  }
  if (!c.cert_file.empty() || !c.key_file.empty()) {
    if (c.cert_file.empty() || c.key_file.empty()) return Status::InvalidArgument("a client certificate needs both cert and key");
    SPECACHE_ASSIGN_OR_RETURN(tls.pem_cert_chain, ReadFile(c.cert_file, "TLS certificate"));
    SPECACHE_ASSIGN_OR_RETURN(tls.pem_private_key, ReadFile(c.key_file, "TLS key"));
  }
  if (!c.server_name.empty()) args->SetSslTargetNameOverride(c.server_name);
  remote = true;
  remote_address = host_port;
  tenant = c.tenant;
  channel = grpc::CreateCustomChannel(host_port, grpc::SslCredentials(tls), *args);
  return Status::Ok();
}

}  // namespace specache::client
