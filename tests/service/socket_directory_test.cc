// The daemon's sockets live in a directory nobody else may write: EnsureSocketDirectory creates a
// missing one 0755 whatever the umask, and refuses one that another user owns or that its group
// or others may write without the sticky bit (they could replace the sockets or the lock file).
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "testing/temp_dir.h"
#include "unix_listener.h"

namespace specache::daemon {
namespace {

uint32_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST(SocketDirectoryTest, AMissingDirectoryIsCreated0755WhateverTheUmask) {
  testing::TempDir tmp;
  const mode_t before = ::umask(0);
  const Status made = EnsureSocketDirectory(tmp.path + "/run/specache/control.sock");
  ::umask(before);
  ASSERT_TRUE(made.ok()) << made.ToString();
  EXPECT_EQ(ModeOf(tmp.path + "/run/specache"), 0755u);
  EXPECT_TRUE(EnsureSocketDirectory(tmp.path + "/run/specache/control.sock").ok()) << "an existing one passes";
}

TEST(SocketDirectoryTest, ADirectoryOthersMayWriteIsRefused) {
  testing::TempDir tmp;
  for (const uint32_t mode : {0777u, 0770u, 0757u}) {
    std::filesystem::permissions(tmp.path, std::filesystem::perms(mode));
    const Status s = EnsureSocketDirectory(tmp.path + "/control.sock");
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << std::oct << mode;
    EXPECT_NE(s.message().find("writable by its group or others"), std::string::npos) << s.ToString();
  }
  // With the sticky bit (as /tmp) nobody may remove or rename another's files.
  std::filesystem::permissions(tmp.path, std::filesystem::perms(01777));
  EXPECT_TRUE(EnsureSocketDirectory(tmp.path + "/control.sock").ok());
  std::filesystem::permissions(tmp.path, std::filesystem::perms(0700));
  EXPECT_TRUE(EnsureSocketDirectory(tmp.path + "/control.sock").ok());
}

TEST(SocketDirectoryTest, AFileInsteadOfTheDirectoryIsRefused) {
  testing::TempDir tmp;
  std::ofstream(tmp.path + "/not-a-dir") << "x";
  const Status s = EnsureSocketDirectory(tmp.path + "/not-a-dir/control.sock");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("not-a-dir"), std::string::npos) << s.ToString();
}

TEST(SocketDirectoryTest, ADirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to give the directory to another user";
  testing::TempDir tmp;
  const std::string dir = tmp.path + "/theirs";
  std::filesystem::create_directory(dir);
  std::filesystem::permissions(dir, std::filesystem::perms(0755));
  ASSERT_EQ(::chown(dir.c_str(), 65534, 65534), 0);
  const Status s = EnsureSocketDirectory(dir + "/control.sock");
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
  EXPECT_NE(s.message().find("belongs to user 65534"), std::string::npos) << s.ToString();
}

// The missing parents of the socket directory get the daemon's mode too, whatever the umask:
// under umask 0 `run` was left 0777, so any local user could rename `run/specache` away and put a
// directory of their own (and their own control.sock) in its place.
TEST(SocketDirectoryTest, MissingParentsAreNotLeftWritableByOthers) {
  testing::TempDir tmp;
  const mode_t before = ::umask(0);
  const Status made = EnsureSocketDirectory(tmp.path + "/run/specache/control.sock");
  ::umask(before);
  ASSERT_TRUE(made.ok()) << made.ToString();
  EXPECT_EQ(ModeOf(tmp.path + "/run") & 07777u, 0755u) << std::oct << ModeOf(tmp.path + "/run");
  EXPECT_EQ(ModeOf(tmp.path + "/run/specache") & 07777u, 0755u);
  // Under a umask that leaves clients no search permission, the directories still admit them.
  const mode_t tight = ::umask(077);
  const Status again = EnsureSocketDirectory(tmp.path + "/other/specache/control.sock");
  ::umask(tight);
  ASSERT_TRUE(again.ok()) << again.ToString();
  EXPECT_EQ(ModeOf(tmp.path + "/other") & 07777u, 0755u);
}

}  // namespace
}  // namespace specache::daemon
