// What the remote tests share: a specached with [remote] on loopback (TLS control plane, UCX data
// plane): free ports (free_port.h), a set of test certificates made with openssl, tenants' secret files and the
// daemon's configuration.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "free_port.h"
#include "processes.h"

namespace specache::testing {

// Certificates for one test run: a CA, the daemon's certificate (127.0.0.1; server-chain.pem: it,
// then the CA's), a client certificate from the same CA, and one from a CA the daemon does not know.
struct Pki {
  std::string dir;
  bool ok = false;
  Pki() {
    char tmpl[] = "/tmp/specache-pki-XXXXXX";
    dir = mkdtemp(tmpl);
    const std::string d = dir;
    auto cert = [&](const std::string& name, const std::string& ca, const std::string& ext) {
      return "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " + d + "/" + name + ".key -subj /CN=" + name + " -out " + d + "/" +
             name + ".csr 2>/dev/null && openssl x509 -req -in " + d + "/" + name + ".csr -CA " + d + "/" + ca +
             ".pem -CAkey " + d + "/" + ca + ".key -CAcreateserial -days 2 -out " + d + "/" + name + ".pem " + ext +
             " 2>/dev/null";
    };
    auto ca = [&](const std::string& name) {
      return "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " + d + "/" + name + ".key -subj /CN=" + name +
             " -days 2 -out " + d + "/" + name + ".pem 2>/dev/null";
    };
    std::ofstream(d + "/san.ext") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    const std::string script = ca("ca") + " && " + ca("other-ca") + " && " + cert("server", "ca", "-extfile " + d + "/san.ext") +
                                " && " + cert("client", "ca", "") + " && " + cert("stranger", "other-ca", "") +
                                // the daemon's chain: its certificate, then its issuer's
                                " && cat " + d + "/server.pem " + d + "/ca.pem > " + d + "/server-chain.pem";
    int code = 0;
    RunCommand(script, &code);
    ok = code == 0;
  }
  ~Pki() { std::filesystem::remove_all(dir); }
  std::string path(const std::string& f) const { return dir + "/" + f; }
};

inline std::string WriteSecret(const std::string& dir, const std::string& name, const std::string& secret) {
  const std::string path = dir + "/" + name + ".secret";
  std::ofstream(path) << secret << "\n";
  chmod(path.c_str(), 0600);
  return path;
}

// The daemon's configuration: tenants a and b (32 MiB each, their secret files) and [remote] on
// 127.0.0.1 with the Pki's server certificate.
inline std::string RemoteDaemonToml(const Pki& pki, const std::string& secret_a, const std::string& secret_b,
                                    uint16_t control_port, uint16_t data_port, bool mutual_tls, bool rma) {
  std::string toml = "[tenants.a]\nquota_bytes = \"32MiB\"\nremote_secret_file = \"" + secret_a +
                     "\"\n[tenants.b]\nquota_bytes = \"32MiB\"\nremote_secret_file = \"" + secret_b +
                     "\"\n[remote]\ncontrol_addr = \"127.0.0.1:" + std::to_string(control_port) +
                     "\"\ndata_addr = \"127.0.0.1:" + std::to_string(data_port) + "\"\ntls_cert = \"" +
                     pki.path("server-chain.pem") + "\"\ntls_key = \"" + pki.path("server.key") + "\"\n";
  if (mutual_tls) toml += "client_ca = \"" + pki.path("ca.pem") + "\"\n";
  if (rma) toml += "rma = true\n";
  return toml;
}

}  // namespace specache::testing
