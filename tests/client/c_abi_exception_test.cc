// The C ABI (client_c.h) never lets a C++ exception out to its caller, which may be C (where
// unwinding through its frames is undefined) or another language's FFI: an allocation that fails
// inside a call comes back as RESOURCE_EXHAUSTED with its message, and the call's out-parameter
// stays as it was. This binary replaces the global operator new so that a test can make the next
// allocation on its thread fail; unarmed, it is malloc.
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include <gtest/gtest.h>

#include "specache/client_c.h"
#include "specache/status.h"

namespace {
thread_local int allocations_before_failure = -1;  // -1: none fails
}  // namespace

void* operator new(std::size_t n) {
  if (allocations_before_failure >= 0 && allocations_before_failure-- == 0) throw std::bad_alloc();
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace specache {
namespace {

TEST(ClientCAbiExceptionTest, AFailedAllocationInsideACallComesBackAsAStatusNotAnException) {
  char err[128] = "untouched";
  specache_client* client = nullptr;
  int rc = -1;
  allocations_before_failure = 0;  // the call's first allocation (its options' strings)
  EXPECT_NO_THROW(rc = specache_client_connect("/nonexistent/specache-test/control.sock", 50, &client, err, sizeof err));
  allocations_before_failure = -1;
  EXPECT_EQ(rc, static_cast<int>(StatusCode::kResourceExhausted));
  EXPECT_STREQ(err, "RESOURCE_EXHAUSTED: out of memory");
  EXPECT_EQ(client, nullptr);
  // The message is cut to the caller's buffer, NUL-terminated.
  char small[12];
  allocations_before_failure = 0;
  EXPECT_NO_THROW(rc = specache_client_connect("/nonexistent/specache-test/control.sock", 50, &client, small, sizeof small));
  allocations_before_failure = -1;
  EXPECT_EQ(rc, static_cast<int>(StatusCode::kResourceExhausted));
  EXPECT_STREQ(small, "RESOURCE_EX");
}

TEST(ClientCAbiExceptionTest, WithMemoryTheSameCallFailsOnlyForTheMissingDaemon) {
  char err[256] = {};
  specache_client* client = nullptr;
  EXPECT_EQ(specache_client_connect("/nonexistent/specache-test/control.sock", 50, &client, err, sizeof err),
            static_cast<int>(StatusCode::kUnavailable));
  EXPECT_NE(std::string(err).find("no specached"), std::string::npos) << err;
  EXPECT_EQ(client, nullptr);
}

}  // namespace
}  // namespace specache
