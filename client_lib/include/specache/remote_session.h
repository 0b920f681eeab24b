// A session on a daemon on another host. The control calls (open, sequences, extend) go over the
// client's TLS channel (Client::Connect with "tcp://HOST:PORT"); rows travel over UCX to the
// daemon's data-plane listener, which OpenSession names.
//
//   auto client = specache::client::Client::Connect({"tcp://kv-host:7700"});   // credentials: env
//   auto session = specache::client::RemoteSession::Open(client->get(), "default", 1ull << 30);
//   auto seq = (*session)->CreateSequence({layers, kv_heads, head_dim, 64, 8192});
//   (*session)->Extend(*seq, 64);
//   (*session)->WriteRows(*seq, layer, head, 0, rows, 64 * row_bytes);
//   (*session)->ReadRows(*seq, layer, head, tokens, out);
//
// Two ways to fetch rows (docs/remote.md has the measurements):
//   - kServerGather (the default): the row list goes to the daemon in one message; the daemon
//     checks it, packs the rows and answers with one reply. One round trip per (layer, head).
//   - kClientGets: the client reads the pages itself with UCX gets, one per run of consecutive
//     rows, into a registered staging buffer. Needs `rma = true` at the daemon (remote keys),
//     which is for trusted fabrics only (UCX's software RMA over TCP/shm checks no key).
//
// Deadlines: every call has one (RemoteSessionOptions::deadline for the data plane, the client's
// for the control plane). A daemon that dies gives UNAVAILABLE as soon as UCX sees the connection
// break, one that stops answering DEADLINE_EXCEEDED at the deadline; either way the session is
// over (Alive() is false) and a new one can be opened once the daemon is back. Nothing here ends
// the process.
//
// Thread safety: calls on distinct (sequence, layer, head) triples may run concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "specache/client.h"

namespace specache::client {

enum class FetchMethod { kServerGather, kClientGets };
SPECACHE_CLIENT_API const char* FetchMethodName(FetchMethod method);  // "gather", "gets"
SPECACHE_CLIENT_API Result<FetchMethod> ParseFetchMethod(const std::string& name);

struct RemoteSessionOptions {
  FetchMethod method = FetchMethod::kServerGather;
  std::chrono::milliseconds deadline{2000};  // every data-plane request
};

struct RemoteStats {
  uint64_t requests = 0;      // data-plane requests sent
  uint64_t gets = 0;          // UCX gets issued (kClientGets)
  uint64_t rows_read = 0, rows_written = 0;
};

class SPECACHE_CLIENT_API RemoteSession {
 public:
  // Opens a session of `tenant` on the daemon `client` is connected to (a tcp:// one; the
  // tenant must be the one the client's secret is for) and attaches to it over UCX.
  static Result<std::unique_ptr<RemoteSession>> Open(Client* client, const std::string& tenant, uint64_t pool_bytes,
                                                     const RemoteSessionOptions& options = {});
  ~RemoteSession();  // closes the session: everything it held returns to the daemon

  uint64_t id() const;
  const RemoteSessionOptions& options() const;
  std::string data_address() const;  // the UCX listener this session attached to

  Result<uint64_t> CreateSequence(const PageLayoutSpec& layout);
  // Makes room for tokens [0, tokens) at every layer; returns pages per layer.
  Result<uint32_t> Extend(uint64_t sequence, uint32_t tokens);
  Status Release(uint64_t sequence);
  Status Keep(uint64_t sequence);

  // Writes whole rows ([n][row bytes]) from first_token on into (sequence, layer, kv_head); the
  // pages must exist (Extend).
  Status WriteRows(uint64_t sequence, uint32_t layer, uint32_t kv_head, uint32_t first_token, const void* rows,
                   size_t bytes);
  // The rows of `tokens` (any order) into out ([n][row bytes], in list order), by the session's
  // method or the one given.
  Status ReadRows(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens, void* out);
  Status ReadRows(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens, void* out,
                  FetchMethod method);
  // The server-side gather in two halves, so a caller can overlap it with other work: Start sends
  // the row list and returns at once; WaitRead waits for the rows (out must stay valid until then).
  // The daemon closes an endpoint with 1024 requests unanswered or 1024 replies not taken, or
  // whose replies none were taken for 30 s: wait for reads before starting that many.
  Result<uint64_t> StartRead(uint64_t sequence, uint32_t layer, uint32_t kv_head, std::span<const int32_t> tokens,
                             void* out);
  Status WaitRead(uint64_t read);

  // False once the data-plane connection broke or missed a deadline.
  bool Alive() const;
  RemoteStats stats() const;

  struct Impl;

 private:
  explicit RemoteSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specache::client
