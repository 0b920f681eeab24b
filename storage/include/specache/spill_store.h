// The NVMe tier of the daemon: whole sequences' pages in RocksDB, each page with an xxh64
// checksum, plus a metadata record per sequence from which a restarted daemon rebuilds its index.
//
// Keys (ordered so one tenant's records are contiguous):
//   "m" tenant "\0" id(16 hex)                         -> sequence metadata (versioned binary)
//   "p" tenant "\0" id(16 hex) layer(8 hex) page(8 hex) -> [xxh64 of the page: 8 bytes][page bytes]
// A sequence is stored when its metadata is: pages are written first, the metadata last, so a
// crash or a failed write leaves only pages without metadata, which Open() deletes.
//
// Thread safety: every method may be called from any thread (RocksDB is thread-safe; the
// counters are atomic).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "specache/session_pages.h"
#include "specache/status.h"

namespace rocksdb {
class DB;
}

namespace specache {

struct SpillOptions {
  std::string dir;             // created if missing
  uint64_t max_bytes = 0;      // page bytes the tier may hold; 0: no limit but the disk's
  bool compression = false;    // LZ4 on values (fp16 KV compresses poorly: measure first)
};

struct SpilledSequence {
  std::string tenant;
  uint64_t id = 0;
  PageLayout layout;
  uint32_t pages_per_layer = 0;
  uint64_t fingerprint = 0;  // of the layout: a restore must ask for the same one
  int64_t spilled_unix_ms = 0;
  uint64_t bytes() const { return uint64_t{layout.n_layers} * pages_per_layer * layout.page_bytes(); }
};

// The fingerprint of a page layout (xxh64 of its fields).
uint64_t LayoutFingerprint(const PageLayout& layout);

struct SpillVerifyReport {
  uint64_t sequences = 0, pages_checked = 0, pages_bad = 0;
  std::vector<std::string> bad;  // "tenant/sequence/layer/page: why"
};

struct SpillStats {
  uint64_t stored_bytes = 0, sequences = 0;
  uint64_t spills = 0, restores = 0, spilled_bytes_total = 0, restored_bytes_total = 0;
  uint64_t checksum_failures = 0, write_errors = 0;
  double spill_seconds = 0, restore_seconds = 0;
};

class SpillStore {
 public:
  // Opens (or creates) the store and rebuilds the index from the metadata records, deleting
  // pages no metadata claims. UNAVAILABLE with RocksDB's reason when the directory is unusable.
  static Result<std::unique_ptr<SpillStore>> Open(const SpillOptions& options);
  ~SpillStore();
  SpillStore(const SpillStore&) = delete;
  SpillStore& operator=(const SpillStore&) = delete;

  // Stores a sequence: page(layer, p) gives the bytes of each page (layout.page_bytes() each).
  // ALREADY_EXISTS if stored; RESOURCE_EXHAUSTED over max_bytes; UNAVAILABLE on a write error
  // (disk full, I/O error), after which nothing of the sequence is stored. The caller's copy
  // stays the only one until this returns OK.
  Status Put(const SpilledSequence& meta, const std::function<const uint8_t*(uint32_t layer, uint32_t page)>& page);
  // Reads a stored sequence into out(layer, p), verifying every page first: DATA_LOSS naming
  // the page (and counted) on a checksum or size mismatch, NOT_FOUND if not stored. `out` is
  // called from several threads at once (for distinct pages).
  Status Get(const std::string& tenant, uint64_t id, const std::function<uint8_t*(uint32_t layer, uint32_t page)>& out);
  Status Delete(const std::string& tenant, uint64_t id);

  Result<SpilledSequence> Find(const std::string& tenant, uint64_t id) const;
  // Stored sequences of one tenant, or of all ("" = all), by id.
  std::vector<SpilledSequence> List(const std::string& tenant = "") const;
  // Reads and checks every stored page.
  SpillVerifyReport Verify();
  SpillStats stats() const;
  uint64_t max_id() const;  // the largest stored sequence id (0 if none)
  const std::string& dir() const { return options_.dir; }

 private:
  explicit SpillStore(const SpillOptions& options);
  Status Load();
  // Reads and checks layers [first_layer, end_layer) of a stored sequence.
  Status ReadLayers(const SpilledSequence& meta, uint32_t first_layer, uint32_t end_layer,
                    const std::function<uint8_t*(uint32_t, uint32_t)>& out);

  SpillOptions options_;
  std::unique_ptr<rocksdb::DB> db_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, uint64_t>, SpilledSequence> index_;  // (tenant, id): stored sequences
  std::atomic<uint64_t> stored_bytes_{0}, spills_{0}, restores_{0}, spilled_total_{0}, restored_total_{0};
  std::atomic<uint64_t> checksum_failures_{0}, write_errors_{0};
  std::atomic<uint64_t> spill_ns_{0}, restore_ns_{0};
};

}  // namespace specache
