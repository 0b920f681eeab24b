// Fuzz target: the remote data plane's message headers (the daemon parses hellos and row
// requests from any host that reaches its UCX port; the client parses challenges and replies).
#include <cstdint>
#include <span>

#include "specache/remote_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  auto hello = specache::remote::ParseHello(bytes);
  if (hello.ok() && hello->session_id == 0) __builtin_trap();  // accepted hellos name a session
  auto rows = specache::remote::ParseRowsRequest(bytes);
  if (rows.ok() && rows->n > specache::remote::kMaxRowsPerRequest) __builtin_trap();  // bounded
  (void)specache::remote::ParseReply(bytes);
  auto challenge = specache::remote::ParseChallenge(bytes);
  if (challenge.ok() && challenge->reserved != 0) __builtin_trap();  // accepted challenges have no reserved bits
  return 0;
}
