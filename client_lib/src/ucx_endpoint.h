// The client's end of the remote data plane (remote_protocol.h): one UCX worker and one endpoint
// to the daemon's listener, requests matched to replies by id, every wait bounded by a deadline.
//
// Failure: when UCX reports the endpoint broken (the daemon died, the network went), every
// request in flight and every later one fails with UNAVAILABLE at once; a daemon that stops
// answering without the connection breaking gives DEADLINE_EXCEEDED at the deadline. Nothing
// here ends the process.
//
// Thread safety: all methods may be called from several threads (one mutex around the worker;
// waiting threads take turns progressing it).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "specache/remote_protocol.h"
#include "specache/status.h"

namespace specache::client {

using Deadline = std::chrono::steady_clock::time_point;

class UcxEndpoint {
 public:
  // Creates the worker and the endpoint to "host:port": the connection is made as the first
  // request's Wait progresses the worker, and the daemon then sends the endpoint its challenge.
  // `rma` adds the RMA feature, for client-side gets.
  static Result<std::unique_ptr<UcxEndpoint>> Connect(const std::string& address, bool rma);
  ~UcxEndpoint();

  // Sends one request (AM `id`, header, payload) and returns its id; the reply's payload will be
  // written to `out` (at most out_capacity bytes; a longer reply is DATA_LOSS). The header's
  // request id field is set here for RowsRequest headers (kGather, kWrite, kPages). A kHello is
  // sent once the daemon's challenge came, written into its header here (its payload must stay
  // valid until its Wait returns).
  Result<uint64_t> Start(remote::AmId id, const void* header, size_t header_bytes, const void* payload,
                         size_t payload_bytes, void* out, size_t out_capacity);
  // Waits for a started request: the reply's status (the daemon's refusal, with its message), and
  // the payload bytes received. A request given up at its deadline is cancelled.
  Status Wait(uint64_t request, Deadline deadline, size_t* out_bytes = nullptr);
  Status Call(remote::AmId id, const void* header, size_t header_bytes, const void* payload, size_t payload_bytes,
              std::vector<uint8_t>* out, size_t out_capacity, Deadline deadline);

  // ---- Client-side gets (the daemon handed out keys: rma = true on both sides).
  // Unpacks the hello reply's chunk table and keys; chunk i is then readable with Get.
  Status SetRemoteChunks(const std::vector<uint8_t>& hello_payload);
  size_t remote_chunks() const;
  // Registers [base, base + bytes) as the staging buffer gets land in.
  Status RegisterStaging(void* base, size_t bytes);
  // Starts a get of `bytes` at `offset` of remote chunk `chunk` into local memory (inside the
  // staging buffer); WaitGets waits for all started gets.
  Status Get(uint32_t chunk, uint64_t offset, void* local, size_t bytes);
  Status WaitGets(Deadline deadline);

  bool failed() const;
  uint64_t gets_issued() const;

  struct Impl;

 private:
  explicit UcxEndpoint(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specache::client
