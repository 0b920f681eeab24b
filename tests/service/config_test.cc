#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "config.h"

namespace specache::daemon {
namespace {

TEST(DaemonConfigTest, ParsesSizesTenantsAndRejectsUnknownKeys) {
  EXPECT_EQ(*ParseBytes("64MiB"), uint64_t{64} << 20);
  EXPECT_EQ(*ParseBytes("8 GiB"), uint64_t{8} << 30);
  EXPECT_EQ(*ParseBytes("4096"), 4096u);
  EXPECT_FALSE(ParseBytes("8GB").ok());
  EXPECT_FALSE(ParseBytes("lots").ok());
  EXPECT_FALSE(ParseBytes("99999999999999TiB").ok());

  auto c = ParseConfig(R"(
socket = "/tmp/x.sock"
pool_bytes = "2GiB"
chunk_bytes = 16777216
lease_ms = 500
log_format = "json"
[tenants.a]
quota_bytes = "1GiB"
users = [0, "root"]
[tenants.b]
groups = [0]
)");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->socket, "/tmp/x.sock");
  EXPECT_EQ(c->AttachSocket(), "/tmp/x.sock.attach");
  EXPECT_EQ(c->pool_bytes, uint64_t{2} << 30);
  EXPECT_EQ(c->chunk_bytes, uint64_t{16} << 20);
  EXPECT_EQ(c->tenants.at("a").quota_bytes, uint64_t{1} << 30);
  EXPECT_EQ(c->tenants.at("a").uids, (std::vector<uint32_t>{0, 0}));
  EXPECT_EQ(c->tenants.at("b").quota_bytes, uint64_t{2} << 30);  // default: the pool
  EXPECT_FALSE(c->tenants.at("b").AllowsAnyone());

  struct Bad {
    const char* toml;
    const char* needle;
  } bad[] = {
      {"sockett = \"x\"", "unknown key 'sockett'"},
      {"pool_bytes = \"1XB\"", "pool_bytes"},
      {"lease_ms = 5", "lease_ms"},
      {"log_format = \"xml\"", "log_format"},
      {"chunk_bytes = 1000", "chunk_bytes"},
      {"[tenants.a]\nusers = [\"no-such-user-here\"]", "unknown user"},
      {"[tenants.a]\ncolour = 1", "tenants.a.colour"},
      {"pool_bytes = [", "line"},
      {"[tenants.a]\nusers = [4294968296]", "user id 4294968296 is out of range"},
      {"[tenants.a]\nusers = [-1]", "user id -1 is out of range"},
      {"[tenants.a]\ngroups = [4294967295]", "group id 4294967295 is out of range"},
      {"[access]\nadmin_users = [4294967296]", "access.admin_users: user id"},
      {"[access]\nsocket_mode = \"0666\"", "socket_mode"},
      {"[access]\nsocket_mode = \"rw\"", "socket_mode"},
      {"[access]\nsocket_group = \"no-such-group-here\"", "unknown group"},
      {"[access]\nadmins = [0]", "access.admins"},
      {"[limits]\nattach_connections = 0", "limits.attach_connections"},
      {"[limits]\nconnections = 5", "limits.connections"},
      {"[tenants.\"a b\"]\nquota_bytes = 1", "tenant names"},
      {"lease_ms = -5", "lease_ms"},
  };
  for (const Bad& b : bad) {
    auto r = ParseConfig(b.toml);
    ASSERT_FALSE(r.ok()) << b.toml;
    EXPECT_NE(r.status().message().find(b.needle), std::string::npos) << r.status().ToString();
  }
  auto access = ParseConfig(R"(
[access]
admin_users = [0, 1001]
admin_groups = [4343]
socket_mode = "0640"
socket_group = 4242
[limits]
attach_connections = 50
attach_connections_per_uid = 5
)");
  ASSERT_TRUE(access.ok()) << access.status().ToString();
  EXPECT_EQ(access->access.admin_uids, (std::vector<uint32_t>{0, 1001}));
  EXPECT_EQ(access->access.admin_gids, (std::vector<uint32_t>{4343}));
  EXPECT_EQ(access->access.socket_mode, 0640u);
  EXPECT_EQ(access->access.socket_gid, std::optional<uint32_t>(4242));
  EXPECT_EQ(access->limits.attach_connections, 50u);
  EXPECT_EQ(access->limits.attach_connections_per_uid, 5u);
  EXPECT_EQ(ParseConfig("[access]\nsocket_mode = 0o600\n")->access.socket_mode, 0600u);
  DaemonConfig plain;
  EXPECT_EQ(plain.access.socket_mode, 0660u) << "never world-writable by default";
  CompleteTenants(&plain);
  EXPECT_TRUE(plain.tenants.at("default").AllowsAnyone());
  EXPECT_EQ(plain.tenants.at("default").quota_bytes, plain.pool_bytes);
  // A tenant without quota_bytes gets the pool as finally sized (--pool-bytes after the file).
  auto file = ParseConfig("pool_bytes = \"2GiB\"\n[tenants.a]\n[tenants.b]\nquota_bytes = \"1GiB\"\n");
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  file->pool_bytes = uint64_t{16} << 30;
  CompleteTenants(&*file);
  EXPECT_EQ(file->tenants.at("a").quota_bytes, uint64_t{16} << 30);
  EXPECT_EQ(file->tenants.at("b").quota_bytes, uint64_t{1} << 30);
  EXPECT_EQ(file->tenants.count("default"), 0u);
}

TEST(DaemonConfigTest, SpillSectionAndTheShippedConfig) {
  auto c = ParseConfig(R"(
pool_bytes = "1GiB"
[spill]
dir = "/var/lib/x"
max_bytes = "10GiB"
park_bytes = "128MiB"
high_watermark = 0.8
low_watermark = 0.5
compression = true
)");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->spill.dir, "/var/lib/x");
  EXPECT_EQ(c->spill.max_bytes, uint64_t{10} << 30);
  EXPECT_EQ(c->ParkBytes(), uint64_t{128} << 20);
  EXPECT_DOUBLE_EQ(c->spill.high_watermark, 0.8);
  EXPECT_TRUE(c->spill.compression);
  EXPECT_EQ(ParseConfig("[spill]\nhigh_watermark = 0.5\nlow_watermark = 0.6\n").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseConfig("[spill]\nwatermark = 0.5\n").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseConfig("[spill]\nhigh_watermark = 2.0\n").status().code(), StatusCode::kInvalidArgument);
  auto defaults = ParseConfig("pool_bytes = \"4GiB\"\n");
  ASSERT_TRUE(defaults.ok());
  EXPECT_TRUE(defaults->spill.dir.empty());
  EXPECT_EQ(defaults->ParkBytes(), uint64_t{1} << 30);  // a quarter of the pool
  // The config deploy/ ships parses, with its spill tier (docs that match the code). Its groups
  // ("specache", "specache-admin") exist only where deploy/ is installed: those lines are left
  // out here.
  std::ifstream in(SPECACHE_SOURCE_DIR "/deploy/specached.toml");
  ASSERT_TRUE(in.good());
  std::string text, line;
  while (std::getline(in, line)) {
    if (line.rfind("groups", 0) != 0 && line.rfind("admin_groups", 0) != 0 && line.rfind("socket_group", 0) != 0) {
      text += line + "\n";
    }
  }
  auto shipped = ParseConfig(text);
  ASSERT_TRUE(shipped.ok()) << shipped.status().ToString();
  EXPECT_EQ(shipped->spill.dir, "/var/lib/specache/spill");
}

}  // namespace
}  // namespace specache::daemon

namespace specache::daemon {
namespace {

TEST(DaemonConfigTest, RemoteNeedsTlsAndTenantSecretsOnlyTheOwnerCanRead) {
  char tmpl[] = "/tmp/specache-config-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string secret = dir + "/a.secret";
  std::ofstream(secret) << "sixteen-bytes-or-more\n";
  chmod(secret.c_str(), 0600);
  const std::string tenant = "[tenants.a]\nremote_secret_file = \"" + secret + "\"\n";
  auto c = ParseConfig(tenant + "[remote]\ncontrol_addr = \"0.0.0.0:7700\"\ndata_addr = \"0.0.0.0:7701\"\n"
                                "tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\nrma = true\n");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->remote.enabled());
  EXPECT_TRUE(c->remote.rma);
  EXPECT_EQ(c->tenants.at("a").remote_secret, "sixteen-bytes-or-more");  // the newline is not part of it
  // A secret no client could send (a gRPC header value is printable ASCII; gRPC aborts a client
  // that adds another byte): refused here, at startup, with the rule.
  for (const std::string& unsendable : {std::string("sixteen-bytes\tor-more\n"), std::string("sixteen-bytes-or-more\x80"),
                                        std::string(24, '\x01')}) {
    std::ofstream(secret, std::ios::trunc) << unsendable;
    auto refused = ParseConfig(tenant);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("printable ASCII"), std::string::npos) << refused.status().ToString();
  }
  std::ofstream(secret, std::ios::trunc) << "sixteen-bytes-or-more\n";

  auto plaintext = ParseConfig(tenant + "[remote]\ncontrol_addr = \"0.0.0.0:7700\"\ndata_addr = \"0.0.0.0:7701\"\n");
  EXPECT_NE(plaintext.status().message().find("tls_cert"), std::string::npos) << plaintext.status().ToString();
  auto no_data = ParseConfig("[remote]\ncontrol_addr = \"0.0.0.0:7700\"\ntls_cert = \"/c\"\ntls_key = \"/k\"\n");
  EXPECT_NE(no_data.status().message().find("data_addr"), std::string::npos) << no_data.status().ToString();
  EXPECT_NE(ParseConfig("[remote]\nport = 1\n").status().message().find("unknown key 'remote.port'"), std::string::npos);
  // Control connections: closed idle after a minute and at ten minutes of age unless set, never
  // sooner than 100 ms.
  EXPECT_EQ(c->remote.idle_close_ms, 60000u);
  EXPECT_EQ(c->remote.max_connection_ms, 600000u);
  auto old = ParseConfig("[remote]\nmax_connection_ms = 120000\n");
  ASSERT_TRUE(old.ok()) << old.status().ToString();
  EXPECT_EQ(old->remote.max_connection_ms, 120000u);
  EXPECT_NE(ParseConfig("[remote]\nmax_connection_ms = 50\n").status().message().find("remote.max_connection_ms must be"),
            std::string::npos);
  auto idle = ParseConfig("[remote]\nidle_close_ms = 5000\n");
  ASSERT_TRUE(idle.ok()) << idle.status().ToString();
  EXPECT_EQ(idle->remote.idle_close_ms, 5000u);
  for (const char* bad : {"0", "99", "-1", "\"60s\"", "86400001"}) {
    auto refused = ParseConfig(std::string("[remote]\nidle_close_ms = ") + bad + "\n");
    EXPECT_NE(refused.status().message().find("remote.idle_close_ms must be"), std::string::npos)
        << bad << ": " << refused.status().ToString();
  }

  // Caps on the control port's connections: 1024 in all and 64 per source address unless set.
  EXPECT_EQ(c->remote.control_connections, 1024u);
  EXPECT_EQ(c->remote.control_connections_per_address, 64u);
  auto capped = ParseConfig("[remote]\ncontrol_connections = 8\ncontrol_connections_per_address = 2\n");
  ASSERT_TRUE(capped.ok()) << capped.status().ToString();
  EXPECT_EQ(capped->remote.control_connections, 8u);
  EXPECT_EQ(capped->remote.control_connections_per_address, 2u);
  for (const char* bad : {"0", "-3", "1000001", "\"8\""}) {
    auto refused = ParseConfig(std::string("[remote]\ncontrol_connections_per_address = ") + bad + "\n");
    EXPECT_NE(refused.status().message().find("remote.control_connections_per_address must be an integer in [1, 1000000]"),
              std::string::npos)
        << bad << ": " << refused.status().ToString();
  }

  chmod(secret.c_str(), 0640);
  auto readable = ParseConfig(tenant);
  EXPECT_NE(readable.status().message().find("must not be readable or writable by group or others"), std::string::npos)
      << readable.status().ToString();
  chmod(secret.c_str(), 0600);
  // A link to it (anyone who may write the link's directory could point it elsewhere), or a file
  // of another user, is refused; a file that cannot be opened says why.
  const std::string link = dir + "/link.secret";
  ASSERT_EQ(symlink(secret.c_str(), link.c_str()), 0);
  auto linked = ParseConfig("[tenants.a]\nremote_secret_file = \"" + link + "\"\n");
  EXPECT_EQ(linked.status().code(), StatusCode::kPermissionDenied) << linked.status().ToString();
  EXPECT_NE(linked.status().message().find("symbolic link"), std::string::npos) << linked.status().ToString();
  auto missing = ReadPrivateFile(dir + "/none", "the key");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("No such file"), std::string::npos) << missing.status().ToString();
  if (geteuid() == 0) {
    ASSERT_EQ(chown(secret.c_str(), 65534, 65534), 0);
    auto theirs = ParseConfig(tenant);
    EXPECT_EQ(theirs.status().code(), StatusCode::kPermissionDenied) << theirs.status().ToString();
    EXPECT_NE(theirs.status().message().find("belongs to user 65534"), std::string::npos) << theirs.status().ToString();
    ASSERT_EQ(chown(secret.c_str(), 0, 0), 0);
  }  // (another user's file can only be made as root: CI runs these tests as root)
  EXPECT_TRUE(ReadPrivateFile(secret, "the secret").ok());
  chmod(secret.c_str(), 0600);
  std::ofstream(secret) << "short\n";
  EXPECT_NE(ParseConfig(tenant).status().message().find("at least 16 bytes"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace specache::daemon
