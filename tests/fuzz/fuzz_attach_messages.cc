// Fuzz target: the attach handshake's messages (the daemon parses requests from any local
// process; the client parses replies).
#include <cstdint>
#include <span>

#include "specache/attach_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  (void)specache::attach::ParseRequest(bytes);
  auto reply = specache::attach::ParseReply(bytes);
  if (reply.ok() && reply->code == 0) {
    // A reply accepted as a success is self-consistent.
    if (reply->n_fds > static_cast<uint32_t>(specache::attach::kMaxFdsPerMessage) ||
        reply->first_fd + reply->n_fds > reply->total_fds) {
      __builtin_trap();
    }
  }
  return 0;
}
