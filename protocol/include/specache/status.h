// Status and Result<T>: the one error type of every specache library.
//
// Codes are numerically identical to gRPC's (grpc::StatusCode), so the control plane maps them
// one to one and a client sees the same code whether an error came from its own process or from
// the daemon. No exception crosses a library or thread boundary: every fallible call returns a
// Status or a Result<T>.
//
// Thread safety: Status and Result are values; distinct objects may be used from distinct threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace specache {

// Same numbers as grpc::StatusCode and google.rpc.Code.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// Upper-case gRPC spelling, e.g. "INVALID_ARGUMENT"; "UNKNOWN_CODE(n)" for numbers outside the enum.
std::string StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status AlreadyExists(std::string msg) { return {StatusCode::kAlreadyExists, std::move(msg)}; }
  static Status PermissionDenied(std::string msg) { return {StatusCode::kPermissionDenied, std::move(msg)}; }
  static Status ResourceExhausted(std::string msg) { return {StatusCode::kResourceExhausted, std::move(msg)}; }
  static Status FailedPrecondition(std::string msg) { return {StatusCode::kFailedPrecondition, std::move(msg)}; }
  static Status OutOfRange(std::string msg) { return {StatusCode::kOutOfRange, std::move(msg)}; }
  static Status Unimplemented(std::string msg) { return {StatusCode::kUnimplemented, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
  static Status DataLoss(std::string msg) { return {StatusCode::kDataLoss, std::move(msg)}; }
  static Status DeadlineExceeded(std::string msg) { return {StatusCode::kDeadlineExceeded, std::move(msg)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "OK", or "CODE_NAME: message".
  std::string ToString() const;

  // Returns a copy whose message is "context: message" (OK stays OK). For adding the caller's
  // view of what failed without losing the code.
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a value or a non-OK Status. Constructing a Result from an OK Status is a programming
// error; it is turned into an INTERNAL error instead of an undefined state.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : state_(std::move(status)) {  // NOLINT: implicit by design
    if (std::get<Status>(state_).ok()) {
      state_ = Status::Internal("Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(state_); }
  // OK when a value is held.
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(state_); }

  // Precondition: ok().
  T& value() & { return std::get<T>(state_); }
  const T& value() const& { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> state_;
};

}  // namespace specache

// Early return of a non-OK Status from a function returning Status or Result<T>.
#define SPECACHE_RETURN_IF_ERROR(expr)                 \
  do {                                                 \
    ::specache::Status specache_status_ = (expr);      \
    if (!specache_status_.ok()) return specache_status_; \
  } while (0)

#define SPECACHE_CONCAT_INNER_(a, b) a##b
#define SPECACHE_CONCAT_(a, b) SPECACHE_CONCAT_INNER_(a, b)

// `SPECACHE_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from an OK Result or returns its Status.
#define SPECACHE_ASSIGN_OR_RETURN(lhs, rexpr)                                   \
  auto SPECACHE_CONCAT_(specache_result_, __LINE__) = (rexpr);                  \
  if (!SPECACHE_CONCAT_(specache_result_, __LINE__).ok())                       \
    return SPECACHE_CONCAT_(specache_result_, __LINE__).status();               \
  lhs = std::move(SPECACHE_CONCAT_(specache_result_, __LINE__)).value()
