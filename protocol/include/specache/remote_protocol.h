// The data plane between a remote client and specached: UCX active messages (AM) on one
// endpoint per session. The control plane stays gRPC (control.proto over TLS); this carries rows.
//
//   daemon -> client, at once on every endpoint it accepts: kChallenge  Challenge (no payload)
//   client -> daemon (AM header, AM payload)            daemon -> client (kReply)
//   kHello   Hello                -                     Reply, payload: RemoteChunk[] + packed
//                                                       remote keys (only with `rma` on)
//   kGather  Gather               int32 tokens[n]       Reply, payload: n rows (server-side gather)
//   kWrite   Write                n rows                Reply
//   kPages   Pages                -                     Reply, payload: shm::PageRef[pages]
//
// The first message on an endpoint must be kHello (the session id and token OpenSession gave,
// and the challenge the daemon sent that endpoint); it takes the session's lease, and the session
// ends when the endpoint closes. Every later request carries the same session id and token: UCX
// tells the daemon which endpoint a message came from by an endpoint id its sender writes into
// the message, so a peer can name another's endpoint. The daemon therefore takes a message on an
// endpoint before its hello only if it is a hello with that endpoint's challenge (which only the
// endpoint's own peer received), and after it only a request whose session and token are those
// the hello bound; others are dropped, counted and logged, and change nothing. Every
// request carries a request id the reply echoes; a reply with a non-zero code carries the error text as
// its payload. Headers are fixed-size plain structs; both sides parse the other's bytes with
// Parse*, which reject anything malformed.
#pragma once

#include <sys/socket.h>

#include <array>
#include <cctype>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "specache/attach_protocol.h"
#include "specache/shm_layout.h"
#include "specache/status.h"

namespace specache::remote {

// The control plane's credentials (gRPC metadata x-specache-tenant and x-specache-secret, over
// TLS) are plain header values: printable ASCII (0x20-0x7e) alone. gRPC aborts the process that
// adds any other byte to such a header, so both sides refuse a tenant or secret with one: the
// daemon when it reads its config, the client before it connects.
inline bool PrintableHeaderValue(std::string_view value) {
  for (const char c : value) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}
// A secret file's bytes as the secret both sides compare: without trailing whitespace (a newline).
inline void DropTrailingSpace(std::string* secret) {
  while (!secret->empty() && std::isspace(static_cast<unsigned char>(secret->back()))) secret->pop_back();
}

inline constexpr uint32_t kMagic = 0x55435053;  // "SPCU"
inline constexpr uint16_t kVersion = 3;  // 2: session id and token in every RowsRequest; 3: the challenge

// AM ids (ucp_worker_set_am_recv_handler).
enum AmId : uint16_t { kHello = 1, kGather = 2, kWrite = 3, kPages = 4, kReply = 10, kChallenge = 11 };

// Most rows in one kGather or kWrite (a layer's worth of a large batch; bounds the daemon's buffer).
inline constexpr uint32_t kMaxRowsPerRequest = 1 << 16;
// The largest row: one token's K and V in fp16 (the larger format) at the largest head_dim (1024,
// ValidatePageLayout). A kWrite of n rows carries at most n times this.
inline constexpr uint32_t kMaxRowBytes = static_cast<uint32_t>(shm::RowBytes(shm::kRowFp16, 1024));

// Random bytes the daemon gives each endpoint it accepts (kChallenge); its hello carries them back.
inline constexpr size_t kChallengeBytes = 16;

struct Challenge {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t reserved = 0;
  std::array<uint8_t, kChallengeBytes> challenge{};
};
static_assert(sizeof(Challenge) == 24);

struct Hello {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t flags = 0;
  uint64_t session_id = 0;
  std::array<uint8_t, attach::kTokenBytes> token{};
  std::array<uint8_t, kChallengeBytes> challenge{};  // the endpoint's (written by the client's endpoint)
};
static_assert(sizeof(Hello) == 48);

// Rows of one (sequence, layer, KV head). In kGather the payload lists n tokens (int32, any
// order); in kWrite it holds n rows from first_token on. session_id and token: the hello's.
struct RowsRequest {
  uint32_t magic = kMagic;
  uint32_t n = 0;
  uint64_t request_id = 0;
  uint64_t sequence = 0;
  uint32_t layer = 0;
  uint32_t kv_head = 0;
  uint32_t first_token = 0;  // kWrite only
  uint32_t reserved = 0;
  uint64_t session_id = 0;
  std::array<uint8_t, attach::kTokenBytes> token{};
};
static_assert(sizeof(RowsRequest) == 64);

struct Reply {
  uint32_t magic = kMagic;
  int32_t code = 0;  // StatusCode
  uint64_t request_id = 0;
};
static_assert(sizeof(Reply) == 16);

// One chunk of the session, for client-side gets (kHello's reply with `rma` on).
struct RemoteChunk {
  uint64_t address = 0;   // the daemon's virtual address of the chunk
  uint64_t bytes = 0;
  uint32_t rkey_bytes = 0;  // packed remote key, after the RemoteChunk array, in chunk order
  uint32_t reserved = 0;
};
static_assert(sizeof(RemoteChunk) == 24);

Result<Hello> ParseHello(std::span<const uint8_t> header);
Result<Challenge> ParseChallenge(std::span<const uint8_t> header);
// A kGather or kWrite header (n within kMaxRowsPerRequest), or kPages (n == 0).
Result<RowsRequest> ParseRowsRequest(std::span<const uint8_t> header);
Result<Reply> ParseReply(std::span<const uint8_t> header);

// "host:port" or "[v6]:port" (numeric or a name getaddrinfo resolves). INVALID_ARGUMENT naming
// the text when it is not one; UNAVAILABLE when the name does not resolve.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};
Result<SocketAddress> ResolveAddress(const std::string& host_port);
// Every IPv4 and IPv6 address it resolves to, in getaddrinfo's order, without repeats (at least one).
Result<std::vector<SocketAddress>> ResolveAddresses(const std::string& host_port);
// The host and port of "host:port" / "[v6]:port" (brackets removed), without resolving.
Result<std::pair<std::string, uint16_t>> SplitHostPort(const std::string& host_port);

}  // namespace specache::remote
