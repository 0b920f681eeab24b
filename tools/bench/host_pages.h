// Daemon-style host pages for the CUDA benchmarks: memfd chunks of 256 MiB (the daemon's chunk
// size), pre-faulted by threads, registered (mapped, portable) for every GPU of the process.
// Optionally backed by transparent huge pages, to measure what 2 MiB host pages do to the GPU's
// zero-copy reads spread over many GiB (each 4 KiB page is a translation the GPU and the IOMMU
// must hold; a 2 MiB page covers 512 of them).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace specache::bench {

// The pages' layout: a page holds kPageTokens tokens of kHeads KV heads, [K|V] fp16 rows of
// kHeadDim channels (Llama-3-8B shapes); a decode step selects kTopK rows per (sequence, head).
constexpr int kHeads = 8, kHeadDim = 128, kTopK = 64, kPageTokens = 64;
constexpr int kRowBytes = 2 * kHeadDim * 2;                                  // 512 B
constexpr uint64_t kPageBytes = uint64_t{kHeads} * kPageTokens * kRowBytes;  // 256 KiB

// How the chunks are backed: base pages (memfd, as the daemon's), or transparent huge pages asked
// for with madvise(MADV_HUGEPAGE) before the pages are touched, on the memfd (shmem THP: the
// kernel's shmem_enabled must allow "advise") or on anonymous private memory (anonymous THP).
enum class HostPageBacking { kBase, kHugeShmem, kHugeAnon };
const char* HostPageBackingName(HostPageBacking b);
bool ParseHostPageBacking(const std::string& name, HostPageBacking* out);

class RegisteredHostPages {
 public:
  static constexpr uint64_t kChunkBytes = uint64_t{256} << 20;

  RegisteredHostPages() = default;
  RegisteredHostPages(const RegisteredHostPages&) = delete;
  RegisteredHostPages& operator=(const RegisteredHostPages&) = delete;
  ~RegisteredHostPages();

  // Maps, fills (chunk c with byte c & 0xFF) and registers `gib` GiB; prints why on failure. A
  // huge backing that the kernel declines is not a failure: huge_bytes() says what it gave.
  bool Create(int gib, HostPageBacking backing = HostPageBacking::kBase);

  int chunks() const { return static_cast<int>(chunks_.size()); }
  uint8_t* chunk(int c) const { return chunks_[c]; }
  // The address the current device uses for chunk c.
  uint64_t device_address(int c) const { return device_[c]; }
  uint64_t page_slots() const { return chunks_.size() * (kChunkBytes / kPageBytes); }
  double setup_seconds() const { return setup_seconds_; }
  HostPageBacking backing() const { return backing_; }
  // Bytes of the chunks mapped by huge pages once filled (from /proc/self/smaps; -1 if unreadable).
  int64_t huge_bytes() const { return huge_bytes_; }
  uint64_t bytes() const { return chunks_.size() * kChunkBytes; }

 private:
  HostPageBacking backing_ = HostPageBacking::kBase;
  int64_t huge_bytes_ = 0;
  std::vector<void*> mappings_;  // what munmap takes: [c] the mapping chunk c lies in
  std::vector<size_t> mapping_bytes_;
  std::vector<uint8_t*> chunks_;
  std::vector<uint64_t> device_;
  double setup_seconds_ = 0;
};

// 0 .. n_slots-1 in random order.
std::vector<uint64_t> ShuffledPageSlots(uint64_t n_slots, std::mt19937_64& rng);

// One layer's selected rows for `batch` sequences of `context` tokens: sequence s's pages are
// slots[first_slot + s * context / kPageTokens + page]; each (sequence, head) picks kTopK distinct
// random tokens, sorted (as the agent sorts them). Page addresses are for the current device.
struct TopKRows {
  int batch = 0;
  std::vector<std::vector<uint64_t>> page_tables;  // [sequence][page]: GPU-visible page addresses
  std::vector<std::vector<int32_t>> tokens;        // [sequence * kHeads + head][kTopK], ascending
  std::vector<const uint8_t*> host_rows;           // every selected row's host address, in that order
};
TopKRows PickTopKRows(const RegisteredHostPages& pool, const std::vector<uint64_t>& slots, uint64_t first_slot,
                      int batch, int context, std::mt19937_64& rng);

}  // namespace specache::bench
