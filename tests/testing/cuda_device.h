// The device check of the CUDA tests (label `gpu`). A test that needs a device skips without one,
// so that `ctest -L gpu` can run anywhere; on a machine meant to have one, SPECACHE_REQUIRE_GPU=1
// turns that skip into a failure, so a missing or broken device cannot pass as "all tests passed".
#pragma once

#include <cstdlib>
#include <string_view>

#include <gtest/gtest.h>

#include "specache/device_probe.h"

// Skips the current test without a usable CUDA device, or fails it under SPECACHE_REQUIRE_GPU.
#define SPECACHE_REQUIRE_CUDA_DEVICE()                                                               \
  do {                                                                                               \
    const auto specache_probe = ::specache::ProbeCudaDevice();                                       \
    if (!specache_probe.ok()) {                                                                      \
      if (const char* required = std::getenv("SPECACHE_REQUIRE_GPU"); required && *required &&       \
                                                                      std::string_view(required) != "0") { \
        FAIL() << "no usable CUDA device (SPECACHE_REQUIRE_GPU is set): " << specache_probe.status().ToString(); \
      }                                                                                              \
      GTEST_SKIP() << "no usable CUDA device: " << specache_probe.status().ToString();               \
    }                                                                                                \
  } while (0)
