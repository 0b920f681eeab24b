// The attach handshake on specached's attach socket (a Unix stream socket next to the gRPC one).
//
//   client -> daemon: AttachRequest (fixed 32 bytes)
//   daemon -> client: AttachReply (fixed size), with SCM_RIGHTS descriptors on success:
//                     the page-table memfd first, then the session's chunk memfds in order
//                     (several messages of at most kMaxFdsPerMessage descriptors, each carrying
//                     one AttachReply with `first_fd` and `n_fds` filled in).
// The session then lives as long as the client keeps this connection open; closing it (exit or
// crash) releases everything the session held.
//
// Both sides parse the other's bytes with Parse*, which reject anything malformed.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "specache/status.h"

namespace specache::attach {

inline constexpr uint32_t kRequestMagic = 0x41435053;  // "SPCA"
inline constexpr uint32_t kReplyMagic = 0x52435053;    // "SPCR"
inline constexpr uint16_t kVersion = 1;
inline constexpr int kMaxFdsPerMessage = 64;
inline constexpr size_t kTokenBytes = 16;

struct AttachRequest {
  uint32_t magic = kRequestMagic;
  uint16_t version = kVersion;
  uint16_t flags = 0;
  uint64_t session_id = 0;
  std::array<uint8_t, kTokenBytes> token{};
};
static_assert(sizeof(AttachRequest) == 32);

struct AttachReply {
  uint32_t magic = kReplyMagic;
  uint16_t version = kVersion;
  uint16_t reserved = 0;
  int32_t code = 0;          // StatusCode; non-zero: no descriptors follow
  uint32_t first_fd = 0;     // index of this message's first descriptor (0 = the page table)
  uint32_t n_fds = 0;        // descriptors attached to this message
  uint32_t total_fds = 0;    // 1 + chunk_count
  uint64_t table_bytes = 0;
  uint64_t chunk_bytes = 0;
  char message[160] = {};    // error text, NUL-terminated
};
static_assert(sizeof(AttachReply) == 200);

// Exact-size parses; errors name what is wrong.
Result<AttachRequest> ParseRequest(std::span<const uint8_t> bytes);
Result<AttachReply> ParseReply(std::span<const uint8_t> bytes);

AttachReply ErrorReply(const Status& status);

}  // namespace specache::attach
