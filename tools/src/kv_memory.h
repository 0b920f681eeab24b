// Where specache-run keeps the full-precision KV: pages of a specached (the one at --daemon, or
// one embedded in this process: same code, own temporary socket), or plain process memory
// (--kv-memory process, for comparisons and builds without the service).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "specache/full_precision_source.h"
#include "specache/status.h"

namespace specache::run {

struct KvMemoryOptions {
  std::string where = "embedded";  // "embedded", "daemon" (needs socket) or "process"
  std::string socket;
  std::string tenant = "default";
  uint64_t session_bytes = 0;      // memory to reserve in the daemon for this run
  uint32_t page_tokens = 64;
  uint32_t capacity_tokens = 8192;  // per sequence
};

class KvMemory {
 public:
  // UNIMPLEMENTED for daemon modes in a build without the service; UNAVAILABLE when the daemon
  // cannot be reached.
  static Result<std::unique_ptr<KvMemory>> Open(const KvMemoryOptions& options);
  virtual ~KvMemory() = default;
  // A source for one agent (its sequences are released when the agent goes, and any left when the
  // source goes).
  virtual Result<std::unique_ptr<FullPrecisionSource>> NewSource() = 0;
  // Where the KV lives and what it cost: "kv_memory", "extend_rpcs", daemon pool figures.
  virtual nlohmann::json Figures() const = 0;
  // Leaves the sequence in the daemon after this process ends (kept for the tenant, restorable);
  // returns the daemon's sequence id. `source` must come from NewSource. FAILED_PRECONDITION
  // unless the memory is a running specached (--daemon).
  virtual Result<uint64_t> KeepSequence(FullPrecisionSource* source, SequenceId id) = 0;
};

}  // namespace specache::run
