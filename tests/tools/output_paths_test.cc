// Output paths are prepared before any work: missing directories are created, and a directory
// the process may not write into is an immediate, named error (checked as uid 65534 in a child,
// since root may write anywhere).
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include <gtest/gtest.h>

#include "output_paths.h"
#include "testing/temp_dir.h"

namespace specache {
namespace {

TEST(OutputPathsTest, CreatesMissingDirectoriesAndLeavesNothingBehind) {
  testing::TempDir dir;
  const std::string out = dir.path + "/a/b/c";
  ASSERT_TRUE(PrepareOutputDir(out).ok());
  EXPECT_TRUE(std::filesystem::is_directory(out));
  EXPECT_TRUE(std::filesystem::is_empty(out));  // the write check's file is gone
  ASSERT_TRUE(PrepareOutputFile(dir.path + "/x/y/result.json").ok());
  EXPECT_TRUE(std::filesystem::is_directory(dir.path + "/x/y"));
  EXPECT_FALSE(std::filesystem::exists(dir.path + "/x/y/result.json"));  // not created yet
}

TEST(OutputPathsTest, KeepsAnExistingFileAsItIs) {
  testing::TempDir dir;
  const std::string file = dir.path + "/old.json";
  std::ofstream(file) << "kept";
  ASSERT_TRUE(PrepareOutputFile(file).ok());
  std::ifstream in(file);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "kept");
}

TEST(OutputPathsTest, NamesAFileInTheWayOfADirectoryAndADirectoryInTheWayOfAFile) {
  testing::TempDir dir;
  std::ofstream(dir.path + "/plain") << "x";
  const Status under_file = PrepareOutputDir(dir.path + "/plain/sub");
  EXPECT_FALSE(under_file.ok());
  EXPECT_NE(under_file.message().find(dir.path + "/plain/sub"), std::string::npos) << under_file.ToString();
  const Status is_dir = PrepareOutputFile(dir.path);
  EXPECT_EQ(is_dir.code(), StatusCode::kFailedPrecondition) << is_dir.ToString();
}

// Runs `fn` as uid/gid 65534 in a child; its StatusCode is the exit status.
int AsNobody(const std::function<Status()>& fn) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(65534) != 0 || setuid(65534) != 0) _exit(100);
    _exit(static_cast<int>(fn().code()));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(OutputPathsTest, AnotherUsersDirectoryIsPermissionDenied) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as uid 65534";
  testing::TempDir dir;
  chmod(dir.path.c_str(), 0755);  // others may enter, not write
  const std::string locked = dir.path + "/locked";
  ASSERT_EQ(mkdir(locked.c_str(), 0755), 0);
  EXPECT_EQ(AsNobody([&] { return PrepareOutputDir(locked); }), static_cast<int>(StatusCode::kPermissionDenied));
  EXPECT_EQ(AsNobody([&] { return PrepareOutputDir(locked + "/new"); }), static_cast<int>(StatusCode::kPermissionDenied));
  EXPECT_EQ(AsNobody([&] { return PrepareOutputFile(locked + "/r.json"); }),
            static_cast<int>(StatusCode::kPermissionDenied));
  std::ofstream(locked + "/theirs.json") << "x";
  chmod((locked + "/theirs.json").c_str(), 0644);
  EXPECT_EQ(AsNobody([&] { return PrepareOutputFile(locked + "/theirs.json"); }),
            static_cast<int>(StatusCode::kPermissionDenied));
}

}  // namespace
}  // namespace specache
