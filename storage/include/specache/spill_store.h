// The NVMe tier of the daemon: whole sequences' pages in RocksDB, each page with an xxh64
// checksum, plus a metadata record per sequence from which a restarted daemon rebuilds its index.
//
// Keys (ordered so one tenant's records are contiguous):
//   "m" tenant "\0" id(16 hex)                         -> sequence metadata (versioned binary)
//   "p" tenant "\0" id(16 hex) layer(8 hex) page(8 hex) -> [xxh64 of the page: 8 bytes][page bytes]
//   "i" tenant "\0" id(16 hex)                         -> metadata of a spill under way
//   "d" tenant "\0" id(16 hex)                         -> why a sequence is damaged (text)
// A catalog file next to RocksDB's ("specache-catalog": one checksummed line per stored or
// deleted sequence, fsynced) names every stored sequence independently of RocksDB's WAL and
// SSTs: damage that takes a sequence's records out of RocksDB cannot also take its name.
// A sequence is stored when its metadata is: an intent record is written first, then the pages,
// then the metadata (deleting the intent) in the last, synced write. After a clean shutdown or a
// crash, an intent without metadata is a spill that did not finish: Open() deletes it and its
// pages. After a recovery that had to drop corrupted records (a damaged WAL, an unreadable SST
// block), nothing unexplained is deleted: such sequences become damaged records ("d"), reported by
// problems() and every Verify() until evicted (DeleteDamaged).
//
// Files: the directory is made 0700 and every file RocksDB creates in it 0600, whatever the
// process umask (page data is tenants' data).
//
// Thread safety: every method may be called from any thread (RocksDB is thread-safe; the
// counters are atomic). The DB handle is replaced only to reopen it after a write error, which
// waits for the calls using it: a call holds it for its own records (Put, Get, Delete) or, in
// Verify, for one read at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "specache/session_pages.h"
#include "specache/status.h"

namespace rocksdb {
class DB;
class Env;
class FileSystem;
struct Options;
class Status;
}

namespace specache {

struct SpillOptions {
  std::string dir;             // created if missing
  uint64_t max_bytes = 0;      // page bytes the tier may hold; 0: no limit but the disk's
  bool compression = false;    // LZ4 on values (fp16 KV compresses poorly: measure first)
  // Where the files are read and written: null for the local file system (tests put one that
  // fails or slows reads and writes on demand here).
  std::shared_ptr<rocksdb::FileSystem> file_system = nullptr;
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

// The fingerprint of a page layout (xxh64 of its fields; of all but the row format for fp16 rows).
uint64_t LayoutFingerprint(const PageLayout& layout);

struct SpillVerifyReport {
  uint64_t sequences = 0, pages_checked = 0, pages_bad = 0;
  // "tenant/sequence/layer/page: why" for pages; "tenant/sequence: why" for damaged sequences;
  // "spill store: why" for records that could not be read at all.
  std::vector<std::string> bad;
};

struct SpillStats {
  uint64_t stored_bytes = 0, sequences = 0;
  uint64_t spills = 0, restores = 0, spilled_bytes_total = 0, restored_bytes_total = 0;
  uint64_t checksum_failures = 0;   // pages that did not check out: checksum, size, missing, corrupted
  uint64_t read_errors = 0;         // page reads that failed (an I/O error): nothing known of the page
  uint64_t write_errors = 0;
  uint64_t unreadable_records = 0;  // records Open() or Verify() could not read (problems()), each once
  uint64_t damaged_sequences = 0;   // sequences whose records were lost or unreadable
  uint64_t resumes = 0;             // times the store was reopened after a write error
  double spill_seconds = 0, restore_seconds = 0;
};

class SpillStore {
 public:
  // Opens (or creates) the store and rebuilds the index from the metadata records, deleting
  // unfinished spills. UNAVAILABLE with RocksDB's reason when the directory is unusable. A
  // corrupted WAL does not stop it: the WAL is copied to "wal-corrupted-<unix ms>/" in the
  // directory, every record that can still be read is recovered, and what was lost is reported
  // by problems(). Any read error while rebuilding the index is reported the same way, and
  // nothing is deleted in that case.
  static Result<std::unique_ptr<SpillStore>> Open(const SpillOptions& options);
  ~SpillStore();
  SpillStore(const SpillStore&) = delete;
  SpillStore& operator=(const SpillStore&) = delete;

  // Stores a sequence: page(layer, p) gives the bytes of each page (layout.page_bytes() each).
  // ALREADY_EXISTS if stored; RESOURCE_EXHAUSTED over max_bytes or on a full disk; UNAVAILABLE
  // on another write error (I/O error), after which nothing of the sequence is stored. The
  // caller's copy stays the only one until this returns OK. After a write error the next Put
  // reopens the store first (and fails if that fails, e.g. while the disk is still full).
  Status Put(const SpilledSequence& meta, const std::function<const uint8_t*(uint32_t layer, uint32_t page)>& page);
  // Reads a stored sequence into out(layer, p), verifying every page first: DATA_LOSS naming
  // the page (and counted as a checksum failure) on a checksum or size mismatch or a missing
  // page, UNAVAILABLE (counted as a read error) when a page cannot be read, NOT_FOUND if not
  // stored. `out` is called from several threads at once (for distinct pages).
  Status Get(const std::string& tenant, uint64_t id, const std::function<uint8_t*(uint32_t layer, uint32_t page)>& out);
  Status Delete(const std::string& tenant, uint64_t id);

  Result<SpilledSequence> Find(const std::string& tenant, uint64_t id) const;
  // Stored sequences of one tenant, or of all ("" = all), by id.
  std::vector<SpilledSequence> List(const std::string& tenant = "") const;
  // Reads and checks every stored page from the files on disk: the memtable is flushed first and
  // the store keeps no block cache, so every page comes from its SST file (RocksDB's block
  // checksum and the page's xxh64 both checked). Damaged sequences and records that cannot be
  // read are listed in `bad` too; a record first found unreadable here is also logged and kept in
  // problems(). Pages count as checksum failures or read errors as in Get. Holds the DB handle
  // for one read at a time (the flush and the metadata scan are one each), so a reopen after a
  // write error, and every call waiting for it, waits for one read, not for the whole check; the
  // check goes on with the reopened store.
  SpillVerifyReport Verify();
  // Damaged sequences and unreadable records found by Open() (and by Verify() since), as
  // "tenant/sequence: why" or "spill store: why". Empty when every record was read.
  std::vector<std::string> problems() const;
  // Forgets damaged sequence `id` (of any tenant): its damaged record and whatever pages are left.
  // NOT_FOUND if no damaged sequence has that id.
  Status DeleteDamaged(uint64_t id);
  SpillStats stats() const;
  uint64_t max_id() const;  // the largest stored sequence id (0 if none)
  const std::string& dir() const { return options_.dir; }

 private:
  explicit SpillStore(const SpillOptions& options);
  // Rebuilds the index; `wal_salvaged`: the WAL had corrupted records that were skipped.
  Status Load(bool wal_salvaged);
  // RocksDB's options for this store (the WAL's recovery mode depends on why it is opened).
  rocksdb::Options DbOptions(bool after_write_error) const;
  // Opens db_ (salvaging a damaged WAL) and loads the index.
  Status OpenDb(bool after_write_error);
  // After a write error, reopens the DB before the next write (see the .cc for why).
  Status RecoverWrites();
  // Records a problem (counted, reported by problems() and Verify()); false when it was already
  // recorded (then not counted again).
  bool AddProblem(std::string what);
  // Verify's parts: the flush and the scan of the metadata records, then one sequence's pages.
  // False when the store is closed (after a write error whose reopen failed).
  bool VerifyMetadata(SpillVerifyReport* r);
  bool VerifyPages(const SpilledSequence& m, SpillVerifyReport* r);
  // Counts a page that was not served or checked: `read` is how its read ended (OK: it was read
  // and does not check out).
  void CountBadPage(const rocksdb::Status& read);
  // The catalog: read at Load (returns the sequences it lists), rewritten compactly from the
  // index, then appended to ("put" after a store, "del" before a delete).
  std::map<std::pair<std::string, uint64_t>, bool> ReadCatalog();
  Status RewriteCatalog();
  void AppendCatalog(const char* op, const std::string& tenant, uint64_t id);
  // Reads and checks layers [first_layer, end_layer) of a stored sequence.
  Status ReadLayers(const SpilledSequence& meta, uint32_t first_layer, uint32_t end_layer,
                    const std::function<uint8_t*(uint32_t, uint32_t)>& out);

  SpillOptions options_;
  std::unique_ptr<rocksdb::Env> env_;  // files created 0600; outlives db_
  std::shared_mutex db_mu_;  // exclusive only to reopen db_ after a write error
  std::unique_ptr<rocksdb::DB> db_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, uint64_t>, SpilledSequence> index_;  // (tenant, id): stored sequences
  std::map<std::pair<std::string, uint64_t>, std::string> damaged_;    // (tenant, id): why
  std::vector<std::string> unreadable_;                                // records that could not be read
  std::atomic<bool> write_failed_{false};
  std::mutex catalog_mu_;
  int catalog_fd_ = -1;
  std::atomic<uint64_t> unreadable_records_{0}, resumes_{0};
  std::atomic<uint64_t> stored_bytes_{0}, spills_{0}, restores_{0}, spilled_total_{0}, restored_total_{0};
  std::atomic<uint64_t> checksum_failures_{0}, read_errors_{0}, write_errors_{0};
  std::atomic<uint64_t> spill_ns_{0}, restore_ns_{0};
};

}  // namespace specache
