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

// EnsureSocketDirectory(socket) with the process's umask at `mask` meanwhile.
Status EnsureUnderUmask(mode_t mask, const std::string& socket) {
  const mode_t before = ::umask(mask);
  const Status made = EnsureSocketDirectory(socket);
  ::umask(before);
  return made;
}

// The directory and its missing parents get the daemon's mode, whatever the umask: under umask 0
// a parent (`run`) was left 0777, so any local user could rename `run/specache` away and put a
// directory of their own (and their own control.sock) in its place; under 077 clients could not
// search it.
TEST(SocketDirectoryTest, AMissingDirectoryIsCreated0755WhateverTheUmask) {
  testing::TempDir tmp;
  const Status made = EnsureUnderUmask(0, tmp.path + "/run/specache/control.sock");
  ASSERT_TRUE(made.ok()) << made.ToString();
  EXPECT_EQ(ModeOf(tmp.path + "/run/specache"), 0755u);
  EXPECT_EQ(ModeOf(tmp.path + "/run"), 0755u) << std::oct << ModeOf(tmp.path + "/run");
  EXPECT_TRUE(EnsureSocketDirectory(tmp.path + "/run/specache/control.sock").ok()) << "an existing one passes";
  const Status again = EnsureUnderUmask(077, tmp.path + "/other/specache/control.sock");
  ASSERT_TRUE(again.ok()) << again.ToString();
  EXPECT_EQ(ModeOf(tmp.path + "/other"), 0755u);
  EXPECT_EQ(ModeOf(tmp.path + "/other/specache"), 0755u);
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

}  // namespace
}  // namespace specache::daemon
