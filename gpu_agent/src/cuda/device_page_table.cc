#include "device_page_table.h"

#include <string>
#include <utility>
#include <vector>

#include "specache/cuda_gather.h"

namespace specache::cuda {

DevicePageTable::DevicePageTable(FullPrecisionSource* source, int n_layers, int32_t capacity_tokens,
                                 HostRowFormat row_format, cudaStream_t stream)
    : source_(source), n_layers_(n_layers), capacity_tokens_(capacity_tokens), row_format_(row_format), stream_(stream) {
  page_tokens_ = source->page_tokens();
  // A source without pages (the staged path) gets empty tables: Map maps nothing, Layer is null.
  if (page_tokens_ > 0) max_pages_ = (capacity_tokens + page_tokens_ - 1) / page_tokens_;
}

DevicePageTable::~DevicePageTable() {
  tables_.clear();
  for (const auto& [host, region] : regions_) (void)UnregisterHostMemory(const_cast<uint8_t*>(host));
}

Status DevicePageTable::RegisterNewRegions() {
  for (const HostRegion& r : source_->host_regions()) {
    const auto* base = static_cast<const uint8_t*>(r.base);
    if (regions_.count(base)) continue;
    SPECACHE_ASSIGN_OR_RETURN(uint64_t device, RegisterHostMemory(r.base, r.bytes));
    regions_[base] = {r.bytes, device};
  }
  return Status::Ok();
}

Result<uint64_t> DevicePageTable::DeviceAddress(const uint8_t* host) const {
  auto it = regions_.upper_bound(host);
  if (it != regions_.begin()) {
    --it;
    if (host >= it->first && host < it->first + it->second.bytes) return it->second.device + (host - it->first);
  }
  return Status::Internal("a page of the source lies outside its host regions");
}

Status DevicePageTable::AddSequence(SequenceId id) {
  Table t;
  const size_t entries = static_cast<size_t>(n_layers_) * max_pages_;
  SPECACHE_RETURN_IF_ERROR(t.pages.Reserve(entries));
  SPECACHE_RETURN_IF_ERROR(t.pages_host.Reserve(entries));
  if (entries > 0) t.host_addresses = std::make_unique<const uint8_t*[]>(entries);
  tables_.emplace(id, std::move(t));
  return Status::Ok();
}

void DevicePageTable::RemoveSequence(SequenceId id) { tables_.erase(id); }

const uint64_t* DevicePageTable::Layer(SequenceId id, int layer) const {
  return tables_.at(id).pages.get() + static_cast<size_t>(layer) * max_pages_;
}

const uint8_t* const* DevicePageTable::HostLayer(SequenceId id, int layer) const {
  const Table& t = tables_.at(id);
  return t.host_addresses ? t.host_addresses.get() + static_cast<size_t>(layer) * max_pages_ : nullptr;
}

Status DevicePageTable::Map(SequenceId id, int32_t tokens) {
  if (page_tokens_ <= 0) return Status::Ok();  // a source without pages: nothing to map
  Table* t = &tables_.at(id);
  const int32_t need = (tokens + page_tokens_ - 1) / page_tokens_;
  if (need <= t->mapped_pages) return Status::Ok();
  if (need > max_pages_) {
    return Status::OutOfRange("sequence " + std::to_string(id) + " would exceed capacity_tokens (" +
                              std::to_string(capacity_tokens_) + ")");
  }
  std::vector<uint8_t*> pages;
  bool registered = false;
  for (int l = 0; l < n_layers_; ++l) {
    SPECACHE_RETURN_IF_ERROR(source_->HostPages(id, l, tokens, &pages).WithContext("source pages"));
    uint64_t* staged = t->pages_host.get() + static_cast<size_t>(l) * max_pages_;
    const uint8_t** host = t->host_addresses.get() + static_cast<size_t>(l) * max_pages_;
    for (int32_t p = t->mapped_pages; p < need; ++p) {
      host[p] = pages[p];
      auto address = DeviceAddress(pages[p]);
      if (!address.ok() && !registered) {  // the source grew: register its new memory once
        SPECACHE_RETURN_IF_ERROR(RegisterNewRegions());
        registered = true;
        address = DeviceAddress(pages[p]);
      }
      SPECACHE_RETURN_IF_ERROR(address.status());
      staged[p] = *address;
    }
    // Entries are written once, so the staged copy stays valid while the copy is queued.
    SPECACHE_RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(t->pages.get() + static_cast<size_t>(l) * max_pages_ + t->mapped_pages,
                                                        staged + t->mapped_pages, (need - t->mapped_pages) * sizeof(uint64_t),
                                                        cudaMemcpyHostToDevice, stream_),
                                        "page table"));
  }
  t->mapped_pages = need;
  return Status::Ok();
}

int64_t DevicePageTable::device_bytes() const {
  int64_t bytes = 0;
  for (const auto& [id, t] : tables_) bytes += t.pages.bytes();
  return bytes;
}

}  // namespace specache::cuda
