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
  };
  for (const Bad& b : bad) {
    auto r = ParseConfig(b.toml);
    ASSERT_FALSE(r.ok()) << b.toml;
    EXPECT_NE(r.status().message().find(b.needle), std::string::npos) << r.status().ToString();
  }
  DaemonConfig plain;
  AddDefaultTenant(&plain);
  EXPECT_TRUE(plain.tenants.at("default").AllowsAnyone());
  EXPECT_EQ(plain.tenants.at("default").quota_bytes, plain.pool_bytes);
}

}  // namespace
}  // namespace specache::daemon
