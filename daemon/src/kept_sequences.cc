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
}

uint64_t KeptSequences::ParkedBytesLocked() const {
  uint64_t bytes = 0;
  for (const auto& [id, k] : kept_) {
    if (k.state == KeptState::kParked) bytes += k.bytes();
  }
  return bytes;
}

Status KeptSequences::CanKeep(uint64_t bytes) const {
  if (store_ || bytes <= options_.park_bytes) return Status::Ok();
  return Status::ResourceExhausted("cannot keep " + std::to_string(bytes) + " bytes: parking holds " +
                                   std::to_string(options_.park_bytes) + " and there is no spill tier (--spill-dir)");
}

Status KeptSequences::Park(const std::string& tenant, uint64_t id, const PageLayout& layout, uint32_t pages_per_layer,
                           const PageAt& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  Kept k;
  k.tenant = tenant;
  k.layout = layout;
  k.pages_per_layer = pages_per_layer;
  const uint64_t bytes = k.bytes();
  if (kept_.count(id)) return Status::AlreadyExists("sequence " + std::to_string(id) + " is kept already");
  if (ParkedBytesLocked() + bytes > options_.park_bytes && !store_) {
    ++dropped_;
    return Status::ResourceExhausted("no parking room for sequence " + std::to_string(id) + " and no spill tier");
  }
  k.ram.reset(new (std::nothrow) uint8_t[std::max<uint64_t>(bytes, 1)]);
  if (!k.ram) {
    ++dropped_;
    return Status::ResourceExhausted("no memory to park sequence " + std::to_string(id));
  }
  for (uint32_t l = 0; l < layout.n_layers; ++l) {
    for (uint32_t p = 0; p < pages_per_layer; ++p) std::memcpy(k.page(l, p), pages(l, p), layout.page_bytes());
  }
  k.parked_at = std::chrono::steady_clock::now();
  kept_.emplace(id, std::move(k));
  spdlog::info("sequence {} of tenant {} parked ({} bytes)", id, tenant, bytes);
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
    SpilledSequence meta;
    meta.tenant = k->tenant;
    meta.id = id;
    meta.layout = k->layout;
    meta.pages_per_layer = k->pages_per_layer;
    const Status s = store_->Put(meta, [k](uint32_t l, uint32_t p) { return k->page(l, p); });
    if (!s.ok()) {  // the RAM copy stays: nothing is lost
      spdlog::error("spilling sequence {}: {} (kept in RAM)", id, s.ToString());
      return s;
    }
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
  for (auto& [id, k] : kept_) {
    if (k.state != KeptState::kParked) continue;
    SPECACHE_RETURN_IF_ERROR(SpillLocked(id, &k));
    ++n;
  }
  return n;
}

Status KeptSequences::Restore(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Kept * k, FindLocked(id));
  return RestoreLocked(id, k);
}

Status KeptSequences::Evict(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Kept * k, FindLocked(id));
  if (k->on_disk) SPECACHE_RETURN_IF_ERROR(store_->Delete(k->tenant, id));
  kept_.erase(id);
  spdlog::info("sequence {} evicted", id);
  return Status::Ok();
}

Status KeptSequences::Claim(const std::string& tenant, uint64_t id, const PageLayout& layout, const PageAt& pages) {
  std::lock_guard<std::mutex> lock(mu_);
  SPECACHE_ASSIGN_OR_RETURN(Kept * k, FindLocked(id));
  if (k->tenant != tenant) return Status::PermissionDenied("sequence " + std::to_string(id) + " belongs to another tenant");
  if (LayoutFingerprint(k->layout) != LayoutFingerprint(layout)) {
    return Status::FailedPrecondition("sequence " + std::to_string(id) + " was kept with another layout");
  }
  SPECACHE_RETURN_IF_ERROR(RestoreLocked(id, k));
  for (uint32_t l = 0; l < layout.n_layers; ++l) {
    for (uint32_t p = 0; p < k->pages_per_layer; ++p) std::memcpy(pages(l, p), k->page(l, p), layout.page_bytes());
  }
  if (k->on_disk) {
    const Status s = store_->Delete(tenant, id);
    if (!s.ok()) spdlog::error("claimed sequence {}: its disk copy stays: {}", id, s.ToString());
  }
  kept_.erase(id);
  return Status::Ok();
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
  s.has_spill_tier = has_spill_tier();
  if (store_) s.spill = store_->stats();
  return s;
}

SpillVerifyReport KeptSequences::Verify() {
  std::lock_guard<std::mutex> lock(mu_);
  return store_ ? store_->Verify() : SpillVerifyReport{};
}

uint64_t KeptSequences::max_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_.empty() ? 0 : kept_.rbegin()->first;
}

void KeptSequences::EnforceWatermarks() {
  std::lock_guard<std::mutex> lock(mu_);
  EnforceLocked();
}

void KeptSequences::EnforceLocked() {
  if (!store_) return;
  uint64_t parked = ParkedBytesLocked();
  const auto high = static_cast<uint64_t>(options_.high_watermark * static_cast<double>(options_.park_bytes));
  const auto low = static_cast<uint64_t>(options_.low_watermark * static_cast<double>(options_.park_bytes));
  if (parked <= high) return;
  std::vector<std::pair<std::chrono::steady_clock::time_point, uint64_t>> lru;
  for (const auto& [id, k] : kept_) {
    if (k.state == KeptState::kParked) lru.push_back({k.parked_at, id});
  }
  std::sort(lru.begin(), lru.end());
  for (const auto& [when, id] : lru) {
    if (parked <= low) break;
    Kept& k = kept_.at(id);
    const uint64_t bytes = k.bytes();
    if (SpillLocked(id, &k).ok()) parked -= bytes;
    else break;  // logged; the RAM copy stays
  }
}

}  // namespace specache::daemon
