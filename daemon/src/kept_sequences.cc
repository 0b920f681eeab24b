#include "kept_sequences.h"

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

namespace specache::daemon {

KeptSequences::KeptSequences(const KeptOptions& options, std::unique_ptr<SpillStore> store)
    : options_(options), store_(std::move(store)) {
  if (!store_) return;
  for (const SpilledSequence& m : store_->List()) {  // a restart: what is on disk is kept
    Kept k;
    k.tenant = m.tenant;
    k.layout = m.layout;
    k.pages_per_layer = m.pages_per_layer;
    k.state = KeptState::kSpilled;
    k.on_disk = true;
    kept_.emplace(m.id, std::move(k));
  }
  if (!kept_.empty()) spdlog::info("spill tier {}: {} sequences on disk", store_->dir(), kept_.size());
  for (const std::string& problem : store_->problems()) spdlog::error("spill tier {}: {}", store_->dir(), problem);
}

uint64_t KeptSequences::ParkedBytesLocked() const {
  uint64_t bytes = 0;
  for (const auto& [id, k] : kept_) {
    if (k.state == KeptState::kParked) bytes += k.bytes();
  }
  return bytes;
}

Status KeptSequences::CanKeep(uint64_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t parked = ParkedBytesLocked();
  if (parked + bytes <= options_.park_bytes) return Status::Ok();
  if (store_ && failures_in_row_ == 0) return Status::Ok();  // the last spill worked
  const std::string room = "cannot keep " + std::to_string(bytes) + " bytes: parking holds " +
                           std::to_string(parked) + " of " + std::to_string(options_.park_bytes) + " bytes";
  if (!store_) return Status::ResourceExhausted(room + " and there is no spill tier (--spill-dir)");
  return Status::ResourceExhausted(room + " and the spill tier is failing (" + std::to_string(spill_failures_) +
                                   " failed spills, last: " + last_spill_error_ + "); try again later");
}

bool KeptSequences::SpillAllowedLocked() const {
  return backoff_.count() == 0 || std::chrono::steady_clock::now() >= retry_at_;
}

void KeptSequences::SpillFailedLocked(const Status& why) {
  ++spill_failures_;
  ++failures_in_row_;
  last_spill_error_ = why.ToString();
  backoff_ = backoff_.count() == 0 ? options_.min_backoff : std::min(backoff_ * 2, options_.max_backoff);
  retry_at_ = std::chrono::steady_clock::now() + backoff_;
  spdlog::warn("spill tier: spills paused for {} ms after {} failures in a row", backoff_.count(), failures_in_row_);
}

void KeptSequences::SpillSucceededLocked() {
  if (backoff_.count() != 0) spdlog::info("spill tier: spilling again after {} failures", failures_in_row_);
  backoff_ = std::chrono::milliseconds(0);
  failures_in_row_ = 0;
}

Status KeptSequences::PutLocked(uint64_t id, const Kept& k, const PageAt& page) {
  // Called only for a sequence with no disk copy of its own (not on_disk). A stored one under its
  // id is then an older copy whose delete failed when it was claimed (Finish): the id came back
  // (a claimed sequence keeps its id) and was kept again. Left there, it made every write of the
  // new copy fail (ALREADY_EXISTS: no spill, no write-through, the watermarks stuck behind it),
  // and a restart would have listed the old bytes as the kept ones.
  if (store_->Find(k.tenant, id).ok()) {
    const Status s = store_->Delete(k.tenant, id);
    if (!s.ok()) return Status(s.code(), "an old disk copy of the id could not be deleted: " + s.message());
    spdlog::warn("sequence {} of tenant {}: deleted its old disk copy (left by a claim whose delete failed) before "
                 "writing the one kept now", id, k.tenant);
  }
  SpilledSequence meta;
  meta.tenant = k.tenant;
  meta.id = id;
  meta.layout = k.layout;
  meta.pages_per_layer = k.pages_per_layer;
  return store_->Put(meta, [&page](uint32_t l, uint32_t p) -> const uint8_t* { return page(l, p); });
}

Status KeptSequences::Park(const std::string& tenant, uint64_t id, const PageLayout& layout, uint32_t pages_per_layer,
                           const PageAt& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  Kept k;
  k.tenant = tenant;
  k.layout = layout;
  k.pages_per_layer = pages_per_layer;
  const uint64_t bytes = k.bytes();
  if (kept_.count(id)) {
    ++dropped_;  // the session's pages go back to the pool: this copy is lost (the caller logs it)
    return Status::AlreadyExists("sequence " + std::to_string(id) + " is kept already");
  }
  if (store_ && options_.write_through) {  // on disk before anything else: survives a SIGKILL
    const Status s = PutLocked(id, k, pages);
    k.on_disk = s.ok();
    if (!s.ok()) {
      ++write_through_failures_;
      spdlog::error("sequence {} of tenant {}: write-through failed, kept in RAM only: {}", id, tenant, s.ToString());
    }
  }
  if (ParkedBytesLocked() + bytes > options_.park_bytes) MakeRoomLocked(bytes);
  if (ParkedBytesLocked() + bytes > options_.park_bytes) {
    // No room in RAM: straight from the session's pages to disk, or not kept at all.
    if (!k.on_disk && store_ && SpillAllowedLocked()) {
      const Status s = PutLocked(id, k, pages);
      if (s.ok()) {
        SpillSucceededLocked();
        k.on_disk = true;
      } else {
        spdlog::error("spilling sequence {} of tenant {} (parking is full): {}", id, tenant, s.ToString());
        SpillFailedLocked(s);
      }
    }
    if (!k.on_disk) {
      ++dropped_;
      return Status::ResourceExhausted("no room to keep sequence " + std::to_string(id) + " (" + std::to_string(bytes) +
                                       " bytes): parking holds " + std::to_string(ParkedBytesLocked()) + " of " +
                                       std::to_string(options_.park_bytes) + " bytes and " +
                                       (store_ ? "the spill tier is failing: " + last_spill_error_
                                               : std::string("there is no spill tier")));
    }
    k.state = KeptState::kSpilled;
    kept_.emplace(id, std::move(k));
    spdlog::info("sequence {} of tenant {} spilled straight from its session ({} bytes; parking is full)", id, tenant,
                 bytes);
    return Status::Ok();
  }
  k.ram.reset(new (std::nothrow) uint8_t[std::max<uint64_t>(bytes, 1)]);
  if (!k.ram) {
    if (k.on_disk) {  // written through: the disk copy is the kept one
      k.state = KeptState::kSpilled;
      kept_.emplace(id, std::move(k));
      return Status::Ok();
    }
    ++dropped_;
    return Status::ResourceExhausted("no memory to park sequence " + std::to_string(id));
  }
  for (uint32_t l = 0; l < layout.n_layers; ++l) {
    for (uint32_t p = 0; p < pages_per_layer; ++p) std::memcpy(k.page(l, p), pages(l, p), layout.page_bytes());
  }
  k.parked_at = std::chrono::steady_clock::now();
  kept_.emplace(id, std::move(k));
  spdlog::info("sequence {} of tenant {} parked ({} bytes{})", id, tenant, bytes,
               options_.write_through ? ", written through" : "");
  EnforceLocked();
  return Status::Ok();
}

Result<KeptSequences::Kept*> KeptSequences::FindLocked(uint64_t id) {
  auto it = kept_.find(id);
  if (it == kept_.end()) return Status::NotFound("sequence " + std::to_string(id) + " is not kept");
  return &it->second;
}

Status KeptSequences::SpillLocked(uint64_t id, Kept* k) {
  if (!store_) return Status::FailedPrecondition("no spill tier: start specached with --spill-dir");
  if (k->state == KeptState::kSpilled) return Status::Ok();
  if (!k->on_disk) {
    const Status s = PutLocked(id, *k, [k](uint32_t l, uint32_t p) { return k->page(l, p); });
    if (!s.ok()) {  // the RAM copy stays: nothing is lost
      spdlog::error("spilling sequence {} of tenant {} ({} bytes): {} (kept in RAM)", id, k->tenant, k->bytes(),
                    s.ToString());
      SpillFailedLocked(s);
      return s;
    }
    SpillSucceededLocked();
  }
  k->ram.reset();
  k->state = KeptState::kSpilled;
  k->on_disk = true;
  spdlog::info("sequence {} of tenant {} spilled ({} bytes)", id, k->tenant, k->bytes());
  return Status::Ok();
}

Status KeptSequences::RestoreLocked(uint64_t id, Kept* k) {
  if (k->state == KeptState::kParked) return Status::Ok();
  std::unique_ptr<uint8_t[]> ram(new (std::nothrow) uint8_t[std::max<uint64_t>(k->bytes(), 1)]);
  if (!ram) return Status::ResourceExhausted("no memory to restore sequence " + std::to_string(id));
  k->ram = std::move(ram);
  const Status s = store_->Get(k->tenant, id, [k](uint32_t l, uint32_t p) { return k->page(l, p); });
  if (!s.ok()) {
    k->ram.reset();
    spdlog::error("restoring sequence {}: {}", id, s.ToString());
    return s;
  }
  k->state = KeptState::kParked;
  k->parked_at = std::chrono::steady_clock::now();
  return Status::Ok();
}

Status KeptSequences::Spill(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Kept * k, FindLocked(id));
  return SpillLocked(id, k);
}

Result<uint32_t> KeptSequences::SpillAll() {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t n = 0;
  Status first = Status::Ok();
  std::string failed;
  uint32_t failures = 0;
  for (auto& [id, k] : kept_) {
    if (k.state != KeptState::kParked) continue;
    const Status s = SpillLocked(id, &k);  // logged there, with the sequence's name
    if (s.ok()) {
      ++n;
      continue;
    }
    if (first.ok()) first = s;
    if (++failures <= 16) failed += (failed.empty() ? "" : ", ") + std::to_string(id) + " (tenant " + k.tenant + ")";
  }
  if (first.ok()) return n;
  if (failures > 16) failed += ", ...";
  return Status(first.code(), "spilled " + std::to_string(n) + "; " + std::to_string(failures) +
                                  " could not be spilled: " + failed + "; first error: " + first.message());
}

Status KeptSequences::Restore(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Kept * k, FindLocked(id));
  if (k->state == KeptState::kSpilled && ParkedBytesLocked() + k->bytes() > options_.park_bytes) {
    return Status::ResourceExhausted("no parking room to restore sequence " + std::to_string(id) + ": " +
                                     std::to_string(ParkedBytesLocked()) + " of " + std::to_string(options_.park_bytes) +
                                     " bytes parked, it needs " + std::to_string(k->bytes()));
  }
  return RestoreLocked(id, k);
}

Status KeptSequences::Evict(uint64_t id, std::string_view by) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!kept_.count(id) && store_ && store_->DeleteDamaged(id).ok()) {
    ++evicted_;
    spdlog::warn("damaged spill of sequence {} evicted by {}", id, by);
    return Status::Ok();
  }
  SPECACHE_ASSIGN_OR_RETURN(Kept * k, FindLocked(id));
  if (k->on_disk) SPECACHE_RETURN_IF_ERROR(store_->Delete(k->tenant, id));
  const uint64_t bytes = k->bytes();
  ++evicted_;
  evicted_bytes_ += bytes;
  spdlog::warn("sequence {} of tenant '{}' ({} bytes, {}) evicted by {}", id, k->tenant, bytes,
               k->state == KeptState::kSpilled ? "spilled" : "parked", by);
  kept_.erase(id);
  return Status::Ok();
}

Result<KeptSequences::Taken> KeptSequences::Take(const std::string& tenant, uint64_t id, const PageLayout& layout) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Kept * k, FindLocked(id));
  // Another tenant's sequence is refused as an unknown one: its ids do not say which others keep.
  if (k->tenant != tenant) return Status::NotFound("sequence " + std::to_string(id) + " is not kept");
  if (LayoutFingerprint(k->layout) != LayoutFingerprint(layout)) {
    return Status::FailedPrecondition("sequence " + std::to_string(id) + " was kept with another layout");
  }
  SPECACHE_RETURN_IF_ERROR(RestoreLocked(id, k));
  Taken t{id, std::move(*k)};
  kept_.erase(id);
  ++taken_[tenant];
  return t;
}

void KeptSequences::Finish(Taken taken) {
  std::lock_guard<std::mutex> lock(mu_);
  UntakeLocked(taken.kept.tenant);
  if (!taken.kept.on_disk) return;
  const Status s = store_->Delete(taken.kept.tenant, taken.id);
  if (!s.ok()) spdlog::error("claimed sequence {}: its disk copy stays: {}", taken.id, s.ToString());
}

void KeptSequences::UntakeLocked(const std::string& tenant) {
  auto it = taken_.find(tenant);
  if (it != taken_.end() && --it->second == 0) taken_.erase(it);
}

void KeptSequences::PutBack(Taken taken) {
  std::lock_guard<std::mutex> lock(mu_);
  UntakeLocked(taken.kept.tenant);
  // Over park_bytes for a moment at most: the watermarks spill it. The registry keeps the id from
  // being kept again while it is taken (Registry::claiming_); should it be kept all the same, the
  // one kept since stays and this one is lost, said and counted.
  const uint64_t id = taken.id;
  const std::string tenant = taken.kept.tenant;
  if (!kept_.emplace(id, std::move(taken.kept)).second) {
    ++dropped_;
    spdlog::error("kept sequence {} of tenant {} could not be put back after a failed claim: the id is kept again "
                  "since; the claimed copy is lost", id, tenant);
  }
}

KeptSummary KeptSequences::SummaryOf(uint64_t id, const Kept& k) {
  return {id, k.tenant, k.layout, k.pages_per_layer, k.bytes(), k.state, k.state == KeptState::kParked && k.on_disk};
}

Result<KeptSummary> KeptSequences::Find(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = kept_.find(id);
  if (it == kept_.end()) return Status::NotFound("sequence " + std::to_string(id) + " is not kept");
  return SummaryOf(id, it->second);
}

std::vector<KeptSummary> KeptSequences::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<KeptSummary> out;
  for (const auto& [id, k] : kept_) out.push_back(SummaryOf(id, k));
  return out;
}

uint64_t KeptSequences::CountOf(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (const auto& [id, k] : kept_) n += k.tenant == tenant ? 1 : 0;
  auto taken = taken_.find(tenant);  // in a claim's copy: kept again if the claim fails (PutBack)
  return n + (taken == taken_.end() ? 0 : taken->second);
}

KeptStats KeptSequences::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  KeptStats s;
  for (const auto& [id, k] : kept_) {
    if (k.state == KeptState::kParked) {
      s.parked_bytes += k.bytes();
      ++s.parked;
    } else {
      s.spilled_bytes += k.bytes();
      ++s.spilled;
    }
  }
  s.dropped = dropped_;
  s.spill_failures = spill_failures_;
  s.write_through_failures = write_through_failures_;
  s.evicted = evicted_;
  s.evicted_bytes = evicted_bytes_;
  if (backoff_.count() != 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(retry_at_ - std::chrono::steady_clock::now());
    s.spill_backoff_ms = static_cast<uint64_t>(std::max<int64_t>(left.count(), 0));
  }
  s.has_spill_tier = has_spill_tier();
  if (store_) s.spill = store_->stats();
  return s;
}

SpillVerifyReport KeptSequences::Verify() {
  // No lock: reading every page takes seconds, and the store is thread-safe (a sequence claimed
  // or evicted meanwhile is not reported as bad).
  if (!store_) return SpillVerifyReport{};
  SpillVerifyReport r = store_->Verify();
  constexpr size_t kLogged = 20;  // each finding is in the reply; the log gets the first ones
  for (size_t i = 0; i < r.bad.size() && i < kLogged; ++i) spdlog::error("verify: {}", r.bad[i]);
  if (r.bad.size() > kLogged) spdlog::error("verify: {} more bad entries (see the verify reply)", r.bad.size() - kLogged);
  return r;
}

uint64_t KeptSequences::max_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t kept = kept_.empty() ? 0 : kept_.rbegin()->first;
  return std::max(kept, store_ ? store_->max_id() : 0);  // damaged spills' ids are not reused either
}

void KeptSequences::EnforceWatermarks() {
  std::lock_guard<std::mutex> lock(mu_);
  EnforceLocked();
}

uint32_t KeptSequences::DropRamOnly() {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t dropped = 0;
  for (auto it = kept_.begin(); it != kept_.end();) {
    const auto& [id, k] = *it;
    if (k.state != KeptState::kParked || k.on_disk) {
      ++it;
      continue;
    }
    spdlog::error("stop: sequence {} of tenant {} ({} bytes) was parked in RAM only: lost with the process", id,
                  k.tenant, k.bytes());
    ++dropped_;
    ++dropped;
    it = kept_.erase(it);
  }
  return dropped;
}

void KeptSequences::EnforceLocked() {
  if (!store_) return;
  const auto high = static_cast<uint64_t>(options_.high_watermark * static_cast<double>(options_.park_bytes));
  if (ParkedBytesLocked() <= high) return;
  const auto low = static_cast<uint64_t>(options_.low_watermark * static_cast<double>(options_.park_bytes));
  MakeRoomLocked(options_.park_bytes - std::min(low, options_.park_bytes));
}

void KeptSequences::MakeRoomLocked(uint64_t bytes) {
  if (!store_ || !SpillAllowedLocked()) return;  // backing off: the next try is due at retry_at_
  uint64_t parked = ParkedBytesLocked();
  const uint64_t target = options_.park_bytes - std::min(bytes, options_.park_bytes);
  if (parked <= target) return;
  std::vector<std::pair<std::chrono::steady_clock::time_point, uint64_t>> lru;
  for (const auto& [id, k] : kept_) {
    if (k.state == KeptState::kParked) lru.push_back({k.parked_at, id});
  }
  std::sort(lru.begin(), lru.end());
  for (const auto& [when, id] : lru) {
    if (parked <= target) break;
    Kept& k = kept_.at(id);
    const uint64_t bytes_of = k.bytes();
    if (SpillLocked(id, &k).ok()) parked -= bytes_of;
    else break;  // logged and backing off; the RAM copy stays
  }
}

}  // namespace specache::daemon
