// Sequences that outlive their session: a client marks a sequence "kept" (KeepSequence), and when
// its session ends the daemon parks a copy of its pages in RAM, owned by the tenant. Parked
// sequences are idle by construction (no client maps them), so they are the ones the spill tier
// takes: explicitly (Spill, specachectl spill) or by the watermark policy, least recently used
// first, when parked bytes pass high x park_bytes, down to low x park_bytes. Restore brings a
// spilled sequence back to RAM (every page's checksum verified); Claim hands a kept sequence to a
// session of its tenant with the same layout (restoring it first if needed); Evict forgets it.
// After a restart, the spilled sequences are listed again from the store.
//
// Thread safety: every method may be called from any thread; disk I/O happens under this
// object's own lock, never the registry's.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "specache/session_pages.h"
#include "specache/spill_store.h"

namespace specache::daemon {

struct KeptOptions {
  uint64_t park_bytes = 0;     // RAM for parked sequences
  double high_watermark = 0.9;  // of park_bytes: above it, spill...
  double low_watermark = 0.7;   // ...down to this
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
  uint64_t dropped = 0;  // kept sequences lost because neither RAM nor disk had room
  SpillStats spill;      // zero without a spill tier
  bool has_spill_tier = false;
};

// Where page p of layer l of a sequence is (read or written by the caller).
using PageAt = std::function<uint8_t*(uint32_t layer, uint32_t page)>;

class KeptSequences {
 public:
  // `store` may be null: no spill tier (parking only).
  KeptSequences(const KeptOptions& options, std::unique_ptr<SpillStore> store);

  // Whether a sequence of `bytes` could be kept at all (RAM budget or a spill tier).
  Status CanKeep(uint64_t bytes) const;
  // Copies a sequence leaving its session into RAM (spilling others if the watermark says so).
  Status Park(const std::string& tenant, uint64_t id, const PageLayout& layout, uint32_t pages_per_layer,
              const PageAt& pages);
  // Parked -> disk. FAILED_PRECONDITION without a spill tier; NOT_FOUND for an unknown id.
  Status Spill(uint64_t id);
  // Spills every parked sequence; returns how many (the first error stops it).
  Result<uint32_t> SpillAll();
  // Disk -> RAM, verified (DATA_LOSS names the page; the disk copy stays for inspection).
  Status Restore(uint64_t id);
  Status Evict(uint64_t id);
  // Copies the kept sequence into `pages` (restoring it first if spilled) and forgets it.
  // PERMISSION_DENIED for another tenant's sequence, FAILED_PRECONDITION for another layout.
  Status Claim(const std::string& tenant, uint64_t id, const PageLayout& layout, const PageAt& pages);

  Result<KeptSummary> Find(uint64_t id) const;
  std::vector<KeptSummary> List() const;
  KeptStats stats() const;
  bool has_spill_tier() const { return store_ != nullptr; }
  SpillVerifyReport Verify();
  uint64_t max_id() const;
  // Spills least recently parked sequences while parked bytes exceed the high watermark.
  void EnforceWatermarks();

 private:
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
  Result<Kept*> FindLocked(uint64_t id);
  static KeptSummary SummaryOf(uint64_t id, const Kept& k);
  Status SpillLocked(uint64_t id, Kept* k);
  Status RestoreLocked(uint64_t id, Kept* k);
  void EnforceLocked();
  uint64_t ParkedBytesLocked() const;

  KeptOptions options_;
  std::unique_ptr<SpillStore> store_;
  mutable std::mutex mu_;
  std::map<uint64_t, Kept> kept_;
  uint64_t dropped_ = 0;
};

}  // namespace specache::daemon
