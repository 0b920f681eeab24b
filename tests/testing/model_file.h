// The real model for integration tests: $SPECACHE_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf
// in the source tree (tools/fetch-model.sh puts it there). Tests skip without it, unless
// SPECACHE_REQUIRE_MODEL is set (CI sets it), when they fail instead.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

namespace specache::testing {

inline std::string ModelPath() {
  if (const char* env = std::getenv("SPECACHE_MODEL")) return env;
  return std::string(SPECACHE_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// A file of the source tree: $SPECACHE_SOURCE_DIR at run time (a test binary carried to another
// machine, tools/gpu-bundle), else the tree it was built from.
inline std::string SourcePath(const std::string& relative) {
  if (const char* env = std::getenv("SPECACHE_SOURCE_DIR")) return std::string(env) + "/" + relative;
  return std::string(SPECACHE_SOURCE_DIR) + "/" + relative;
}

}  // namespace specache::testing

// Skips (or fails, under SPECACHE_REQUIRE_MODEL) the current test when the model is absent.
#define SPECACHE_REQUIRE_MODEL_FILE()                                                              \
  do {                                                                                             \
    if (!std::filesystem::exists(::specache::testing::ModelPath())) {                              \
      if (std::getenv("SPECACHE_REQUIRE_MODEL")) {                                                 \
        FAIL() << "model missing: " << ::specache::testing::ModelPath() << " (tools/fetch-model.sh)"; \
      }                                                                                            \
      GTEST_SKIP() << "model missing: " << ::specache::testing::ModelPath() << " (tools/fetch-model.sh)"; \
    }                                                                                              \
  } while (0)
