#include "specache/status.h"

#include <gtest/gtest.h>

namespace specache {
namespace {

TEST(StatusTest, CodesMatchGrpcNumbers) {
  EXPECT_EQ(static_cast<int>(StatusCode::kInvalidArgument), 3);
  EXPECT_EQ(static_cast<int>(StatusCode::kResourceExhausted), 8);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 14);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnauthenticated), 16);
  EXPECT_EQ(StatusCodeName(StatusCode::kFailedPrecondition), "FAILED_PRECONDITION");
  EXPECT_EQ(StatusCodeName(static_cast<StatusCode>(42)), "UNKNOWN_CODE(42)");
}

TEST(StatusTest, ToStringAndContext) {
  EXPECT_EQ(Status::Ok().ToString(), "OK");
  const Status s = Status::NotFound("sequence 3");
  EXPECT_EQ(s.ToString(), "NOT_FOUND: sequence 3");
  EXPECT_EQ(s.WithContext("fetch").ToString(), "NOT_FOUND: fetch: sequence 3");
  EXPECT_TRUE(Status::Ok().WithContext("x").ok());
}

Result<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  SPECACHE_ASSIGN_OR_RETURN(int h, Half(x));
  SPECACHE_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusTest, ResultCarriesValueOrStatus) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), StatusCode::kInvalidArgument);
  const Result<int> from_ok = Status::Ok();  // misuse becomes INTERNAL, not an empty value
  EXPECT_EQ(from_ok.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace specache
