#include "host_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "specache/chunk_mapping.h"
#include "specache/host_mapping.h"
#include "specache/cuda_gather.h"

namespace specache::bench {

const char* HostPageBackingName(HostPageBacking b) {
  switch (b) {
    case HostPageBacking::kBase: return "base";
    case HostPageBacking::kHugeShmem: return "thp-shmem";
    case HostPageBacking::kHugeAnon: return "thp-anon";
  }
  return "?";
}

bool ParseHostPageBacking(const std::string& name, HostPageBacking* out) {
  for (HostPageBacking b : {HostPageBacking::kBase, HostPageBacking::kHugeShmem, HostPageBacking::kHugeAnon}) {
    if (name == HostPageBackingName(b)) {
      *out = b;
      return true;
    }
  }
  return false;
}

RegisteredHostPages::~RegisteredHostPages() {
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (c < device_.size()) (void)cuda::UnregisterHostMemory(chunks_[c]);  // nothing to do on failure
  }
  for (size_t m = 0; m < mappings_.size(); ++m) munmap(mappings_[m], mapping_bytes_[m]);
}

bool RegisteredHostPages::Create(int gib, HostPageBacking backing) {
  const auto t0 = std::chrono::steady_clock::now();
  backing_ = backing;
  const int n = static_cast<int>((uint64_t{static_cast<uint32_t>(gib)} << 30) / kChunkBytes);
  const bool huge = backing != HostPageBacking::kBase;
  for (int c = 0; c < n; ++c) {
    // Anonymous huge pages need the chunk 2 MiB-aligned: it goes into a mapping one huge page
    // longer, unmapped whole at the end (memfd chunks: MapChunk aligns them).
    const size_t span = kChunkBytes + kHugePageBytes;
    void* reserved = nullptr;
    uint8_t* at = nullptr;
    if (backing == HostPageBacking::kHugeAnon) {
      reserved = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (reserved == MAP_FAILED) {
        std::printf("host pages: mmap anonymous chunk %d: %s\n", c, std::strerror(errno));
        return false;
      }
      at = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(reserved) + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
    } else {
      const int fd = memfd_create("bench-chunk", MFD_CLOEXEC);
      if (fd < 0 || ftruncate(fd, kChunkBytes) != 0) {
        std::printf("host pages: memfd chunk %d: %s\n", c, std::strerror(errno));
        if (fd >= 0) close(fd);
        return false;
      }
      void* p = MapChunk(fd, kChunkBytes, huge);  // as the daemon maps its chunks (chunk_mapping.h)
      close(fd);
      if (p == MAP_FAILED) {
        std::printf("host pages: mmap chunk %d: %s\n", c, std::strerror(errno));
        return false;
      }
      reserved = p;
      at = static_cast<uint8_t*>(p);
    }
    mappings_.push_back(reserved);
    mapping_bytes_.push_back(backing == HostPageBacking::kHugeAnon ? span : kChunkBytes);
    if (backing == HostPageBacking::kHugeAnon && madvise(at, kChunkBytes, MADV_HUGEPAGE) != 0 && c == 0) {
      std::printf("host pages: madvise(MADV_HUGEPAGE): %s (base pages then)\n", std::strerror(errno));
    }
    chunks_.push_back(at);
  }
  std::vector<std::thread> workers;
  const int threads = static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([this, t, n, threads] {
      for (int c = t; c < n; c += threads) std::memset(chunks_[c], c & 0xFF, kChunkBytes);
    });
  }
  for (auto& w : workers) w.join();
  std::vector<MemoryRange> ranges;
  for (uint8_t* c : chunks_) ranges.push_back({c, kChunkBytes});
  huge_bytes_ = MappedBytes(ranges).huge;
  for (uint8_t* c : chunks_) {
    auto d = cuda::RegisterHostMemory(c, kChunkBytes);
    if (!d.ok()) {
      std::printf("host pages: %s\n", d.status().ToString().c_str());
      return false;
    }
    device_.push_back(*d);
  }
  setup_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return true;
}

std::vector<uint64_t> ShuffledPageSlots(uint64_t n_slots, std::mt19937_64& rng) {
  std::vector<uint64_t> slots(n_slots);
  for (uint64_t i = 0; i < n_slots; ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  return slots;
}

TopKRows PickTopKRows(const RegisteredHostPages& pool, const std::vector<uint64_t>& slots, uint64_t first_slot,
                      int batch, int context, std::mt19937_64& rng) {
  constexpr uint64_t kPagesPerChunk = RegisteredHostPages::kChunkBytes / kPageBytes;
  const uint64_t pages_per_seq = static_cast<uint64_t>(context) / kPageTokens;
  TopKRows out;
  out.batch = batch;
  for (int s = 0; s < batch; ++s) {
    std::vector<uint64_t>& table = out.page_tables.emplace_back();
    for (uint64_t page = 0; page < pages_per_seq; ++page) {
      const uint64_t slot = slots[first_slot + static_cast<uint64_t>(s) * pages_per_seq + page];
      table.push_back(pool.device_address(static_cast<int>(slot / kPagesPerChunk)) + (slot % kPagesPerChunk) * kPageBytes);
    }
    for (int h = 0; h < kHeads; ++h) {
      std::vector<int> tokens;
      while (static_cast<int>(tokens.size()) < kTopK) {
        const int t = static_cast<int>(rng() % static_cast<uint64_t>(context));
        if (std::find(tokens.begin(), tokens.end(), t) == tokens.end()) tokens.push_back(t);
      }
      std::sort(tokens.begin(), tokens.end());
      for (int t : tokens) {
        const uint64_t slot = slots[first_slot + static_cast<uint64_t>(s) * pages_per_seq + t / kPageTokens];
        const int chunk = static_cast<int>(slot / kPagesPerChunk);
        const uint64_t offset = (slot % kPagesPerChunk) * kPageBytes +
                                (uint64_t{static_cast<uint32_t>(h)} * kPageTokens + t % kPageTokens) * kRowBytes;
        out.host_rows.push_back(pool.chunk(chunk) + offset);
      }
      out.tokens.emplace_back(tokens.begin(), tokens.end());
    }
  }
  return out;
}

}  // namespace specache::bench
