// Sequences that outlive their session: a client marks a sequence "kept" (KeepSequence), and when
// its session ends the daemon parks a copy of its pages in RAM, owned by the tenant. Parked
// sequences are idle by construction (no client maps them), so they are the ones the spill tier
// takes: explicitly (Spill, specachectl spill) or by the watermark policy, least recently used
// first, when parked bytes pass high x park_bytes, down to low x park_bytes. Restore brings a
// spilled sequence back to RAM (every page's checksum verified); Take / Finish (or PutBack) hand a
// kept sequence to a session of its tenant with the same layout (restoring it first if needed);
// Evict forgets it.
// After a restart, the spilled sequences are listed again from the store.
//
// Limits: parked RAM never exceeds park_bytes. A sequence that does not fit is spilled straight
// from its session's pages, or, when the spill tier is failing (or absent), refused: KeepSequence
// says so up front, and a sequence that still cannot be parked when its session ends is logged
// and counted as lost; so is each parked sequence still in RAM only when the daemon stops. Failed
// spills back off exponentially (min_backoff doubling up to max_backoff) instead of being retried
// on every watermark check; a spill that succeeds ends the backoff. With write_through, a parked
// sequence is also written to the spill tier as it is parked, so it survives a SIGKILL of the
// daemon.
//
// Thread safety: every method may be called from any thread; disk I/O happens under this
// object's own lock, never the registry's. Verify holds no lock (the store is thread-safe).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "specache/session_pages.h"
#include "specache/spill_store.h"

namespace specache::daemon {

struct KeptOptions {
  uint64_t park_bytes = 0;     // RAM for parked sequences
  double high_watermark = 0.9;  // of park_bytes: above it, spill...
  double low_watermark = 0.7;   // ...down to this
  bool write_through = false;   // also spill every sequence as it is parked
  std::chrono::milliseconds min_backoff{100}, max_backoff{30000};  // after failed spills
};

enum class KeptState { kParked, kSpilled };

struct KeptSummary {
  uint64_t id = 0;
  std::string tenant;
  PageLayout layout;
  uint32_t pages_per_layer = 0;
  uint64_t bytes = 0;
  KeptState state = KeptState::kParked;
  bool also_on_disk = false;  // parked, and an identical copy is still spilled
};

struct KeptStats {
  uint64_t parked_bytes = 0, spilled_bytes = 0;
  uint32_t parked = 0, spilled = 0;
  uint64_t dropped = 0;  // kept sequences lost: neither RAM nor disk had room, or their id was kept again meanwhile
  uint64_t spill_failures = 0;          // spills that failed (each logged)
  uint64_t spill_backoff_ms = 0;        // time until spills are tried again (0: not backing off)
  uint64_t write_through_failures = 0;  // parked sequences whose write-through failed (in RAM only)
  uint64_t evicted = 0, evicted_bytes = 0;  // kept sequences (and damaged spills) an operator evicted
  SpillStats spill;      // zero without a spill tier
  bool has_spill_tier = false;
};

// Where page p of layer l of a sequence is (read or written by the caller).
using PageAt = std::function<uint8_t*(uint32_t layer, uint32_t page)>;

class KeptSequences {
 public:
  // `store` may be null: no spill tier (parking only).
  KeptSequences(const KeptOptions& options, std::unique_ptr<SpillStore> store);

  // Whether a sequence of `bytes` could be kept now: room in parking, or a spill tier whose last
  // spill did not fail. RESOURCE_EXHAUSTED says which is missing (and the spill tier's last error).
  Status CanKeep(uint64_t bytes) const;
  // Copies a sequence leaving its session into RAM (spilling others if the watermark says so);
  // straight to disk if parking has no room; RESOURCE_EXHAUSTED (counted as dropped) if neither
  // can take it, ALREADY_EXISTS (counted as dropped too: the pages are not kept) if the id is.
  Status Park(const std::string& tenant, uint64_t id, const PageLayout& layout, uint32_t pages_per_layer,
              const PageAt& pages);
  // Parked -> disk. FAILED_PRECONDITION without a spill tier; NOT_FOUND for an unknown id.
  Status Spill(uint64_t id);
  // Spills every parked sequence; returns how many. A failure does not stop it: every sequence is
  // tried, each failure logged with the sequence's name, and then the first failure's code is
  // returned with how many were spilled and which were not.
  Result<uint32_t> SpillAll();
  // Disk -> RAM, verified (DATA_LOSS names the page; the disk copy stays for inspection).
  // RESOURCE_EXHAUSTED when parking has no room for it (a claim restores through Take, whose RAM
  // copy goes to a session right after).
  Status Restore(uint64_t id);
  // Forgets a kept sequence, or a damaged spill of that id (SpillStore::DeleteDamaged): logged
  // with its tenant, size and `by` (who asked), and counted.
  Status Evict(uint64_t id, std::string_view by);
  // A kept sequence's record: its RAM copy while parked (or taken), its disk copy's state.
  struct Kept {
    std::string tenant;
    PageLayout layout;
    uint32_t pages_per_layer = 0;
    KeptState state = KeptState::kParked;
    bool on_disk = false;
    std::unique_ptr<uint8_t[]> ram;  // parked pages, [layer][page][page_bytes]
    std::chrono::steady_clock::time_point parked_at;
    uint64_t bytes() const { return uint64_t{layout.n_layers} * pages_per_layer * layout.page_bytes(); }
    uint8_t* page(uint32_t l, uint32_t p) const {
      return ram.get() + (uint64_t{l} * pages_per_layer + p) * layout.page_bytes();
    }
  };
  // A claim in three steps, so that its caller copies the pages without this object's lock (which
  // spills hold for their disk I/O) and without holding its own lock across this one's:
  // Take hands over the sequence's RAM copy (restored first if spilled) and stops keeping it (a
  // second claim finds nothing); then either Finish (claimed: its disk copy, if any, deleted) or
  // PutBack (the claim failed: kept again as it was): one of them for every Taken. NOT_FOUND for an unknown id and for another
  // tenant's sequence alike (the answer does not say which ids others keep), FAILED_PRECONDITION
  // for another layout.
  struct Taken {
    uint64_t id = 0;
    Kept kept;  // parked: its pages in kept.ram
  };
  Result<Taken> Take(const std::string& tenant, uint64_t id, const PageLayout& layout);
  void Finish(Taken taken);
  void PutBack(Taken taken);

  Result<KeptSummary> Find(uint64_t id) const;
  std::vector<KeptSummary> List() const;
  // How many sequences the tenant keeps: parked or spilled, and taken by a claim still in its copy
  // (kept again if the claim fails: counted, so that a keep meanwhile cannot pass the tenant's limit).
  uint64_t CountOf(const std::string& tenant) const;
  KeptStats stats() const;
  bool has_spill_tier() const { return store_ != nullptr; }
  SpillVerifyReport Verify();
  uint64_t max_id() const;
  // Spills least recently parked sequences while parked bytes exceed the high watermark.
  void EnforceWatermarks();
  // At the daemon's stop, after its last spill (SpillAll): forgets every parked sequence that has
  // no disk copy, as the process's end would, each logged by name and counted as dropped. Returns
  // how many.
  uint32_t DropRamOnly();

 private:
  Result<Kept*> FindLocked(uint64_t id);
  static KeptSummary SummaryOf(uint64_t id, const Kept& k);
  Status SpillLocked(uint64_t id, Kept* k);
  // Writes a sequence to the store from `page` (RAM or a session's pages).
  Status PutLocked(uint64_t id, const Kept& k, const PageAt& page);
  // Whether spills may be tried now (not backing off after a failure).
  bool SpillAllowedLocked() const;
  void SpillFailedLocked(const Status& why);
  void SpillSucceededLocked();
  // Spills least recently parked sequences until `bytes` more fit under park_bytes.
  void MakeRoomLocked(uint64_t bytes);
  Status RestoreLocked(uint64_t id, Kept* k);
  void EnforceLocked();
  uint64_t ParkedBytesLocked() const;

  KeptOptions options_;
  std::unique_ptr<SpillStore> store_;
  mutable std::mutex mu_;
  std::map<uint64_t, Kept> kept_;
  uint64_t dropped_ = 0;
  std::map<std::string, uint64_t> taken_;  // tenant -> sequences Taken and not yet Finished or PutBack
  void UntakeLocked(const std::string& tenant);
  uint64_t spill_failures_ = 0, write_through_failures_ = 0;
  uint64_t evicted_ = 0, evicted_bytes_ = 0;
  uint32_t failures_in_row_ = 0;
  std::chrono::milliseconds backoff_{0};               // 0: spills are healthy
  std::chrono::steady_clock::time_point retry_at_{};  // spills wait until then
  std::string last_spill_error_;
};

}  // namespace specache::daemon
