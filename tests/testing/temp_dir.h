// A fresh directory under /tmp for one test, removed with everything in it when it goes.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>

namespace specache::testing {

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/specache-test-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace specache::testing
