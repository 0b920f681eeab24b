// The daemon's memory: a fixed pool of memfd chunks, created at startup, pre-faulted by several
// threads and locked in RAM (mlock; when RLIMIT_MEMLOCK forbids it the pool still works and
// locked() says so). A chunk belongs to one owner (session) at a time and is handed out whole.
//
// Isolation when a chunk comes back: if its last owner can no longer map it (the process exited),
// the chunk is zeroed and reused; if the owner may still hold a mapping (it closed its session but
// lives on), the chunk's memory is replaced by a fresh memfd, so no physical page ever passes from
// one tenant to another. Chunks are sealed against resizing, so a client cannot shrink one under
// the daemon.
//
// Thread safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "specache/status.h"

namespace specache {

struct ChunkPoolOptions {
  uint64_t pool_bytes = uint64_t{1} << 30;
  uint64_t chunk_bytes = uint64_t{64} << 20;  // multiple of the page size (4 KiB)
  int prefault_threads = 4;
  bool lock_memory = true;
};

class ChunkPool {
 public:
  // INVALID_ARGUMENT for sizes that are zero or not page multiples, RESOURCE_EXHAUSTED when the
  // memory cannot be created.
  static Result<std::unique_ptr<ChunkPool>> Create(const ChunkPoolOptions& options);
  ~ChunkPool();

  // Takes n free chunks for `owner` (ids ascending). RESOURCE_EXHAUSTED if fewer are free.
  Result<std::vector<uint32_t>> Take(uint32_t n, uint64_t owner);
  // Gives chunks back. With `owner_may_still_map`, their memory is replaced instead of zeroed.
  Status Return(std::span<const uint32_t> chunks, bool owner_may_still_map);

  int fd(uint32_t chunk) const;           // memfd (owned by the pool)
  uint8_t* data(uint32_t chunk) const;    // the daemon's own mapping
  uint64_t chunk_bytes() const { return options_.chunk_bytes; }
  uint32_t chunk_count() const { return static_cast<uint32_t>(chunks_.size()); }
  uint32_t free_count() const;
  bool locked() const { return locked_; }
  uint64_t replaced_chunks() const;  // memfds replaced on return (owner still alive)

 private:
  struct Chunk {
    int fd = -1;
    uint8_t* data = nullptr;
    uint64_t owner = 0;  // 0: free
  };
  explicit ChunkPool(const ChunkPoolOptions& options) : options_(options) {}
  Status MakeChunk(Chunk* chunk, bool prefault);
  static void Unmap(Chunk* chunk, uint64_t bytes);

  ChunkPoolOptions options_;
  std::vector<Chunk> chunks_;
  mutable std::mutex mu_;
  bool locked_ = true;
  uint64_t replaced_ = 0;
};

}  // namespace specache
