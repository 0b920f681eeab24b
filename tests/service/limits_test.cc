// specached's limits under abuse: memory a client keeps after closing its session stays charged
// to its tenant; attach connections are capped per uid and in total; out of descriptors, the
// accept loops back off instead of spinning and no chunk leaves the pool.
#include <sys/stat.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "processes.h"
#include "specache/client.h"

namespace specache {
namespace {

using testing::AsUser;
using testing::DaemonProcess;
using testing::Spawn;
using Clock = std::chrono::steady_clock;

std::unique_ptr<client::Client> Connect(const DaemonProcess& d) {
  auto c = client::Client::Connect({d.socket, std::chrono::milliseconds(3000), "limits-test"});
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::move(c).value() : nullptr;
}

uint64_t RetainedBytes(client::Client* c, const std::string& tenant) {
  auto s = c->Stats();
  if (!s.ok()) return ~uint64_t{0};
  for (const auto& t : s->tenants) {
    if (t.tenant == tenant) return t.retained_bytes;
  }
  return ~uint64_t{0};
}

// Waits until `done` holds (polling every 20 ms); false after timeout_ms.
template <typename Done>
bool WaitFor(Done done, int timeout_ms) {
  const auto end = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// CPU seconds (user + system) a process has used so far.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream fields(stat.substr(stat.rfind(')') + 2));
  std::string f;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i == 14) utime = std::stoull(f);
    if (i == 15) stime = std::stoull(f);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// A client process of tenant alpha (16 MiB) that attached a session of 12 MiB and closes it at
// once while it keeps the chunks mapped (test_client close-keep); its next line says the close
// returned.
std::unique_ptr<testing::Child> SpawnCloseKeep(const DaemonProcess& d) {
  auto keeper = Spawn({TEST_CLIENT_PATH, "close-keep", d.socket, "alpha", std::to_string(12 << 20), "0"});
  EXPECT_EQ(keeper->ReadLine(10000).rfind("attached", 0), 0u);
  return keeper;
}

// A client closes its session but keeps the chunk descriptors and mappings: the memory stays
// charged to its tenant until the process lets go (here: exits), so the quota holds. Also while
// the chunks go back to the pool (the let-go wait for a process that still maps them, then fresh
// memory for those it holds): a session opened meanwhile found them neither in a session nor
// retained, and got the quota a second time.
TEST(LimitsTest, MemoryAClosedClientStillHoldsStaysChargedToItsTenant) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start("[tenants.alpha]\nquota_bytes = \"16MiB\"\n"));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto keeper = SpawnCloseKeep(d);
  std::atomic<bool> closed{false};
  std::string closed_line;
  std::thread reader([&] {
    closed_line = keeper->ReadLine(10000);
    closed = true;
  });
  int opened = 0, tries = 0;
  while (!closed) {  // from before the close until it returned
    auto s = c->OpenSession("alpha", 8 << 20);
    ++tries;
    if (s.ok()) {
      ++opened;
    } else {
      EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status().ToString();
    }
  }
  reader.join();
  ASSERT_EQ(closed_line, "closed OK");
  EXPECT_EQ(opened, 0) << "of " << tries << " sessions of 8 MiB opened while 12 of the tenant's 16 MiB went back";
  EXPECT_EQ(RetainedBytes(c.get(), "alpha"), uint64_t{12} << 20);
  auto over = c->OpenSession("alpha", 8 << 20);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status().ToString();
  EXPECT_NE(over.status().message().find("quota"), std::string::npos) << over.status().ToString();
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->free_bytes, stats->pool_bytes) << "the pool itself got fresh memory";
  keeper->Kill();
  ASSERT_EQ(keeper->Wait(5000), 128 + SIGKILL);
  EXPECT_TRUE(WaitFor([&] { return RetainedBytes(c.get(), "alpha") == 0; }, 3000));
  auto whole = c->OpenSession("alpha", 16 << 20);
  EXPECT_TRUE(whole.ok()) << whole.status().ToString();
}

// A client that unmaps before closing (the client library does) frees its quota at once: its
// chunks are zeroed and reused, not replaced.
TEST(LimitsTest, AWellBehavedCloseFreesTheQuotaAtOnce) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start("[tenants.alpha]\nquota_bytes = \"16MiB\"\n"));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  for (int i = 0; i < 5; ++i) {
    auto s = c->OpenSession("alpha", 16 << 20);
    ASSERT_TRUE(s.ok()) << "round " << i << ": " << s.status().ToString();
    std::memset((*s)->chunk_data(0), 0x11, (*s)->chunk_bytes());
  }
  EXPECT_EQ(RetainedBytes(c.get(), "alpha"), 0u);
}

// Idle attach connections beyond the per-uid cap are closed at once (counted); another user's
// sessions still attach.
TEST(LimitsTest, AttachConnectionsAreCappedPerUidAndInTotal) {
  if (!testing::CanSwitchUsers()) GTEST_SKIP() << "needs root and /usr/bin/setpriv to act as uid 65534";
  DaemonProcess d;
  ASSERT_TRUE(d.Start("[access]\nsocket_group = 65534\n[limits]\nattach_connections = 7\nattach_connections_per_uid = 4\n"));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto flood = Spawn(AsUser(65534, 65534, {}, {TEST_CLIENT_PATH, "flood", d.socket + ".attach", "40"}));
  EXPECT_EQ(flood->ReadLine(10000), "open 4");
  auto session = c->OpenSession("default", 4 << 20);  // root: under its own cap and the total
  EXPECT_TRUE(session.ok()) << session.status().ToString();
  auto root_flood = Spawn({TEST_CLIENT_PATH, "flood", d.socket + ".attach", "10"});
  EXPECT_EQ(root_flood->ReadLine(10000), "open 2") << "7 in all: 4 of uid 65534, root's session and 2 more";
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->refused_connections, 36u + 8u);
  EXPECT_EQ(stats->attach_connections, 7u);
}

// Control connections too (the gRPC socket, which anyone in the socket's group may reach): a uid
// holds at most its share, all of them at most the total, and connections that closed free their
// places again.
TEST(LimitsTest, ControlConnectionsAreCappedPerUidAndInTotal) {
  if (!testing::CanSwitchUsers()) GTEST_SKIP() << "needs root and /usr/bin/setpriv to act as uid 65534";
  DaemonProcess d;
  ASSERT_TRUE(d.Start("[access]\nsocket_group = 65534\n[limits]\ncontrol_connections = 7\ncontrol_connections_per_uid = 4\n"));
  auto c = Connect(d);
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->Stats().ok());  // root's one connection
  auto flood = Spawn(AsUser(65534, 65534, {}, {TEST_CLIENT_PATH, "flood", d.socket, "40"}));
  EXPECT_EQ(flood->ReadLine(10000), "open 4");
  auto root_flood = Spawn({TEST_CLIENT_PATH, "flood", d.socket, "10"});
  EXPECT_EQ(root_flood->ReadLine(10000), "open 2") << "7 in all: 4 of uid 65534, root's client and 2 more";
  auto stats = c->Stats();  // the connection it had is still served
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->refused_connections, 36u + 8u);
  // Once the floods are gone, their places are free again.
  flood->Kill(SIGKILL);
  flood->Wait(5000);
  root_flood->Kill(SIGKILL);
  root_flood->Wait(5000);
  EXPECT_TRUE(WaitFor([&] {
    auto again = client::Client::Connect({d.socket, std::chrono::milliseconds(1000), "limits-test"});
    return again.ok() && (*again)->Stats().ok();
  }, 5000));
  auto after = Spawn(AsUser(65534, 65534, {}, {TEST_CLIENT_PATH, "flood", d.socket, "6"}));
  EXPECT_EQ(after->ReadLine(10000), "open 4") << "uid 65534's places came back";
}

// With descriptors exhausted by a flood of attach connections, the accept loop backs off (no
// core spinning, accept errors counted) and a session closed meanwhile by a client that keeps
// its chunks loses no chunk from the pool: the failed replacement is retried.
TEST(LimitsTest, OutOfDescriptorsTheDaemonBacksOffAndKeepsEveryChunk) {
  DaemonProcess d;
  d.prefix = {"/usr/bin/prlimit", "--nofile=80", "--"};
  ASSERT_TRUE(d.Start());  // 80 descriptors run out before the default caps (1024, 64 per uid)
  auto c = Connect(d);
  ASSERT_TRUE(c);
  auto keeper = Spawn({TEST_CLIENT_PATH, "close-keep", d.socket, "default", std::to_string(8 << 20), "1000"});
  ASSERT_EQ(keeper->ReadLine(10000).rfind("attached", 0), 0u);
  auto flood = Spawn({TEST_CLIENT_PATH, "flood", d.socket + ".attach", "300"});
  ASSERT_EQ(flood->ReadLine(10000).rfind("open", 0), 0u);
  const double cpu_before = CpuSeconds(d.child->pid);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  const double cpu = CpuSeconds(d.child->pid) - cpu_before;
  EXPECT_LT(cpu, 0.1) << "the daemon used " << cpu << " s of CPU in 1 s while out of descriptors";
  EXPECT_EQ(keeper->ReadLine(10000), "closed OK");
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_GT(stats->accept_errors, 0u);
  flood->Kill();
  flood->Wait(5000);
  EXPECT_TRUE(WaitFor(
      [&] {
        auto s = c->Stats();
        return s.ok() && s->chunks_out_of_service == 0 && s->sessions == 0 && s->free_bytes == s->pool_bytes;
      },
      5000))
      << "free " << c->Stats()->free_bytes << " of " << c->Stats()->pool_bytes << ", "
      << c->Stats()->chunks_out_of_service << " out of service";
  // The pool is whole, but the keeper's 8 MiB still count against the tenant's quota (the pool).
  EXPECT_EQ(c->OpenSession("default", 60 << 20).status().code(), StatusCode::kResourceExhausted);
  keeper->Kill();
  keeper->Wait(5000);
  EXPECT_TRUE(WaitFor([&] { return c->OpenSession("default", 64 << 20).ok(); }, 3000)) << "every chunk is back";
}

}  // namespace
}  // namespace specache
