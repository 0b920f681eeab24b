// specached's startup checks, as a careless operator would meet them: a second daemon on the
// same socket path is refused and the first one keeps serving; bad settings (a socket directory
// that cannot be created, ids that do not fit uid_t, negative durations, a pool larger than the
// RAM or than RLIMIT_MEMLOCK) end the daemon with exit code 1 and a message, never an abort.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "processes.h"
#include "specache/client.h"
#include "testing/temp_dir.h"

namespace specache {
namespace {

using testing::DaemonProcess;
using testing::Spawn;

struct Outcome {
  int code = -1;    // exit code, -1 when still running after the wait (then killed)
  std::string log;  // its stderr
};

// Runs specached (under `prefix`) with these arguments and waits up to wait_ms for it to exit.
Outcome RunDaemon(const std::string& dir, std::vector<std::string> args, std::vector<std::string> prefix = {},
                  int wait_ms = 10000) {
  std::vector<std::string> argv = prefix;
  const char* binary = std::getenv("SPECACHE_TEST_SPECACHED");  // as DaemonProcess
  argv.insert(argv.end(), {binary ? binary : SPECACHED_PATH, "--chunk-bytes", "4MiB", "--metrics-addr", "off"});
  if (std::find(args.begin(), args.end(), "--pool-bytes") == args.end()) args.insert(args.end(), {"--pool-bytes", "64MiB"});
  argv.insert(argv.end(), args.begin(), args.end());
  const std::string log = dir + "/run.log";
  auto child = Spawn(argv, log);
  Outcome o;
  o.code = child->Wait(wait_ms);
  std::ifstream in(log);
  o.log.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return o;
}

TEST(StartupTest, ASecondDaemonOnTheSameSocketIsRefusedAndTheFirstServesOn) {
  DaemonProcess first;
  ASSERT_TRUE(first.Start());
  auto c = client::Client::Connect({first.socket, std::chrono::milliseconds(3000), "startup-test"});
  ASSERT_TRUE(c.ok());
  auto session = (*c)->OpenSession("default", 4 << 20);
  ASSERT_TRUE(session.ok());
  testing::TempDir dir;
  const Outcome second = RunDaemon(dir.path, {"--socket", first.socket});
  EXPECT_EQ(second.code, 1) << second.log;
  EXPECT_NE(second.log.find("another specached (pid " + std::to_string(first.child->pid) + ") serves " + first.socket),
            std::string::npos)
      << second.log;
  // The first daemon's sockets and sessions are untouched.
  struct stat st {};
  EXPECT_EQ(stat(first.socket.c_str(), &st), 0);
  EXPECT_EQ(stat((first.socket + ".attach").c_str(), &st), 0);
  EXPECT_TRUE((*session)->CreateSequence({2, 2, 64, 16, 256}).ok());
  auto again = client::Client::Connect({first.socket, std::chrono::milliseconds(3000), "startup-test"});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE((*again)->OpenSession("default", 4 << 20).ok());
}

TEST(StartupTest, BadSettingsEndTheDaemonWithAMessage) {
  testing::TempDir dir;
  const std::string socket = dir.path + "/control.sock";
  auto config = [&](const std::string& name, const std::string& toml) {
    std::ofstream(dir.path + "/" + name) << toml;
    return dir.path + "/" + name;
  };
  const std::string open_dir = dir.path + "/open";  // others may replace a socket there
  std::filesystem::create_directory(open_dir);
  std::filesystem::permissions(open_dir, std::filesystem::perms(0777));
  struct Case {
    const char* what;
    std::vector<std::string> args;
    const char* needle;
  } cases[] = {
      {"socket directory that cannot be created", {"--socket", "/proc/specache-test/control.sock"}, "cannot be created"},
      {"socket directory others may write", {"--socket", open_dir + "/control.sock"}, "writable by its group or others"},
      {"uid beyond uid_t", {"--socket", socket, "--config", config("uid.toml", "[tenants.a]\nusers = [4294968296]\n")},
       "user id 4294968296 is out of range"},
      {"gid -1", {"--socket", socket, "--config", config("gid.toml", "[tenants.a]\ngroups = [-1]\n")},
       "group id -1 is out of range"},
      {"admin uid beyond uid_t",
       {"--socket", socket, "--config", config("admin.toml", "[access]\nadmin_users = [4294967295]\n")},
       "user id 4294967295 is out of range"},
      {"negative lease", {"--socket", socket, "--lease-ms", "-5"}, "--lease-ms -5 is out of range"},
      {"pool larger than the RAM", {"--socket", socket, "--pool-bytes", "64TiB"},
       "is more than the RAM available"},
  };
  for (const Case& c : cases) {
    const Outcome o = RunDaemon(dir.path, c.args);
    EXPECT_EQ(o.code, 1) << c.what << ": " << o.log;
    EXPECT_NE(o.log.find(c.needle), std::string::npos) << c.what << ": " << o.log;
  }
}

// Without CAP_IPC_LOCK (another user), a pool RLIMIT_MEMLOCK cannot lock is an error at startup,
// not a pool that silently runs unlocked.
TEST(StartupTest, APoolLargerThanRlimitMemlockIsRefused) {
  if (!testing::CanSwitchUsers()) GTEST_SKIP() << "needs root and /usr/bin/setpriv to run without CAP_IPC_LOCK";
  testing::TempDir dir;
  // uid 65534 writes its socket there: its own directory (the daemon refuses one others may write).
  ASSERT_EQ(chown(dir.path.c_str(), 65534, 65534), 0);
  chmod(dir.path.c_str(), 0755);
  const Outcome o = RunDaemon(dir.path, {"--socket", dir.path + "/control.sock"},
                              testing::AsUser(65534, 65534, {}, {"/usr/bin/prlimit", "--memlock=1048576", "--"}));
  EXPECT_EQ(o.code, 1) << o.log;
  EXPECT_NE(o.log.find("RLIMIT_MEMLOCK is 1024 KiB"), std::string::npos) << o.log;
  const Outcome unlocked = RunDaemon(dir.path, {"--socket", dir.path + "/control.sock", "--no-lock"},
                                     testing::AsUser(65534, 65534, {}, {"/usr/bin/prlimit", "--memlock=1048576", "--"}),
                                     2000);
  EXPECT_EQ(unlocked.code, -1) << "with --no-lock it serves (stopped after 2 s): " << unlocked.log;
}

}  // namespace
}  // namespace specache
