#include "host_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "specache/cuda_gather.h"

namespace specache::bench {

RegisteredHostPages::~RegisteredHostPages() {
  for (size_t c = 0; c < chunks_.size(); ++c) {
    if (c < device_.size()) (void)cuda::UnregisterHostMemory(chunks_[c]);  // nothing to do on failure
    munmap(chunks_[c], kChunkBytes);
  }
}

bool RegisteredHostPages::Create(int gib) {
  const auto t0 = std::chrono::steady_clock::now();
  const int n = static_cast<int>((uint64_t{static_cast<uint32_t>(gib)} << 30) / kChunkBytes);
  for (int c = 0; c < n; ++c) {
    const int fd = memfd_create("bench-chunk", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, kChunkBytes) != 0) {
      std::printf("host pages: memfd chunk %d: %s\n", c, std::strerror(errno));
      if (fd >= 0) close(fd);
      return false;
    }
    void* p = mmap(nullptr, kChunkBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
      std::printf("host pages: mmap chunk %d: %s\n", c, std::strerror(errno));
      return false;
    }
    chunks_.push_back(static_cast<uint8_t*>(p));
  }
  std::vector<std::thread> workers;
  const int threads = static_cast<int>(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([this, t, n, threads] {
      for (int c = t; c < n; c += threads) std::memset(chunks_[c], c & 0xFF, kChunkBytes);
    });
  }
  for (auto& w : workers) w.join();
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
